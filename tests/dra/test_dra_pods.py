"""Pods that hold GPUs through ResourceClaims, end to end: the kubelet's pod-resources stand-in
lists their claimed devices (``dynamic_resources``, Kubernetes 1.34+), a CRI stand-in and cgroup
files name their processes, and /metrics attributes the GPU to them as it does a device-plugin
holder — never as work on a GPU the kubelet did not allocate."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e.agentrun import running_agent
from e2e.test_container_accounting import samples
from support.cgroups import Layout, cgroup_file, write_proc
from support.fake_apiserver import FakeApiServer, claim
from support.fake_cri import FakeCri, RuntimeContainer
from support.fake_plugin_watcher import FakePluginWatcher
from support.fake_podresources import Claimed, FakePodResources, Held
from support.grpcstubs import CriStubs
from support.waiting import eventually

from dra.test_dra_flow import DRIVER, FAST_DRA, NODE, Dirs, registered

PID, OTHER_PID = 4002, 4003
UID = "5eed0000-0000-4000-8000-000000004002"


def container_id(pid: int) -> str:
    return f"{pid:064x}"


@pytest.fixture
def runtime(short_tmp_path: Path, cri_stubs: CriStubs) -> Iterator[FakeCri]:
    with FakeCri(short_tmp_path / "cri" / "containerd.sock", cri_stubs) as fake:
        fake.set([
            RuntimeContainer(container_id(PID), "ml", "trainer", "main", pod_uid=UID),
            RuntimeContainer(container_id(OTHER_PID), "ml", "stowaway", "main", pod_uid=UID),
        ])  # fmt: skip
        yield fake


async def test_a_claim_holder_is_attributed_and_not_unallocated(
    dirs: Dirs,
    device_plugin_dir: Path,
    apiserver: FakeApiServer,
    pod_resources: FakePodResources,
    runtime: FakeCri,
    tmp_path: Path,
) -> None:
    layout = Layout("containerd", "systemd", 2, "guaranteed")
    proc = write_proc(
        tmp_path / "proc",
        {pid: cgroup_file(layout, UID, container_id(pid)) for pid in (PID, OTHER_PID)},
    )
    pod_resources.set([
        Claimed("ml", "trainer", "main", "gpus", DRIVER, NODE, "gpu-2"),
        Claimed("ml", "elsewhere", "main", "gpus", "net.example.com", NODE, "gpu-3"),
        Held("ml", "plugin-pod", "main", "nvidia.com/gpu", ("GPU-none",)),
    ])  # fmt: skip
    args = dirs.args(apiserver, extra=(
        "--pod-resources-socket", str(pod_resources.socket_path),
        "--cri-socket", str(runtime.socket_path),
        "--proc-root", str(proc),
        "--container-logs-dir", str(proc / "no-log-links"),
        "--container-accounting=true",
        "--poll-interval", "0.3",
    ))  # fmt: skip
    options = {"node_name": NODE, "dra_options": FAST_DRA}
    async with running_agent(device_plugin_dir, args, agent_options=options) as run:
        store = run.agent.store
        await eventually(lambda: store.snapshot.pods.allocated, what="the claims listed")
        gpu2 = store.snapshot.gpu(2)
        assert gpu2 is not None
        assert gpu2.minor == 2  # its DRA device is gpu-2
        for pid, gpu in ((PID, 2), (OTHER_PID, 3)):
            body = {"gpu": gpu, "pid": pid, "memory_mib": 512, "sm_util": 30}
            async with run.http.post(run.base_url + "/sim/processes", json=body) as response:
                assert response.status == 200, await response.text()

        def named(text: str) -> bool:
            pods = {lbl["pod"] for lbl, _ in samples(text, "gpuagent_container_gpu_processes")}
            return {"trainer", "stowaway"} <= pods

        text = await run.metrics_until(named)
        allocated = {
            (lbl["gpu"], lbl["pod"]) for lbl, _ in samples(text, "gpuagent_device_allocated")
        }
        assert allocated == {("2", "trainer")}  # not the other driver's claim, nor GPU-none
        temps = {lbl["gpu"]: lbl["pod"] for lbl, _ in samples(text, "DCGM_FI_DEV_GPU_TEMP")}
        assert temps["2"] == "trainer"  # one holder: its labels, as dcgm-exporter's dashboards
        assert temps["3"] == ""
        unallocated = {
            (lbl["gpu"], lbl["pod"]): v for lbl, v in samples(text, "gpuagent_gpu_unallocated_use")
        }
        # The claim holder's work is allocated work; the process nobody allocated GPU 3 to is not.
        assert unallocated[("2", "")] == 0
        assert unallocated[("3", "stowaway")] == 1
        assert ("2", "trainer") not in unallocated
        await eventually(lambda: apiserver.invalid == [], what="valid writes")


async def test_a_prepared_claim_has_pod_resources_asked_again_at_once(
    dirs: Dirs,
    device_plugin_dir: Path,
    apiserver: FakeApiServer,
    pod_resources: FakePodResources,
    watcher: FakePluginWatcher,
) -> None:
    """As after a device plugin's Allocate: a claim just prepared is a container about to hold
    a GPU, so the kubelet's pod-resources is asked again soon, not at the next hourly timer."""
    args = dirs.args(apiserver, extra=(
        "--pod-resources-socket", str(pod_resources.socket_path),
        "--pod-resources-interval", "3600",
    ))  # fmt: skip
    options = {"node_name": NODE, "dra_options": FAST_DRA}
    async with running_agent(device_plugin_dir, args, agent_options=options) as run:
        store = run.agent.store
        await eventually(lambda: store.snapshot.pods.refreshed_at is not None, what="listed")
        calls = pod_resources.calls
        reg = await registered(watcher)
        await eventually(lambda: "gpu-2" in apiserver.devices(), what="gpu-2 published")
        pod_resources.set([Claimed("ml", "trainer", "main", "gpus", DRIVER, NODE, "gpu-2")])
        apiserver.add_claim(claim("ml", "gpus", "u-gpus", [("gpu", DRIVER, NODE, "gpu-2")]))
        prepared = await watcher.aprepare(reg, [("ml", "gpus", "u-gpus")])
        assert prepared.claims["u-gpus"].error == ""
        await eventually(
            lambda: any(a.pod == "trainer" for a in store.snapshot.pods.allocated),
            what="the claim holder listed",
        )
        assert pod_resources.calls > calls
