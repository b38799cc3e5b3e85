"""The simulated driver's mutable state: per-GPU health, MIG devices, event sets and faults.

Everything here is guarded by ``DriverState.cond`` (one lock); event-set waits release it while
they block.

A MIG device has its own ``nvmlDevice_t`` and its own :class:`GpuState` (``mig`` set), so the
per-device entry points (UUID, name, memory, …) answer for it as NVML does, with the MIG device's
UUID and memory. Its index is its parent's: a fault injected on a GPU (lost, a hang, a failing
call) reaches its MIG devices too.

MIG mode is a state of its own (current and pending, as ``nvmlDeviceGetMigMode`` reports them):
on at start exactly for a GPU configured with MIG devices, switched by ``nvmlDeviceSetMigMode``
(``_api_migmake``). GPU instances made by the driver's callers start without a compute instance
(``GpuState.bare``) and become MIG devices (``GpuState.migs``) once one is made in them.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TypeVar

import pynvml

from gpuagent.gpu.sim import telemetry
from gpuagent.gpu.sim.processes import ProcessTable
from gpuagent.gpu.sim.spec import SimGpuSpec, SimMigSpec, SimNode
from gpuagent.gpu.topology import bus_key

T = TypeVar("T")

#: XIDs after which NVIDIA's XID catalog asks for a GPU reset.
RESET_XIDS = frozenset({48, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120})
LOST_XID = 79
FAULTS = ("xid", "lost", "ecc_dbe", "recover", "recovery_action")
MAX_QUEUED_EVENTS = 4096
#: ``eventData`` is 64 bits wide: the simulator delivers any such value, to test what a driver
#: might send (real XIDs are small positive numbers).
MAX_XID = 2**64 - 1
NO_INSTANCE = 0xFFFF_FFFF

#: The event types the GPUs report as supported: every type, as the real H200 on R580 did (the
#: simulator delivers XID, ECC and recovery-action events; it never raises the others).
SUPPORTED_EVENTS = int(pynvml.nvmlEventTypeAll)
#: What a driver before R565 offers: no recovery-action event.
SUPPORTED_EVENTS_BEFORE_R565 = SUPPORTED_EVENTS & ~pynvml.nvmlEventTypeGpuRecoveryAction

RECOVERY_ACTION_NAMES = {
    pynvml.NVML_GPU_RECOVERY_ACTION_NONE: "none",
    pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET: "gpu_reset",
    pynvml.NVML_GPU_RECOVERY_ACTION_NODE_REBOOT: "node_reboot",
    pynvml.NVML_GPU_RECOVERY_ACTION_DRAIN_P2P: "drain_p2p",
    pynvml.NVML_GPU_RECOVERY_ACTION_DRAIN_AND_RESET: "drain_and_reset",
}
RECOVERY_ACTIONS_BY_NAME = {name: code for code, name in RECOVERY_ACTION_NAMES.items()}


@dataclass(frozen=True)
class LinkEnd:
    """The far end of one active NVLink: a GPU (by index) or an NVSwitch (by number)."""

    kind: int  # NVML_NVLINK_DEVICE_TYPE_GPU or NVML_NVLINK_DEVICE_TYPE_SWITCH
    index: int

    @property
    def is_gpu(self) -> bool:
        return self.kind == int(pynvml.NVML_NVLINK_DEVICE_TYPE_GPU)


@dataclass
class GpuState:
    """One GPU or MIG device: its spec, opaque NVML handle, NVLink table and fault state.

    ``links`` has one slot per NVLink of the GPU (``None``: inactive). A full GPU lists its MIG
    devices in ``migs`` (GPU-instance ID order) and its GPU instances that hold no compute
    instance yet in ``bare``; a MIG device's own state has ``mig`` set and no links.
    ``mig_mode``/``mig_pending``: the current and pending MIG mode (1 enabled, 0 disabled);
    ``compute_mode``: NVML's compute mode (``nvmlDeviceSetComputeMode``).
    """

    spec: SimGpuSpec
    handle: pynvml.struct_c_nvmlDevice_t
    links: tuple[LinkEnd | None, ...]
    lost: bool = False
    recovery_action: int = pynvml.NVML_GPU_RECOVERY_ACTION_NONE
    last_xid: int | None = None
    xid_count: int = 0
    ecc_dbe_count: int = 0
    migs: tuple[MigState, ...] = ()
    mig: MigState | None = field(default=None, repr=False)
    bare: tuple[MigState, ...] = ()
    mig_mode: int = 0
    mig_pending: int = 0
    compute_mode: int = pynvml.NVML_COMPUTEMODE_DEFAULT

    @property
    def index(self) -> int:
        """The GPU's NVML index (a MIG device's is its parent's)."""
        return self.spec.index

    @property
    def mig_enabled(self) -> bool:
        """MIG mode is on (a full GPU's; a MIG device's own state is never "in MIG mode")."""
        return self.mig is None and self.mig_mode == 1

    @property
    def in_mig(self) -> bool:
        """A MIG device, or a GPU in MIG mode: what the aggregate-only calls refuse."""
        return self.mig is not None or self.mig_mode == 1

    @property
    def gpu_instances(self) -> tuple[MigState, ...]:
        """Every GPU instance of a full GPU, with a compute instance or not."""
        return self.migs + self.bare


