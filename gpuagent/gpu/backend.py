"""What the monitor needs from a driver backend: the :class:`Backend` protocol and its values.

:class:`gpuagent.gpu.nvml.Nvml` is the implementation (pynvml over the real or the simulated
driver); tests wrap it to hang or delay a call without subclassing it. Every method blocks and
is called from a worker thread, one GPU's work on that GPU's own worker.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Protocol

from gpuagent.domain.devices import DriverState, Gpu, P2PLevel, Telemetry, Topology
from gpuagent.domain.health import HealthEvent
from gpuagent.domain.usage import ProcessReading
from gpuagent.gpu.calls import NvmlCalls
from gpuagent.gpu.topology import GpuLinks

Pair = tuple[int, int]


class DriverUnavailable(Exception):
    """NVML could not be initialised (no library, no driver, version mismatch, …)."""


class EventWaitError(Exception):
    """Waiting for driver events failed; ``lost`` when NVML reported a lost GPU."""

    def __init__(self, message: str, *, lost: bool) -> None:
        super().__init__(message)
        self.lost = lost


@dataclass(frozen=True, slots=True)
class Probe:
    """One liveness check and telemetry reading of a GPU.

    ``events`` is what the reading says about health: ``Responding`` or ``LivenessFailed`` from
    the liveness check, or ``GpuLost``. ``recovery_action`` is the driver's recovery-action field
    as read (``None``: the driver has none, or it could not be read).
    """

    events: tuple[HealthEvent, ...]
    telemetry: Telemetry
    recovery_action: int | None = None
    # Per-process readings (gpu/processes.py); None when the driver offers none or they failed.
    processes: ProcessReading | None = None
    # Each MIG device's own readings (framebuffer, its GPU instance's profiling ratios), by UUID.
    mig_telemetry: Mapping[str, Telemetry] = field(default_factory=lambda: MappingProxyType({}))
    # The NVLink data counter (KiB, TX + RX, all links) and when it was read: the poller's rate.
    nvlink_kib: float | None = None
    taken_at: float = 0.0


@dataclass(frozen=True, slots=True)
class DriverEvent:
    """A health event the driver delivered for GPU ``index``."""

    index: int
    event: HealthEvent


class Backend(Protocol):
    """Blocking access to the driver, GPU by GPU (see :class:`gpuagent.gpu.nvml.Nvml`)."""

    @property
    def calls(self) -> NvmlCalls:
        """The NVML call bookkeeping: timings, failures, calls in flight."""
        ...

    def init(self) -> DriverState:
        """Initialise NVML; raises :class:`DriverUnavailable`."""
        ...

    def shutdown(self) -> None:
        """Release everything and shut NVML down; never raises."""
        ...

    def count(self) -> int:
        """How many GPUs the driver lists; raises :class:`DriverUnavailable`."""
        ...

    def uuid_of(self, index: int) -> str | None:
        """GPU ``index``'s UUID once :meth:`describe` has read it (even if it then stalled)."""
        ...

    def describe(self, index: int) -> Gpu:
        """GPU ``index`` as discovered; a GPU that cannot be described carries a condition."""
        ...

    def walk_links(self, index: int) -> GpuLinks | None:
        """GPU ``index``'s NVLink peers for the topology being read (see :meth:`begin_topology`)."""
        ...

    def ancestors(self, index: int) -> list[tuple[Pair, P2PLevel | None]]:
        """P2P levels of the pairs ``(index, b > index)`` for the topology being read."""
        ...

    def begin_topology(self, gpus: tuple[Gpu, ...]) -> None:
        """Start reading the topology of ``gpus`` (their bus IDs are known)."""
        ...

    def end_topology(
        self,
        walks: dict[int, GpuLinks | None],
        levels: dict[Pair, P2PLevel | None],
    ) -> Topology:
        """The topology from the per-GPU parts read since :meth:`begin_topology`."""
        ...

    def refresh_topology(self) -> Topology:
        """Read the whole topology again, in turn; never raises."""
        ...

    def create_event_set(self) -> str | None:
        """Create the event set; the error when it cannot be (then probes carry health)."""
        ...

    def register_events(self, index: int) -> str | None:
        """Register GPU ``index`` for health events (again); the error when it cannot be."""
        ...

    def rebuild_events(self, indexes: tuple[int, ...]) -> dict[int, str]:
        """A new event set with just these GPUs registered (the old one freed); failures by GPU.

        Called only between waits, from the thread that waits.
        """
        ...

    def wait_event(self, timeout_ms: int) -> DriverEvent | None:
        """The next health event, or ``None``; raises :class:`EventWaitError`."""
        ...

    def probe(self, index: int) -> Probe:
        """One liveness check and telemetry reading of GPU ``index``."""
        ...
