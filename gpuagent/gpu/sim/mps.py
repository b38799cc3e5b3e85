"""MPS in the simulated driver: a process that is a client of a control daemon, and its server.

A process started with ``mps`` (``POST /sim/processes``: ``{"pipe_directory": …}``, the pipe
directory as the node sees it — what the container's ``CUDA_MPS_PIPE_DIRECTORY`` points at) asks
that directory's control daemon for its limits, as a CUDA client does when it starts
(:func:`client_limits`, over the daemon's ``control`` socket: the stand-in of
:mod:`gpuagent.gpu.sim.mpscontrol`, or any daemon speaking its protocol). The daemon's default
pinned memory limit for the GPU and its default active thread percentage apply, unless the client
sets its own (``pinned_mem_limit_mib``, ``active_thread_percentage``: its
``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` for this GPU and ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``).
A client asking for more memory than its limit is refused as CUDA refuses the allocation
(``cudaErrorMemoryAllocation``); its SM utilisation is held to its thread percentage. When no
daemon answers, the process runs without MPS, as CUDA falls back — a plain compute process, which
an exclusive compute mode may refuse.

Each daemon's server is a compute process named ``nvidia-cuda-mps-server`` with a context of
:data:`SERVER_MEMORY_MIB` on each GPU one of its clients runs on, started with the first client
there and ended with the last (a real server outlives its clients until the daemon asks it to go;
the simulator keeps it only while it serves). Its pid is fixed per pipe directory.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from gpuagent.gpu.sim import mpscontrol
from gpuagent.gpu.sim.processes import GpuHandle, ProcessTable, Refused, SimProcess, new_process

__all__ = [
    "SERVER_MEMORY_MIB",
    "SERVER_NAME",
    "ClientLimits",
    "MpsClient",
    "client_limits",
    "end_servers",
    "start_client",
]

SERVER_NAME = "nvidia-cuda-mps-server"
#: The server's own memory on a GPU (what nvidia-smi showed on an H200: reference/real-h200).
SERVER_MEMORY_MIB = 66.0
#: Servers' pids: from here up, one per pipe directory (below Linux's largest pid, 4194304).
SERVER_PID_BASE = 4_100_000
_KEYS = {"pipe_directory", "pinned_mem_limit_mib", "active_thread_percentage"}


@dataclass(frozen=True, slots=True)
class MpsClient:
    """What a process says of MPS: its daemon's pipe directory, and its own limits if any."""

    pipe_directory: str
    pinned_mem_limit_mib: float | None = None
    active_thread_percentage: float | None = None

    @classmethod
    def parse(cls, raw: object) -> MpsClient | None:
        """``raw`` (the ``mps`` of a process's JSON) checked; ``ValueError`` says what is wrong."""
        if raw is None:
            return None
        if not isinstance(raw, Mapping):
            raise ValueError(f"'mps' must be an object {{pipe_directory, …}}, got {raw!r}")  # noqa: TRY004
        unknown = set(raw) - _KEYS
        if unknown:
            raise ValueError(f"'mps': unknown keys {sorted(map(str, unknown))}")
        pipe = raw.get("pipe_directory")
        if not isinstance(pipe, str) or not pipe.startswith("/"):
            raise ValueError(f"'mps.pipe_directory' must be an absolute path, got {pipe!r}")
        limit = _positive(raw.get("pinned_mem_limit_mib"), "pinned_mem_limit_mib", 1e12)
        share = _positive(raw.get("active_thread_percentage"), "active_thread_percentage", 100)
        return cls(pipe, limit, share)


@dataclass(frozen=True, slots=True)
class ClientLimits:
    """What a client runs under on one GPU (``None``: no limit)."""

    pinned_mem_limit_mib: float | None
    active_thread_percentage: float


def client_limits(client: MpsClient, gpu: int) -> ClientLimits | None:
    """The limits ``client`` runs under on GPU ``gpu``, asked of its daemon (blocking: a socket
    round trip); ``None`` when no daemon answers there."""
    try:
        ok, limit = mpscontrol.ask(
            client.pipe_directory, f"get_default_device_pinned_mem_limit {gpu}"
        )
        _, share = mpscontrol.ask(client.pipe_directory, "get_default_active_thread_percentage")
    except OSError:
        return None
    pinned = client.pinned_mem_limit_mib
    if pinned is None and ok and limit.endswith("M") and limit[:-1].isdecimal():
        pinned = float(limit[:-1])
    percentage = client.active_thread_percentage
    if percentage is None:
        try:
            percentage = float(share)
        except ValueError:
            percentage = 100.0
    return ClientLimits(pinned, percentage)


def _positive(value: object, key: str, most: float) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"'mps.{key}' must be a number, got {value!r}")
    if not 0 < value <= most:
        raise ValueError(f"'mps.{key}' must be above 0 and at most {most:g}, got {value!r}")
    return float(value)


def server_pid(servers: dict[str, int], pipe: str) -> int:
    """The pid of the server of the daemon on ``pipe`` (one per pipe directory, for good)."""
    return servers.setdefault(pipe, SERVER_PID_BASE + len(servers))


def start_client(
    gpu: GpuHandle,
    table: ProcessTable,
    servers: dict[str, int],
    client: MpsClient,
    limits: ClientLimits,
    **process: object,
) -> SimProcess:
    """Start MPS client ``process`` (``new_process``'s arguments) on ``gpu`` under ``limits``,
    and its daemon's server there if it has none yet; raises :class:`Refused` or
    ``ValueError``, and then starts nothing."""
    memory = process.get("memory_mib")
    limit = limits.pinned_mem_limit_mib
    if isinstance(memory, int | float) and limit is not None and memory > limit:
        raise Refused(
            "cudaErrorMemoryAllocation",
            f"{memory:g} MiB asked on GPU {gpu.index}, past the client's pinned device memory "
            f"limit of {limit:g} MiB (MPS daemon on {client.pipe_directory})",
        )
    util = process.get("sm_util")
    if isinstance(util, int | float) and not isinstance(util, bool):
        process["sm_util"] = min(float(util), limits.active_thread_percentage)
    if gpu.mig_enabled:
        raise ValueError(f"GPU {gpu.index} is in MIG mode: MPS clients there are not simulated")
    pid = server_pid(servers, client.pipe_directory)
    made = None
    if not any(p.pid == pid for p in table.on(gpu)):
        made = new_process(
            gpu, table, pid=pid, memory_mib=SERVER_MEMORY_MIB, sm_util=0, name=SERVER_NAME,
            mps_pipe=client.pipe_directory,
        )  # fmt: skip
        table.add(made)
    try:
        started = new_process(gpu, table, kind="mps", mps_pipe=client.pipe_directory, **process)
    except ValueError:
        if made is not None:
            table.remove_from(gpu.index, made.pid)
        raise
    table.add(started)
    return started


def end_servers(table: ProcessTable, servers: Mapping[str, int]) -> list[SimProcess]:
    """End each server context left without a client on its GPU; returns them."""
    ended = []
    for process in table.all():
        if process.name != SERVER_NAME or servers.get(process.mps_pipe) != process.pid:
            continue
        clients = [
            p
            for p in table.on_gpu(process.gpu)
            if p.kind == "mps" and p.mps_pipe == process.mps_pipe
        ]
        if not clients:
            ended.extend(table.remove_from(process.gpu, process.pid))
    return ended