@dataclass(eq=False)
class MigState:
    """One MIG device: its GPU instance and compute instance handles and its device state."""

    spec: SimMigSpec
    parent: GpuState = field(repr=False)
    device: GpuState = field(repr=False)
    gpu_instance: pynvml.struct_c_nvmlGpuInstance_t = field(repr=False)
    compute_instance: pynvml.struct_c_nvmlComputeInstance_t = field(repr=False)


@dataclass(frozen=True)
class Event:
    """One queued NVML event: ``data`` is the XID for XID events and 0 for every other type."""

    gpu: int
    event_type: int
    data: int
    gpu_instance: int = NO_INSTANCE
    compute_instance: int = NO_INSTANCE


@dataclass
class EventSet:
    """An ``nvmlEventSet_t``: which GPUs are registered for which bits, and its queue."""

    handle: pynvml.struct_c_nvmlEventSet_t
    masks: dict[int, int] = field(default_factory=dict)
    queue: deque[Event] = field(default_factory=lambda: deque(maxlen=MAX_QUEUED_EVENTS))
    freed: bool = False
    # Threads blocked in nvmlEventSetWait_v2 on this set right now.
    waiters: int = 0


def _link_table(node: SimNode, gpu: SimGpuSpec) -> tuple[LinkEnd | None, ...]:
    """Direct GPU links first (in configuration order), then NVSwitch links, then inactive slots."""
    ends: list[LinkEnd | None] = []
    for peer, count in node.links_of(gpu.index):
        ends.extend([LinkEnd(pynvml.NVML_NVLINK_DEVICE_TYPE_GPU, peer)] * count)
    for switch, count in node.switch_links_of(gpu.index):
        ends.extend([LinkEnd(pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH, switch)] * count)
    slots = max(gpu.nvlink_slots, len(ends))
    return tuple(ends) + (None,) * (slots - len(ends))


