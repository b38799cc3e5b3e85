"""MPS control daemons as values: what one is told, where its files are, and how it is doing.

A daemon (:class:`MpsDaemon`) serves a set of GPUs under a name: the resource it shares through
the device plugin (one daemon per shared resource, as NVIDIA's ``mps-control-daemon`` runs one
per resource), or any other set — a DRA claim's GPU — that passes per-client limits in the
client's environment instead (:func:`client_env`). Its files live under the MPS root
(:class:`MpsDirs`, NVIDIA's layout: ``<root>/<name>/pipe``, ``<root>/<name>/log``, one
``<root>/shm`` for every daemon). Facts from NVIDIA/k8s-device-plugin v0.20
(``cmd/mps-control-daemon/mps/daemon.go``, ``root.go``; read, not copied): each GPU's default
pinned memory limit is its memory divided by its replicas, in whole MiB; the default active
thread percentage is 100 divided by the replicas, whole.

The adapter reports each daemon's state as :class:`MpsStatus` into the node's state
(:class:`MpsState`); the devices of a daemon that is not up are unhealthy
(:mod:`gpuagent.domain.mpsplan`). Pure values, no I/O.
"""

from __future__ import annotations

import posixpath
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType

__all__ = [
    "CONTAINER_ROOT",
    "CONTAINER_SHM",
    "CONTROL_BINARY",
    "LOG_ENV",
    "PINNED_LIMIT_ENV",
    "PIPE_ENV",
    "THREAD_PERCENTAGE_ENV",
    "ComputeModeChoice",
    "MpsDaemon",
    "MpsDirs",
    "MpsGpu",
    "MpsState",
    "MpsStatus",
    "client_env",
    "daemon_reason",
    "server_pids",
]

CONTROL_BINARY = "nvidia-cuda-mps-control"
PIPE_ENV = "CUDA_MPS_PIPE_DIRECTORY"
LOG_ENV = "CUDA_MPS_LOG_DIRECTORY"
PINNED_LIMIT_ENV = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"
THREAD_PERCENTAGE_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
#: Where a container sees the MPS root (NVIDIA's ``ContainerRoot``) and the daemon's shm.
CONTAINER_ROOT = "/mps"
CONTAINER_SHM = "/dev/shm"


class ComputeModeChoice(StrEnum):
    """What the agent does to a shared GPU's compute mode (``--mps-compute-mode``).

    ``exclusive-process``: NVIDIA's (``nvidia-smi -c EXCLUSIVE_PROCESS`` before the daemon
    starts): only the MPS server holds a context on the GPU, so no process bypasses the daemon's
    limits; the mode the GPU had is set back when the daemon stops. ``unchanged``: the mode is
    left as it is (a GPU whose settings belong to someone else).
    """

    EXCLUSIVE_PROCESS = "exclusive-process"
    UNCHANGED = "unchanged"


@dataclass(frozen=True, slots=True)
class MpsDirs:
    """The MPS root's layout (``--mps-root``, a host path the agent sees at the same path)."""

    root: str = "/run/nvidia/mps"

    def pipe(self, name: str) -> str:
        return posixpath.join(self.root, name, "pipe")

    def log(self, name: str) -> str:
        return posixpath.join(self.root, name, "log")

    @property
    def shm(self) -> str:
        return posixpath.join(self.root, "shm")

    @staticmethod
    def container_pipe(name: str) -> str:
        """Where a container given a device of daemon ``name`` finds its pipe directory."""
        return posixpath.join(CONTAINER_ROOT, name, "pipe")


@dataclass(frozen=True, slots=True)
class MpsGpu:
    """A GPU under a daemon. ``memory_mib`` 0: no default pinned memory limit is set for it."""

    index: int
    uuid: str
    memory_mib: int = 0
    replicas: int = 1

    @property
    def pinned_limit_mib(self) -> int:
        """Each client's default pinned memory limit: the GPU's memory over its replicas."""
        return self.memory_mib // max(self.replicas, 1)


