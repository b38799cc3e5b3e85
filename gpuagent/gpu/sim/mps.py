"""MPS in the simulated driver: a process that is a client of a control daemon, and its server.

A process started with ``mps`` (``POST /sim/processes``: ``{"pipe_directory": …}``, the pipe
directory as the node sees it — what the container's ``CUDA_MPS_PIPE_DIRECTORY`` points at), or
typed ``mps`` without it (CUDA's default pipe directory, :data:`DEFAULT_PIPE`), connects to that
directory's control daemon as a CUDA client does when it creates its context (:func:`connect`,
over the daemon's ``control`` socket: the stand-in of :mod:`gpuagent.gpu.sim.mpscontrol`). The
daemon answers with its server — started now, with the daemon's defaults, if it had none — and
the client runs under that server's limits: its pinned device memory limit for the GPU and its
active thread percentage. A client's own ``pinned_mem_limit_mib`` / ``active_thread_percentage``
(its ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` / ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``) only lower
them: NVIDIA's documentation says so of the percentage ("if the control daemon has a lower
setting, the control daemon setting will be obeyed"); it is silent on the memory limit, and the
simulator takes the stricter reading for it too. A client asking for more memory than its limit
is refused as CUDA refuses the allocation (``cudaErrorMemoryAllocation``); its SM utilisation is
held to its thread percentage. When no daemon answers, the process runs without MPS, as CUDA
falls back — a plain compute process, which the compute mode admits or refuses like any other.

A server serves at most :func:`max_clients` clients per GPU; the next one's context creation
fails (``cudaErrorMpsMaxClientsReached``). NVIDIA's MPS documentation: 16 client contexts per
device before Volta, 48 from Volta "on CUDA 13.0 and prior", 60 after.

Each server is a compute process named ``nvidia-cuda-mps-server`` with a context of
:data:`SERVER_MEMORY_MIB` on each GPU one of its clients ran on, started with the first client
there. As a real one, it outlives its clients: it goes when its daemon has gone (``quit``, a
signal; the daemon's pid file no longer names a live process) and no client of it is left on that
GPU (:meth:`Servers.reap`); in an exclusive compute mode it holds the GPU all that time. A new
daemon on the same pipe directory starts a new server, with a new pid.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pynvml

from gpuagent.gpu.sim import mpscontrol
from gpuagent.gpu.sim.processes import GpuHandle, ProcessTable, Refused, SimProcess, new_process

__all__ = [
    "SERVER_MEMORY_MIB",
    "SERVER_NAME",
    "ClientLimits",
    "MpsClient",
    "Server",
    "Servers",
    "connect",
    "connect_process",
    "max_clients",
]

SERVER_NAME = "nvidia-cuda-mps-server"
#: The server's own memory on a GPU (what nvidia-smi showed on an H200: reference/real-h200).
SERVER_MEMORY_MIB = 66.0
#: Servers' pids: from here up, one per server started (below Linux's largest pid, 4194304).
SERVER_PID_BASE = 4_100_000
#: How often NVML calls look for servers whose daemon has gone (monotonic seconds).
REAP_PERIOD_S = 0.1
#: Where CUDA looks for the control daemon without ``CUDA_MPS_PIPE_DIRECTORY``.
DEFAULT_PIPE = mpscontrol.DEFAULT_PIPE
#: The first CUDA driver version whose MPS server takes 60 clients a device (48 until 13.0).
SIXTY_CLIENTS_CUDA = 13010
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


@dataclass(frozen=True, slots=True)
class Server:
    """A daemon's server as the daemon answered a connecting client."""

    pipe_directory: str
    pid: int
    daemon_pid: int
    active_thread_percentage: float
    pinned_mem_limits_mib: Mapping[int, float] = field(default_factory=dict)

    def limits(self, client: MpsClient, gpu: int) -> ClientLimits:
        """What ``client`` runs under on GPU ``gpu``: the server's limits, lowered by its own."""
        pinned = _lowest(self.pinned_mem_limits_mib.get(gpu), client.pinned_mem_limit_mib)
        share = _lowest(self.active_thread_percentage, client.active_thread_percentage)
        return ClientLimits(pinned, self.active_thread_percentage if share is None else share)

    @classmethod
    def parse(cls, pipe: str, answer: str) -> Server | None:
        """The daemon's answer to ``sim_client_connect``; ``None`` when it is not one."""
        words = answer.split()
        try:
            pid, daemon, share = int(words[0]), int(words[1]), float(words[2])
            limits = {int(d): float(m) for d, _, m in (w.partition("=") for w in words[3:])}
        except (IndexError, ValueError):
            return None
        return cls(pipe, pid, daemon, share, limits)


def connect_process(servers: Servers, raw: object, kind: object) -> tuple[MpsClient, Server] | None:
    """A process's client (``raw``: its ``mps``; CUDA's default pipe directory for one of
    ``kind`` ``mps`` without it) connected to its daemon's server; ``None`` for a process that
    is no client, or whose daemon does not answer (it runs without MPS, as CUDA does then).
    ``ValueError`` for a bad ``raw``."""
    client = MpsClient.parse(raw)
    if client is None and kind == "mps":
        client = MpsClient(DEFAULT_PIPE)
    server = None if client is None else connect(client, servers.next_pid())
    return None if client is None or server is None else (client, server)


def connect(client: MpsClient, pid: int) -> Server | None:
    """Connect ``client`` to its daemon, which starts its server (as process ``pid``) if it has
    none (blocking: a socket round trip); ``None`` when no daemon answers there."""
    try:
        ok, answer = mpscontrol.ask(client.pipe_directory, f"sim_client_connect {pid}")
    except OSError:
        return None
    return Server.parse(client.pipe_directory, answer) if ok else None


