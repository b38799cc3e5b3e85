"""``/proc/<pid>/cgroup`` files as the kubelet and each container runtime lay them out.

:func:`cgroup_file` writes the text a process of a container has, for every combination of
cgroup version (v1, v2), cgroup driver (systemd, cgroupfs), runtime (containerd, CRI-O, Docker
through cri-dockerd) and QoS class; :func:`write_proc` builds a ``--proc-root`` folder of them.
The layouts follow what those components create on a node (see gpuagent/domain/cgroups.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = ["LAYOUTS", "Layout", "cgroup_file", "host_cgroup_file", "write_proc"]

RUNTIMES = ("containerd", "cri-o", "docker")
DRIVERS = ("systemd", "cgroupfs")
VERSIONS = (1, 2)
QOS = ("guaranteed", "burstable", "besteffort")
# The controllers of a cgroup v1 node, as /proc/<pid>/cgroup lists them (hierarchy ids vary).
V1_CONTROLLERS = (
    "misc", "rdma", "pids", "hugetlb", "net_cls,net_prio", "cpu,cpuacct", "perf_event",
    "freezer", "memory", "devices", "cpuset", "blkio",
)  # fmt: skip


@dataclass(frozen=True)
class Layout:
    runtime: str
    driver: str
    version: int
    qos: str = "burstable"

    @property
    def name(self) -> str:
        return f"{self.runtime}-{self.driver}-v{self.version}-{self.qos}"


LAYOUTS = tuple(
    Layout(r, d, v, q) for r in RUNTIMES for d in DRIVERS for v in VERSIONS for q in QOS
)


def container_path(layout: Layout, pod_uid: str, container_id: str) -> str:
    """The container's cgroup path (from the hierarchy root)."""
    if layout.driver == "systemd":
        uid = pod_uid.replace("-", "_")
        if layout.qos == "guaranteed":
            pod = f"/kubepods.slice/kubepods-pod{uid}.slice"
        else:
            pod = (
                f"/kubepods.slice/kubepods-{layout.qos}.slice/kubepods-{layout.qos}-pod{uid}.slice"
            )
        scope = {"containerd": "cri-containerd", "cri-o": "crio", "docker": "docker"}[
            layout.runtime
        ]
        return f"{pod}/{scope}-{container_id}.scope"
    pod = (
        f"/kubepods/pod{pod_uid}"
        if layout.qos == "guaranteed"
        else (f"/kubepods/{layout.qos}/pod{pod_uid}")
    )
    leaf = f"crio-{container_id}" if layout.runtime == "cri-o" else container_id
    return f"{pod}/{leaf}"


def _lines(version: int, path: str, systemd_path: str | None = None) -> str:
    if version == 2:
        return f"0::{path}\n"
    lines = [f"{n}:{c}:{path}" for n, c in enumerate(V1_CONTROLLERS, start=2)]
    lines.append(f"1:name=systemd:{systemd_path or path}")
    lines.append("0::/")  # the (empty) unified hierarchy of a hybrid node
    return "\n".join(reversed(lines)) + "\n"


def cgroup_file(layout: Layout, pod_uid: str, container_id: str) -> str:
    """The ``/proc/<pid>/cgroup`` text of a process in that container."""
    return _lines(layout.version, container_path(layout, pod_uid, container_id))


def host_cgroup_file(version: int = 2) -> str:
    """A process outside any container (a service on the host)."""
    return _lines(version, "/system.slice/some-daemon.service")


def write_proc(root: Path, files: Mapping[int, str]) -> Path:
    """A ``--proc-root`` folder: ``<root>/<pid>/cgroup`` for each pid."""
    for pid, text in files.items():
        (root / str(pid)).mkdir(parents=True, exist_ok=True)
        (root / str(pid) / "cgroup").write_text(text)
    return root