def _lookup(table: Mapping[int, T], handle: object) -> T | None:
    """The object behind an opaque NVML handle (a pointer to one of ours), else None."""
    try:
        if not handle:
            return None
        contents = handle.contents  # type: ignore[attr-defined]
        return table.get(ctypes.addressof(contents))
    except (AttributeError, TypeError, ValueError):
        return None


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
        self.gpu_instances: dict[int, MigState] = {}
        self.compute_instances: dict[int, MigState] = {}
        for gpu in self.gpus:
            gpu.migs = tuple(self._new_mig(gpu, m) for m in gpu.spec.mig_devices)
            gpu.mig_mode = gpu.mig_pending = 1 if gpu.migs else 0
        # GPU instances made by callers so far (each made MIG device's UUID is new).
        self.made = 0
        self.event_sets: dict[int, EventSet] = {}
        self.processes = ProcessTable()
        # GPUs brought up since the driver was initialised (see SimLatency.cold_start_s).
        self.warm: set[int] = set()
        # Uses that nvml.h does not allow and a real driver would answer with undefined
        # behaviour (a set freed, or NVML shut down, under a thread blocked in a wait on it).
        self.misuse: list[str] = []
        # Bumped to end every blocked event wait with TIMEOUT, as an interrupt does (nvml.h).
        self.interrupts = 0

    def _new_mig(self, parent: GpuState, spec: SimMigSpec) -> MigState:
        mig = self.new_gpu_instance(parent, spec)
        self.add_compute_instance(mig, spec)
        return mig

    def new_gpu_instance(self, parent: GpuState, spec: SimMigSpec) -> MigState:
        """A GPU instance of ``parent`` as ``spec`` places it, its handle known, its MIG device
        not yet (see :meth:`add_compute_instance`); the caller files it in ``parent``."""
        device = GpuState(
            spec=replace(
                parent.spec,
                name=f"{parent.spec.name} MIG {spec.name}",
                uuid=spec.uuid,
                memory_mib=spec.memory_mib,
                mig_devices=(),
            ),
            handle=pynvml.struct_c_nvmlDevice_t(),
            links=(),
        )
        mig = MigState(
            spec=spec,
            parent=parent,
            device=device,
            gpu_instance=pynvml.struct_c_nvmlGpuInstance_t(),
            compute_instance=pynvml.struct_c_nvmlComputeInstance_t(),
        )
        device.mig = mig
        self.gpu_instances[ctypes.addressof(mig.gpu_instance)] = mig
        return mig

    def add_compute_instance(self, mig: MigState, spec: SimMigSpec) -> None:
        """The compute instance of ``mig`` exists (``spec`` names it): its MIG device answers."""
        mig.spec = spec
        mig.device.spec = replace(mig.device.spec, uuid=spec.uuid)
        mig.device.lost = mig.parent.lost
        mig.compute_instance = pynvml.struct_c_nvmlComputeInstance_t()
        self.by_address[ctypes.addressof(mig.device.handle)] = mig.device
        self.compute_instances[ctypes.addressof(mig.compute_instance)] = mig

    def drop_compute_instance(self, mig: MigState) -> None:
        """The compute instance of ``mig`` is gone: its handles and MIG device answer no more."""
        self.by_address.pop(ctypes.addressof(mig.device.handle), None)
        self.compute_instances.pop(ctypes.addressof(mig.compute_instance), None)
        mig.device.handle = pynvml.struct_c_nvmlDevice_t()

    def drop_gpu_instance(self, mig: MigState) -> None:
        """The GPU instance of ``mig`` (holding no compute instance) is gone."""
        self.gpu_instances.pop(ctypes.addressof(mig.gpu_instance), None)

    # ----- lookups (caller holds the lock) -----------------------------------------------------
    def gpu_of(self, handle: object) -> GpuState | None:
        """The GPU or MIG device behind an ``nvmlDevice_t`` (one of our handles), else None."""
        return _lookup(self.by_address, handle)

    def gpu_instance_of(self, handle: object) -> MigState | None:
        """The MIG device whose GPU instance is behind an ``nvmlGpuInstance_t``, else None."""
        return _lookup(self.gpu_instances, handle)

    def compute_instance_of(self, handle: object) -> MigState | None:
        """The MIG device whose compute instance is behind an ``nvmlComputeInstance_t``."""
        return _lookup(self.compute_instances, handle)

    def event_set_of(self, handle: object) -> EventSet | None:
        """The event set behind an ``nvmlEventSet_t``, else None (freed sets included)."""
        return _lookup(self.event_sets, handle)

    def find_uuid(self, uuid: bytes) -> GpuState | None:
        """The GPU or MIG device with this UUID (exact, as NVML compares), else None."""
        text = uuid.decode(errors="replace")
        for gpu in self.gpus:
            if gpu.spec.uuid == text:
                return gpu
            for mig in gpu.migs:
                if mig.device.spec.uuid == text:
                    return mig.device
        return None

    def find_bus_id(self, bus_id: bytes) -> GpuState | None:
        """The GPU at this PCI address (``[domain:]bus:device.function``, any case), else None."""
        wanted = bus_key(bus_id.decode(errors="replace"))
        if wanted is None:
            return None
        return next((g for g in self.gpus if bus_key(g.spec.pci_bus_id) == wanted), None)

    def sample(self, gpu: GpuState) -> telemetry.Sample:
        """The GPU's telemetry now (per the injected clock)."""
        t = self.clock() - self.started
        spec = gpu.spec
        if spec.at_rest is not None:
            sample = telemetry.resting(spec.at_rest, spec.profile, spec.memory_mib, t)
        else:
            sample = telemetry.sample(spec.profile, gpu.index, spec.memory_mib, t)
        return self.processes.apply(gpu, sample)

    def sample_instance(self, device: GpuState, gpu_instance: int) -> telemetry.Sample:
        """A MIG device's telemetry now: its own memory, a wave of its own (phase by instance)."""
        t = self.clock() - self.started
        spec = device.spec
        if spec.at_rest is not None:
            rest = replace(spec.at_rest, fb_reserved_bytes=None, fb_used_bytes=None)
            sample = telemetry.resting(rest, spec.profile, spec.memory_mib, t)
        else:
            phase_index = device.index * 31 + gpu_instance
            sample = telemetry.sample(spec.profile, phase_index, spec.memory_mib, t)
        return self.processes.apply(device, sample)

    def new_event_set(self) -> EventSet:
        """Create and remember an event set."""
        event_set = EventSet(handle=pynvml.struct_c_nvmlEventSet_t())
        self.event_sets[ctypes.addressof(event_set.handle)] = event_set
        return event_set

    @property
    def supported_events(self) -> int:
        """The event types every GPU of this driver reports as supported."""
        if self.node.supported_events is not None:
            return self.node.supported_events
        return int(
            SUPPORTED_EVENTS if self.node.has_recovery_action else SUPPORTED_EVENTS_BEFORE_R565
        )

    # ----- faults ------------------------------------------------------------------------------
    def _emit(self, gpu: GpuState, event: Event) -> None:
        for event_set in self.event_sets.values():
            if not event_set.freed and event_set.masks.get(gpu.index, 0) & event.event_type:
                event_set.queue.append(event)
        self.cond.notify_all()

    def _set_recovery(self, gpu: GpuState, action: int) -> None:
        """Set the recovery action and deliver its event (``eventData`` 0, as nvml.h says)."""
        gpu.recovery_action = action
        if self.node.has_recovery_action:
            self._emit(gpu, Event(gpu.index, pynvml.nvmlEventTypeGpuRecoveryAction, 0))

    def _xid(
        self, gpu: GpuState, xid: int, instance: tuple[int, int] = (NO_INSTANCE, NO_INSTANCE)
    ) -> None:
        gpu.last_xid = xid
        gpu.xid_count += 1
        event = Event(gpu.index, pynvml.nvmlEventTypeXidCriticalError, xid, *instance)
        self._emit(gpu, event)
        if xid in RESET_XIDS:
            self._set_recovery(gpu, pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET)

    @staticmethod
    def _instance(gpu: GpuState, gi: object, ci: object) -> tuple[int, int]:
        """The (GPU instance, compute instance) IDs an XID names, checked against ``gpu``."""
        ids: list[int] = []
        for name, value in (("gpu_instance", gi), ("compute_instance", ci)):
            if value is None:
                ids.append(NO_INSTANCE)
            elif isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an instance ID, got {value!r}")
            elif not 0 <= value <= NO_INSTANCE:
                raise ValueError(f"{name} must be from 0 to {NO_INSTANCE}, got {value}")
            else:
                ids.append(value)
        gi_id, ci_id = ids
        if gi_id == NO_INSTANCE:
            if ci_id != NO_INSTANCE:
                raise ValueError("compute_instance needs a gpu_instance")
            return gi_id, ci_id
        found = [m for m in gpu.migs if m.spec.gpu_instance_id == gi_id]
        if not found:
            known = sorted(m.spec.gpu_instance_id for m in gpu.migs)
            raise ValueError(f"GPU {gpu.index} has no GPU instance {gi_id} (it has {known})")
        if ci_id != NO_INSTANCE and not any(m.spec.compute_instance_id == ci_id for m in found):
            raise ValueError(f"GPU instance {gi_id} has no compute instance {ci_id}")
        return gi_id, ci_id

    def _activate_mig_mode(self, gpu: GpuState) -> None:
        """A reset makes a pending MIG mode current (Ampere); MIG mode off leaves no instance."""
        gpu.mig_mode = gpu.mig_pending
        if gpu.mig_mode:
            return
        for mig in gpu.migs:
            self.drop_compute_instance(mig)
        for mig in gpu.gpu_instances:
            self.drop_gpu_instance(mig)
        gpu.migs = gpu.bare = ()

    @staticmethod
    def _set_lost(gpu: GpuState, *, lost: bool) -> None:
        """A GPU and its MIG devices fall off the bus (or come back) together."""
        gpu.lost = lost
        for mig in gpu.gpu_instances:
            mig.device.lost = lost

    def inject(
        self,
        gpu: int,
        fault: str,
        xid: int | None = None,
        *,
        gpu_instance: object = None,
        compute_instance: object = None,
        action: object = None,
    ) -> None:
        """Apply a fault (see ``SimDriver.inject``)."""
        if fault not in FAULTS:
            raise ValueError(f"unknown fault {fault!r} (known: {', '.join(FAULTS)})")
        code = 0
        if fault == "xid":
            if isinstance(xid, bool) or not isinstance(xid, int) or not 0 <= xid <= MAX_XID:
                raise ValueError(f"fault 'xid' needs an xid from 0 to {MAX_XID}, got {xid!r}")
            code = xid
        elif xid is not None:
            raise ValueError(f"fault {fault!r} takes no xid")
        if fault != "xid" and (gpu_instance is not None or compute_instance is not None):
            raise ValueError(f"fault {fault!r} takes no gpu_instance or compute_instance")
        if fault == "recovery_action":
            if action not in RECOVERY_ACTIONS_BY_NAME:
                known = ", ".join(RECOVERY_ACTIONS_BY_NAME)
                raise ValueError(f"fault 'recovery_action' needs an action ({known}): {action!r}")
        elif action is not None:
            raise ValueError(f"fault {fault!r} takes no action")
        if isinstance(gpu, bool) or not isinstance(gpu, int):
            raise ValueError(f"gpu must be an integer index, got {gpu!r}")  # noqa: TRY004
        with self.cond:
            if not 0 <= gpu < len(self.gpus):
                raise LookupError(f"no simulated GPU {gpu} (there are {len(self.gpus)})")
            state = self.gpus[gpu]
            if fault == "xid":
                self._xid(state, code, self._instance(state, gpu_instance, compute_instance))
            elif fault == "lost":
                self._set_lost(state, lost=True)
                self._xid(state, LOST_XID)
            elif fault == "ecc_dbe":
                state.ecc_dbe_count += 1
                self._emit(state, Event(state.index, pynvml.nvmlEventTypeDoubleBitEccError, 0))
                self._set_recovery(state, pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET)
            elif fault == "recovery_action":
                self._set_recovery(state, RECOVERY_ACTIONS_BY_NAME[str(action)])
            else:
                # A GPU reset: the GPU answers again, nothing is asked of anyone, and the volatile
                # ECC counters start again from zero.
                self._set_lost(state, lost=False)
                self._activate_mig_mode(state)
                state.ecc_dbe_count = 0
                self._set_recovery(state, pynvml.NVML_GPU_RECOVERY_ACTION_NONE)
