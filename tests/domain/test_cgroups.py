"""Process → container from /proc/<pid>/cgroup: every runtime, cgroup driver, version and QoS."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from support.cgroups import LAYOUTS, Layout, cgroup_file, host_cgroup_file

from gpuagent.domain.cgroups import CgroupOwner, container_of, owner_of_path

POD = "3f1c9a2e-7b4d-4e8f-9a01-23456789abcd"
CID = "8d2e" * 16


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.name)
def test_every_layout_names_pod_and_container(layout: Layout) -> None:
    owner = container_of(cgroup_file(layout, POD, CID))
    assert owner is not None
    assert owner.container_id == CID
    assert owner.pod_uid == POD
    # cgroupfs names containerd's and Docker's containers alike: the runtime is then unknown.
    expected = "" if layout.driver == "cgroupfs" and layout.runtime != "cri-o" else layout.runtime
    assert owner.runtime == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param(
            "0::/../../kubepods-besteffort-pod"
            "3f1c9a2e_7b4d_4e8f_9a01_23456789abcd.slice/cri-containerd-" + CID + ".scope\n",
            CgroupOwner(CID, POD, "containerd"),
            id="relative-to-cgroup-namespace",
        ),
        pytest.param(
            "0::/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-burstable.slice/"
            "kubelet-kubepods-burstable-pod3f1c9a2e_7b4d_4e8f_9a01_23456789abcd.slice/"
            "cri-containerd-" + CID + ".scope\n",
            CgroupOwner(CID, POD, "containerd"),
            id="kind-kubelet-prefix",
        ),
        pytest.param(
            "0::/kubepods.slice/kubepods-pod3f1c9a2e_7b4d_4e8f_9a01_23456789abcd.slice/crio-"
            + CID
            + ".scope/container\n",
            CgroupOwner(CID, POD, "cri-o"),
            id="crun-container-subgroup",
        ),
        pytest.param("0::/docker/" + CID + "\n", CgroupOwner(CID, "", "docker"), id="plain-docker"),
        pytest.param(
            "0::/system.slice/docker-" + CID + ".scope\n",
            CgroupOwner(CID, "", "docker"),
            id="plain-docker-systemd",
        ),
        pytest.param(
            "0::/user.slice/user-1000.slice/user@1000.service/user.slice/libpod-"
            + CID
            + ".scope\n",
            CgroupOwner(CID, "", "podman"),
            id="podman",
        ),
    ],
)
def test_other_layouts(text: str, expected: CgroupOwner) -> None:
    assert container_of(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        pytest.param(host_cgroup_file(2), id="host-service-v2"),
        pytest.param(host_cgroup_file(1), id="host-service-v1"),
        pytest.param("0::/\n", id="root"),
        pytest.param("", id="empty"),
        pytest.param("garbage without colons\n", id="garbage"),
        pytest.param(
            "0::/kubepods.slice/kubepods-pod3f1c9a2e_7b4d_4e8f_9a01_23456789abcd.slice/"
            "crio-conmon-" + CID + ".scope\n",
            id="crio-conmon",
        ),
        pytest.param("0::/kubepods/burstable/" + CID + "\n", id="bare-id-not-under-a-pod"),
        pytest.param("0::/kubepods/besteffort/pod" + POD + "\n", id="pod-sandbox-level"),
        pytest.param("0::/system.slice/" + CID[:-1] + "\n", id="short-id"),
    ],
)
def test_not_a_container(text: str) -> None:
    assert container_of(text) is None


def test_v2_line_preferred_but_v1_lines_read() -> None:
    # A hybrid node whose unified hierarchy is empty: the v1 lines name the container.
    layout = Layout("containerd", "cgroupfs", 1)
    owner = container_of(cgroup_file(layout, POD, CID))
    assert owner == CgroupOwner(CID, POD, "")


@given(st.text(max_size=300))
def test_never_raises(text: str) -> None:
    container_of(text)
    owner_of_path(text)