def max_clients(architecture: int, cuda_driver_version: int) -> int:
    """How many clients an MPS server serves on one GPU (NVIDIA's MPS documentation)."""
    if architecture < int(pynvml.NVML_DEVICE_ARCH_VOLTA):
        return 16
    return 60 if cuda_driver_version >= SIXTY_CLIENTS_CUDA else 48


def _lowest(*values: float | None) -> float | None:
    given = [v for v in values if v is not None]
    return min(given) if given else None


def _positive(value: object, key: str, most: float) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"'mps.{key}' must be a number, got {value!r}")
    if not 0 < value <= most:
        raise ValueError(f"'mps.{key}' must be above 0 and at most {most:g}, got {value!r}")
    return float(value)


def _daemon_alive(pipe: str, pid: int) -> bool:
    """Whether the daemon ``pid`` still runs on ``pipe`` (its pid file names it, and it lives)."""
    return mpscontrol.running_pid(Path(pipe) / mpscontrol.PID_FILE) == pid


@dataclass
class Servers:
    """The MPS servers of the simulated node: which daemon (pipe directory) each belongs to."""

    cuda_driver_version: int
    pids: Iterator[int] = field(default_factory=lambda: itertools.count(SERVER_PID_BASE))
    running: dict[int, Server] = field(default_factory=dict)  # by the server's pid
    daemon_alive: Callable[[str, int], bool] = _daemon_alive
    looked: float = -math.inf  # when reap_due last reaped

    def next_pid(self) -> int:
        """A pid for a server a daemon may start now (a daemon that has one answers its own);
        safe without the driver's lock (``itertools.count`` under the GIL)."""
        return next(self.pids)

    def reap(self, table: ProcessTable) -> list[SimProcess]:
        """End each server context whose daemon has gone and which serves no client on its GPU
        any more (a server of a live daemon stays, with or without clients); returns them."""
        # Each daemon asked once (a pid file read), not once per GPU its server is on.
        gone = {pid for pid, server in self.running.items() if not self._alive(server)}
        if not gone:
            return []
        ended = []
        for process in table.all():
            if process.pid not in gone or process.name != SERVER_NAME:
                continue
            if _clients(table, process.gpu, process.pid):
                continue
            ended.extend(table.remove_from(process.gpu, process.pid))
        still = {p.pid for p in table.all()}
        self.running = {pid: s for pid, s in self.running.items() if pid in still}
        return ended

    def start(
        self,
        gpu: GpuHandle,
        table: ProcessTable,
        connected: tuple[MpsClient, Server],
        **process: object,
    ) -> SimProcess:
        """Start MPS client ``process`` (``new_process``'s arguments) on ``gpu``, connected to its
        daemon's server (at most :func:`max_clients` clients a GPU), and that server's context
        there if it has none yet; raises :class:`Refused` or ``ValueError``, and then starts
        nothing."""
        client, server = connected
        limits = server.limits(client, gpu.index)
        _check_limit(gpu, client, limits, process.get("memory_mib"))
        util = process.get("sm_util")
        if isinstance(util, int | float) and not isinstance(util, bool):
            process["sm_util"] = min(float(util), limits.active_thread_percentage)
        if gpu.mig_enabled:
            raise ValueError(f"GPU {gpu.index} is in MIG mode: MPS clients there are not simulated")
        pipe = server.pipe_directory
        others = [p for p in _clients(table, gpu.index, server.pid) if p.pid != process.get("pid")]
        if len(others) >= max_clients(gpu.spec.architecture, self.cuda_driver_version):
            raise Refused(
                "cudaErrorMpsMaxClientsReached",
                f"the MPS server {server.pid} (daemon on {pipe}) serves {len(others)} clients on "
                f"GPU {gpu.index}, its most",
            )
        made = None
        if not any(p.pid == server.pid for p in table.on(gpu)):
            made = new_process(
                gpu, table, pid=server.pid, memory_mib=SERVER_MEMORY_MIB, sm_util=0,
                name=SERVER_NAME, mps_server=server.pid,
            )  # fmt: skip
            table.add(made)
        try:
            started = new_process(gpu, table, kind="mps", mps_server=server.pid, **process)
        except ValueError:
            if made is not None:
                table.remove_from(gpu.index, made.pid)
            raise
        table.add(started)
        self.running.setdefault(server.pid, server)
        return started

    def reap_due(self, table: ProcessTable, now: float) -> None:
        """:meth:`reap` at most every :data:`REAP_PERIOD_S` (``now``: monotonic seconds): NVML
        calls look this way for servers whose daemon has gone, a pid file read each."""
        if now - self.looked >= REAP_PERIOD_S:
            self.looked = now
            self.reap(table)

    def _alive(self, server: Server) -> bool:
        return self.daemon_alive(server.pipe_directory, server.daemon_pid)


def _clients(table: ProcessTable, gpu: int, server: int) -> list[SimProcess]:
    return [p for p in table.on_gpu(gpu) if p.kind == "mps" and p.mps_server == server]


def _check_limit(gpu: GpuHandle, client: MpsClient, limits: ClientLimits, memory: object) -> None:
    limit = limits.pinned_mem_limit_mib
    if isinstance(memory, int | float) and limit is not None and memory > limit:
        raise Refused(
            "cudaErrorMemoryAllocation",
            f"{memory:g} MiB asked on GPU {gpu.index}, past the client's pinned device memory "
            f"limit of {limit:g} MiB (MPS daemon on {client.pipe_directory})",
        )