@dataclass(frozen=True, slots=True)
class MpsDaemon:
    """One control daemon: ``name`` (its directories' name), its GPUs by index, and the default
    active thread percentage its clients get (``None``: the daemon's own default, 100)."""

    name: str
    gpus: tuple[MpsGpu, ...]
    thread_percentage: int | None = None

    @property
    def uuids(self) -> tuple[str, ...]:
        return tuple(g.uuid for g in self.gpus)

    def commands(self, server: int | None = None) -> tuple[str, ...]:
        """What the control daemon is told once it is up, in order: each GPU's default pinned
        memory limit (where its memory is known), then the active thread percentage. With
        ``server`` (a pid), the same limits for that server, already running: the defaults reach
        only the servers started after them (NVIDIA's MPS documentation, "Legacy MPS v2
        Interface")."""
        if server is None:
            limit, percentage = (
                "set_default_device_pinned_mem_limit",
                "set_default_active_thread_percentage",
            )
        else:
            limit, percentage = (
                f"set_device_pinned_mem_limit {server}",
                f"set_active_thread_percentage {server}",
            )
        out = [
            f"{limit} {g.index} {g.pinned_limit_mib}M" for g in self.gpus if g.pinned_limit_mib > 0
        ]
        if self.thread_percentage is not None:
            out.append(f"{percentage} {self.thread_percentage}")
        return tuple(out)


def server_pids(answer: str) -> tuple[int, ...]:
    """The servers ``get_server_list`` names (a pid a line; nothing when none runs)."""
    return tuple(int(word) for word in answer.split() if word.isdecimal())


def client_env(
    dirs: MpsDirs,
    name: str,
    *,
    pinned_limits_mib: Mapping[int, int] | None = None,
    thread_percentage: int | None = None,
) -> dict[str, str]:
    """A client's environment for daemon ``name`` as a container sees it: the pipe directory,
    and its own limits where given (``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` as ``"0=2048M,1=…"``
    by the client's device ordinal, ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``), which override the
    daemon's defaults for that client."""
    env = {PIPE_ENV: dirs.container_pipe(name)}
    if pinned_limits_mib:
        env[PINNED_LIMIT_ENV] = ",".join(
            f"{ordinal}={mib}M" for ordinal, mib in sorted(pinned_limits_mib.items())
        )
    if thread_percentage is not None:
        env[THREAD_PERCENTAGE_ENV] = str(thread_percentage)
    return env


@dataclass(frozen=True, slots=True)
class MpsStatus:
    """How one daemon is doing, as its keeper last said.

    ``up``: running and configured (its devices may be allocated); ``error``: why not, while
    not; ``starts``: how often it was started since the agent started (a restart counts);
    ``daemon``: what it was started as (its GPUs and limits), so a daemon still running with
    the limits of an earlier plan is not taken for the current one.
    """

    up: bool = False
    error: str = "starting"
    starts: int = 0
    daemon: MpsDaemon | None = None


def _no_daemons() -> Mapping[str, MpsStatus]:
    return MappingProxyType({})


@dataclass(frozen=True, slots=True)
class MpsState:
    """Every control daemon the agent keeps, by name."""

    daemons: Mapping[str, MpsStatus] = field(default_factory=_no_daemons)

    def status(self, name: str) -> MpsStatus | None:
        return self.daemons.get(name)

    def with_status(self, name: str, status: MpsStatus | None) -> MpsState:
        """This state with daemon ``name``'s status replaced (``None``: the daemon is gone)."""
        daemons = {k: v for k, v in self.daemons.items() if k != name}
        if status is not None:
            daemons[name] = status
        return MpsState(MappingProxyType(dict(sorted(daemons.items()))))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, MpsState):
            return NotImplemented
        return dict(self.daemons) == dict(other.daemons)

    def __hash__(self) -> int:
        return hash(tuple(self.daemons.items()))


def daemon_reason(daemon: MpsDaemon, state: MpsState) -> str | None:
    """Why ``daemon``'s clients cannot be served now; ``None`` while it is up as planned."""
    status = state.status(daemon.name)
    if status is not None and status.up and status.daemon == daemon:
        return None
    if status is None:
        why = "not started"
    elif status.up:
        why = "running with the limits of an earlier configuration"
    else:
        why = status.error
    return f"MPS control daemon for {daemon.name}: {why}"
