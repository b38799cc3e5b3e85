"""Which container a process runs in, from the text of its ``/proc/<pid>/cgroup``.

The file has one line per hierarchy, ``hierarchy-id:controllers:path``: on cgroup v2 a single
``0::/path``; on cgroup v1 one line per controller (``12:memory:/path``, ``1:name=systemd:/path``),
all naming the same container. The kubelet and the container runtime name the path; the layouts
recognised here, for a burstable pod ``<uid>`` and a container ``<id>`` (64 hex digits):

* systemd driver (``/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid_>.slice/``
  then): containerd ``cri-containerd-<id>.scope``; CRI-O ``crio-<id>.scope`` (crun may add a
  ``container`` sub-cgroup below it); Docker through cri-dockerd ``docker-<id>.scope``;
* cgroupfs driver (``/kubepods/burstable/pod<uid>/`` then): containerd and Docker ``<id>``;
  CRI-O ``crio-<id>``.

Guaranteed pods have no QoS level (``kubepods-pod<uid_>.slice``, ``/kubepods/pod<uid>``); the
systemd driver writes the pod UID with ``_`` for ``-``. Paths may be prefixed (kind's
``/kubelet.slice/kubelet-kubepods.slice``) or relative to the reader's cgroup namespace
(``/../../kubepods-…``): components are matched wherever they are. Containers outside Kubernetes
are recognised too, without a pod UID: Docker (``/docker/<id>``, ``docker-<id>.scope``) and
Podman (``libpod-<id>.scope``). CRI-O's monitor process (``crio-conmon-<id>.scope``) is not a
container.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["CgroupOwner", "container_of", "owner_of_path"]

_ID = r"[0-9a-f]{64}"
# A container's own cgroup: (runtime, pattern with the ID as group 1).
_CONTAINER_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("containerd", re.compile(rf"cri-containerd-({_ID})\.scope")),
    ("cri-o", re.compile(rf"crio-({_ID})(?:\.scope)?")),
    ("docker", re.compile(rf"docker-({_ID})\.scope")),
    ("podman", re.compile(rf"libpod-({_ID})(?:\.scope)?")),
    ("", re.compile(rf"({_ID})")),
)
_SYSTEMD_POD = re.compile(
    r"(?:[a-z0-9_]+-)*kubepods(?:-besteffort|-burstable)?-pod([0-9a-f]{8}(?:_[0-9a-f]{4}){3}_[0-9a-f]{12})\.slice"
)
_CGROUPFS_POD = re.compile(r"pod([0-9a-f]{8}(?:-[0-9a-f]{4}){3}-[0-9a-f]{12})")


@dataclass(frozen=True, slots=True)
class CgroupOwner:
    """The container a process runs in: its runtime ID, and its pod's UID under Kubernetes.

    ``runtime`` is ``containerd``, ``cri-o``, ``docker``, ``podman``, or empty when the layout
    does not say (the cgroupfs driver names containerd's and Docker's containers alike).
    """

    container_id: str
    pod_uid: str = ""
    runtime: str = ""


def owner_of_path(path: str) -> CgroupOwner | None:
    """The container whose cgroup ``path`` is (or lies inside), else ``None``."""
    parts = [p for p in path.split("/") if p and p not in {".", ".."}]
    for position in range(len(parts) - 1, -1, -1):
        found = _container(parts[position])
        if found is None:
            continue
        runtime, container_id = found
        if runtime == "":
            if not _is_bare_container(parts, position):
                continue
            if parts[position - 1] == "docker":
                runtime = "docker"
        pod_uid = _pod_uid(parts[:position])
        return CgroupOwner(container_id=container_id, pod_uid=pod_uid, runtime=runtime)
    return None


def container_of(text: str) -> CgroupOwner | None:
    """The container of a process, from its ``/proc/<pid>/cgroup`` text; ``None`` outside one.

    The cgroup v2 line is read first; on v1 every hierarchy's path is tried in turn (a process
    may sit in a container's cgroup of one controller only while it is being moved).
    """
    paths: list[tuple[int, str]] = []
    for line in text.splitlines():
        hierarchy, sep, rest = line.partition(":")
        if not sep:
            continue
        _, sep, path = rest.partition(":")
        if not sep:
            continue
        paths.append((0 if hierarchy.strip() == "0" else 1, path.strip()))
    for _, path in sorted(paths, key=lambda p: p[0]):
        owner = owner_of_path(path)
        if owner is not None:
            return owner
    return None


def _container(part: str) -> tuple[str, str] | None:
    if part.startswith("crio-conmon-"):
        return None
    for runtime, pattern in _CONTAINER_PATTERNS:
        match = pattern.fullmatch(part)
        if match is not None:
            return runtime, match.group(1)
    return None


def _is_bare_container(parts: list[str], position: int) -> bool:
    """A bare 64-hex component is a container under a pod (cgroupfs) or under ``docker``."""
    if position == 0:
        return False
    parent = parts[position - 1]
    return parent == "docker" or _CGROUPFS_POD.fullmatch(parent) is not None


def _pod_uid(parts: list[str]) -> str:
    for part in reversed(parts):
        match = _SYSTEMD_POD.fullmatch(part)
        if match is not None:
            return match.group(1).replace("_", "-")
        match = _CGROUPFS_POD.fullmatch(part)
        if match is not None:
            return match.group(1)
    return ""
