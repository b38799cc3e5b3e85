"""The simulated driver's mutable state: per-GPU health, event sets and fault injection.

Everything here is guarded by ``DriverState.cond`` (one lock); event-set waits release it while
they block.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import pynvml

from gpuagent.gpu.sim import telemetry
from gpuagent.gpu.sim._abi import parse_bus_id
from gpuagent.gpu.sim.spec import SimGpuSpec, SimNode

#: XIDs after which NVIDIA's XID catalog asks for a GPU reset.
RESET_XIDS = frozenset({48, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120})
LOST_XID = 79
FAULTS = ("xid", "lost", "ecc_dbe", "recover")
MAX_QUEUED_EVENTS = 4096
MAX_XID = 0xFFFF_FFFF
NO_INSTANCE = 0xFFFF_FFFF

SUPPORTED_EVENTS = (
    pynvml.nvmlEventTypeSingleBitEccError
    | pynvml.nvmlEventTypeDoubleBitEccError
    | pynvml.nvmlEventTypePState
    | pynvml.nvmlEventTypeXidCriticalError
    | pynvml.nvmlEventTypeClock
    | pynvml.nvmlEventMigConfigChange
    | pynvml.nvmlEventTypeGpuRecoveryAction
)

RECOVERY_ACTION_NAMES = {
    pynvml.NVML_GPU_RECOVERY_ACTION_NONE: "none",
    pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET: "gpu_reset",
    pynvml.NVML_GPU_RECOVERY_ACTION_NODE_REBOOT: "node_reboot",
    pynvml.NVML_GPU_RECOVERY_ACTION_DRAIN_P2P: "drain_p2p",
    pynvml.NVML_GPU_RECOVERY_ACTION_DRAIN_AND_RESET: "drain_and_reset",
}


@dataclass
class GpuState:
    """One GPU: its spec, its opaque NVML handle, its NVLink table and its fault state."""

    spec: SimGpuSpec
    handle: pynvml.struct_c_nvmlDevice_t
    links: tuple[int | None, ...]
    lost: bool = False
    recovery_action: int = pynvml.NVML_GPU_RECOVERY_ACTION_NONE
    last_xid: int | None = None
    xid_count: int = 0
    ecc_dbe_count: int = 0

    @property
    def index(self) -> int:
        """The GPU's NVML index."""
        return self.spec.index


@dataclass(frozen=True)
class Event:
    """One queued NVML event."""

    gpu: int
    event_type: int
    data: int


@dataclass
class EventSet:
    """An ``nvmlEventSet_t``: which GPUs are registered for which bits, and its queue."""

    handle: pynvml.struct_c_nvmlEventSet_t
    masks: dict[int, int] = field(default_factory=dict)
    queue: deque[Event] = field(default_factory=lambda: deque(maxlen=MAX_QUEUED_EVENTS))
    freed: bool = False


def _link_table(node: SimNode, gpu: SimGpuSpec) -> tuple[int | None, ...]:
    peers: list[int | None] = []
    for peer, count in node.links_of(gpu.index):
        peers.extend([peer] * count)
    slots = max(gpu.profile.nvlink_count, len(peers))
    return tuple(peers) + (None,) * (slots - len(peers))


class DriverState:
    """All state of one simulated driver, behind one lock (``cond``)."""

    def __init__(self, node: SimNode, clock: Callable[[], float] = time.monotonic) -> None:
        self.node = node
        self.clock = clock
        self.started = clock()
        self.cond = threading.Condition(threading.Lock())
        self.init_count = 0
        self.gpus = tuple(
            GpuState(spec=g, handle=pynvml.struct_c_nvmlDevice_t(), links=_link_table(node, g))
            for g in node.gpus
        )
        self.by_address = {ctypes.addressof(g.handle): g for g in self.gpus}
        self.event_sets: dict[int, EventSet] = {}

    # ----- lookups (caller holds the lock) -----------------------------------------------------
    def gpu_of(self, handle: object) -> GpuState | None:
        """The GPU behind an ``nvmlDevice_t`` (a pointer to one of our handles), else None."""
        try:
            if not handle:
                return None
            contents = handle.contents  # type: ignore[attr-defined]
            return self.by_address.get(ctypes.addressof(contents))
        except (AttributeError, TypeError, ValueError):
            return None

    def event_set_of(self, handle: object) -> EventSet | None:
        """The event set behind an ``nvmlEventSet_t``, else None (freed sets included)."""
        try:
            if not handle:
                return None
            contents = handle.contents  # type: ignore[attr-defined]
            return self.event_sets.get(ctypes.addressof(contents))
        except (AttributeError, TypeError, ValueError):
            return None

    def find_uuid(self, uuid: bytes) -> GpuState | None:
        """The GPU with this UUID (exact, as NVML compares), else None."""
        text = uuid.decode(errors="replace")
        return next((g for g in self.gpus if g.spec.uuid == text), None)

    def find_bus_id(self, bus_id: bytes) -> GpuState | None:
        """The GPU at this PCI address (``[domain:]bus:device.function``, any case), else None."""
        wanted = parse_bus_id(bus_id.decode(errors="replace"))
        if wanted is None:
            return None
        return next((g for g in self.gpus if parse_bus_id(g.spec.pci_bus_id) == wanted), None)

    def sample(self, gpu: GpuState) -> telemetry.Sample:
        """The GPU's telemetry now (per the injected clock)."""
        t = self.clock() - self.started
        return telemetry.sample(gpu.spec.profile, gpu.index, gpu.spec.memory_mib, t)

    def new_event_set(self) -> EventSet:
        """Create and remember an event set."""
        event_set = EventSet(handle=pynvml.struct_c_nvmlEventSet_t())
        self.event_sets[ctypes.addressof(event_set.handle)] = event_set
        return event_set

    # ----- faults ------------------------------------------------------------------------------
    def _emit(self, gpu: GpuState, event_type: int, data: int) -> None:
        for event_set in self.event_sets.values():
            if not event_set.freed and event_set.masks.get(gpu.index, 0) & event_type:
                event_set.queue.append(Event(gpu.index, event_type, data))
        self.cond.notify_all()

    def _set_recovery(self, gpu: GpuState, action: int) -> None:
        gpu.recovery_action = action
        self._emit(gpu, pynvml.nvmlEventTypeGpuRecoveryAction, action)

    def _xid(self, gpu: GpuState, xid: int) -> None:
        gpu.last_xid = xid
        gpu.xid_count += 1
        self._emit(gpu, pynvml.nvmlEventTypeXidCriticalError, xid)
        if xid in RESET_XIDS:
            self._set_recovery(gpu, pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET)

    def inject(self, gpu: int, fault: str, xid: int | None = None) -> dict[str, object]:
        """Apply a fault (see ``SimDriver.inject``) and return the GPU's new description."""
        if fault not in FAULTS:
            raise ValueError(f"unknown fault {fault!r} (known: {', '.join(FAULTS)})")
        code = 0
        if fault == "xid":
            if isinstance(xid, bool) or not isinstance(xid, int) or not 0 < xid <= MAX_XID:
                raise ValueError(f"fault 'xid' needs a positive integer xid, got {xid!r}")
            code = xid
        elif xid is not None:
            raise ValueError(f"fault {fault!r} takes no xid")
        if isinstance(gpu, bool) or not isinstance(gpu, int):
            raise ValueError(f"gpu must be an integer index, got {gpu!r}")  # noqa: TRY004
        with self.cond:
            if not 0 <= gpu < len(self.gpus):
                raise LookupError(f"no simulated GPU {gpu} (there are {len(self.gpus)})")
            state = self.gpus[gpu]
            if fault == "xid":
                self._xid(state, code)
            elif fault == "lost":
                state.lost = True
                self._xid(state, LOST_XID)
            elif fault == "ecc_dbe":
                state.ecc_dbe_count += 1
                self._emit(state, pynvml.nvmlEventTypeDoubleBitEccError, 0)
                self._set_recovery(state, pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET)
            else:
                state.lost = False
                self._set_recovery(state, pynvml.NVML_GPU_RECOVERY_ACTION_NONE)
            return self._describe(state)

    # ----- control plane -----------------------------------------------------------------------
    @staticmethod
    def _describe(gpu: GpuState) -> dict[str, object]:
        spec = gpu.spec
        return {
            "index": spec.index,
            "uuid": spec.uuid,
            "name": spec.name,
            "memory_mib": spec.memory_mib,
            "pci_bus_id": spec.pci_bus_id,
            "numa_node": spec.numa_node,
            "mig": list(spec.mig),
            "state": "lost" if gpu.lost else "ok",
            "recovery_action": RECOVERY_ACTION_NAMES.get(
                gpu.recovery_action, str(gpu.recovery_action)
            ),
            "last_xid": gpu.last_xid,
            "xid_count": gpu.xid_count,
            "ecc_dbe_count": gpu.ecc_dbe_count,
        }

    def describe(self) -> list[dict[str, object]]:
        """One JSON-ready dict per GPU, in index order."""
        with self.cond:
            return [self._describe(gpu) for gpu in self.gpus]
