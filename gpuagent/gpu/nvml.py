"""The NVML backend: every driver call the agent makes, through the real pynvml wrappers.

This module and the readers it drives (:mod:`~gpuagent.gpu.eventset`,
:mod:`~gpuagent.gpu.telemetry`, :mod:`~gpuagent.gpu.gpm`, :mod:`~gpuagent.gpu.processes`,
:mod:`~gpuagent.gpu.topology`, :mod:`~gpuagent.gpu.mig`, all through
:mod:`~gpuagent.gpu.calls`) are the only code that imports :mod:`pynvml`. All methods block;
the monitor runs each GPU's work on that GPU's worker thread. NVML exceptions never leave it:
callers see :class:`DriverUnavailable`, :class:`EventWaitError`, domain health events and
``None`` for values the GPU does not offer or failed to deliver.

Health from evidence (docs/health.md): a probe's liveness check is one designated call,
``nvmlDeviceGetPerformanceState`` — live GPU state that every data-centre GPU offers and that no
metric reads, so a failing metric never stands in for a failing GPU. ``GPU_IS_LOST`` from any
call is evidence too. Every other error only leaves a reading absent.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pynvml
import structlog

from gpuagent.domain.devices import (
    Condition,
    DriverState,
    Gpu,
    P2PLevel,
    Telemetry,
    Topology,
)
from gpuagent.domain.health import (
    DISCOVERY,
    LOST,
    GpuLost,
    HealthEvent,
    LivenessFailed,
    Responding,
)
from gpuagent.domain.migshapes import MigRefused
from gpuagent.gpu.backend import DriverEvent, DriverUnavailable, EventWaitError, Pair, Probe
from gpuagent.gpu.calls import ABSENT, NO_GPU, NvmlCalls, describe
from gpuagent.gpu.eventset import EventSet
from gpuagent.gpu.mig import DEFAULT_MIG_MINORS
from gpuagent.gpu.migside import MigSide
from gpuagent.gpu.processes import ProcessReader
from gpuagent.gpu.telemetry import TelemetryReader
from gpuagent.gpu.topology import GpuLinks, TopologyReader, read_topology

log = structlog.get_logger("gpuagent.nvml")

__all__ = ["DriverUnavailable", "EventWaitError", "Nvml", "Probe", "describe"]

MIB = 1024 * 1024


class Nvml:
    """Blocking access to the driver. Safe to call from several threads (NVML is thread-safe).

    ``clock`` (monotonic seconds) times NVML calls and spaces GPM samples. ``processes``: read
    each GPU's processes for per-container accounting (off: no such calls, no readings).
    ``mig_shapes``: read the MIG shapes each MIG-capable GPU offers (``--dra-mig dynamic``).
    """

    def __init__(
        self,
        sysfs_root: Path = Path("/sys"),
        mig_minors: Path = DEFAULT_MIG_MINORS,
        *,
        clock: Callable[[], float] = time.monotonic,
        processes: bool = True,
        mig_shapes: bool = False,
    ) -> None:
        self._sysfs_root = sysfs_root
        self._read_processes = processes
        self._calls = NvmlCalls()
        self._mig = MigSide(self._calls, mig_minors, shapes=mig_shapes)
        self.topology = Topology()
        self._lock = threading.Lock()
        self._handles: dict[int, Any] = {}
        self._uuids: dict[int, str] = {}
        self._gpus: dict[int, Gpu] = {}
        self._events = EventSet(self._calls, self._handle)
        self._topology: TopologyReader | None = None
        self._reader = TelemetryReader(self._calls, clock)
        self._processes = ProcessReader(self._calls)
        self._library: object = None  # the library nvmlInit initialised (pynvml's nvmlLib)

    @property
    def calls(self) -> NvmlCalls:
        return self._calls

    # ----- lifecycle ---------------------------------------------------------------------------
    def init(self) -> DriverState:
        """Initialise NVML; returns the driver as up, with its version and CUDA version."""
        try:
            self._calls.call(NO_GPU, pynvml.nvmlInit)
        except pynvml.NVMLError as exc:
            raise DriverUnavailable(describe(exc)) from exc
        self._library = pynvml.nvmlLib
        try:
            version = str(self._calls.call(NO_GPU, pynvml.nvmlSystemGetDriverVersion))
        except pynvml.NVMLError as exc:
            self.shutdown()
            raise DriverUnavailable(describe(exc)) from exc
        try:
            cuda = self._calls.optional(NO_GPU, pynvml.nvmlSystemGetCudaDriverVersion)
        except pynvml.NVMLError as exc:
            log.warning("cuda driver version unreadable", error=describe(exc))
            cuda = None
        return DriverState(up=True, version=version, cuda_version=cuda_version(cuda))

    def shutdown(self) -> None:
        """Free GPM samples and the event set, shut NVML down; errors are logged, never raised.

        Nothing is released into a library other than the one initialised (a simulated driver
        uninstalled meanwhile: what it held went with it).
        """
        if pynvml.nvmlLib is not self._library:
            log.debug("the nvml library initialised is gone; nothing to release")
            return
        self._reader.close()
        self._events.free()
        try:
            self._calls.call(NO_GPU, pynvml.nvmlShutdown)
        except pynvml.NVMLError as exc:
            log.warning("nvml shutdown failed", error=describe(exc))

    # ----- discovery ---------------------------------------------------------------------------
    def count(self) -> int:
        """How many GPUs the driver lists."""
        try:
            return int(self._calls.call(NO_GPU, pynvml.nvmlDeviceGetCount))
        except pynvml.NVMLError as exc:
            raise DriverUnavailable(describe(exc)) from exc

    def discover(self) -> list[Gpu]:
        """Every GPU the driver lists, and the topology, in turn (start-up runs it in parallel).

        A GPU that cannot even name itself is left out (logged).
        """
        gpus = []
        for index in range(self.count()):
            gpu = self.describe(index)
            if gpu.uuid:
                gpus.append(gpu)
        self.topology = read_topology(
            self._described_handles(), self._calls, {g.index: g.pci_bus_id for g in gpus}
        )
        return gpus

    def uuid_of(self, index: int) -> str | None:
        with self._lock:
            return self._uuids.get(index)

    def describe(self, index: int) -> Gpu:
        """GPU ``index`` as the driver describes it.

        A GPU that cannot even be named comes back with an empty UUID (logged: not advertised); one
        named but not describable carries a ``lost`` or ``discovery`` condition, so the kubelet
        sees it, unhealthy, and the monitor asks again.
        """
        try:
            handle = self._calls.call(index, pynvml.nvmlDeviceGetHandleByIndex, index)
            uuid = str(self._calls.call(index, pynvml.nvmlDeviceGetUUID, handle))
        except pynvml.NVMLError as exc:
            log.error("gpu cannot be identified; not advertised", gpu=index, error=describe(exc))
            return _unnamed(index)
        with self._lock:
            self._handles[index] = handle
            before, self._uuids[index] = self._uuids.get(index), uuid
        self._mig.named(index, uuid, before)
        self._events.name_gpu(index, handle, uuid)
        try:
            gpu = self._describe(index, handle, uuid)
        except pynvml.NVMLError as exc:
            # Named but not describable: advertise it so the kubelet sees it, as unhealthy.
            log.error("gpu discovery failed", gpu=index, uuid=uuid, error=describe(exc))
            kind = LOST if exc.value == pynvml.NVML_ERROR_GPU_IS_LOST else DISCOVERY
            detail = "" if kind == LOST else describe(exc)
            return Gpu.undescribed(index, uuid, Condition(kind, detail))
        with self._lock:
            self._gpus[index] = gpu
        self._events.name_migs(index, gpu.mig_devices)
        return gpu

    def _describe(self, index: int, handle: Any, uuid: str) -> Gpu:
        call, optional = self._calls.call, self._calls.optional
        bus_id = _text(call(index, pynvml.nvmlDeviceGetPciInfo, handle).busId)
        minor = int(call(index, pynvml.nvmlDeviceGetMinorNumber, handle))
        name = str(call(index, pynvml.nvmlDeviceGetName, handle))
        total, refused = self._memory_total(index, handle)
        mig = self._mig.read(index, handle, minor, total)
        if total is None:
            if mig.total_memory_bytes is None and refused is not None:
                raise refused
            total = mig.total_memory_bytes or 0
        architecture = optional(index, pynvml.nvmlDeviceGetArchitecture, handle)
        shapes = self._mig.shapes(index, handle, uuid, total, architecture) if mig.capable else None
        return Gpu(
            index=index,
            uuid=uuid,
            minor=minor,
            name=name,
            memory_mib=total // MIB,
            pci_bus_id=bus_id,
            numa_node=self._numa_node(index, handle, bus_id),
            architecture=architecture_name(architecture),
            compute_capability=compute_capability(
                optional(index, pynvml.nvmlDeviceGetCudaComputeCapability, handle)
            ),
            mig_capable=mig.capable,
            mig_enabled=mig.enabled,
            mig_devices=mig.devices,
            mig_partitions=shapes,
        )

    def describe_mig(self, index: int) -> Gpu:
        """GPU ``index`` as last described, its MIG mode and MIG devices read again (after one
        was made or destroyed); raises :class:`MigRefused` when they cannot be read."""
        handle = self.mig_handle(index)
        with self._lock:
            known = self._gpus[index]
        try:
            mig = self._mig.read(index, handle, known.minor, known.memory_mib * MIB or None)
        except pynvml.NVMLError as exc:
            raise MigRefused(f"reading gpu {index}'s mig devices: {describe(exc)}") from None
        gpu = replace(known, mig_enabled=mig.enabled, mig_devices=mig.devices)
        with self._lock:
            self._gpus[index] = gpu
        self._events.name_migs(index, gpu.mig_devices)
        return gpu

    def _memory_total(self, index: int, handle: Any) -> tuple[int | None, pynvml.NVMLError | None]:
        """The GPU's memory in bytes, or ``(None, error)`` when the read was refused (MIG)."""
        try:
            try:
                info = self._calls.call(
                    index,
                    pynvml.nvmlDeviceGetMemoryInfo,
                    handle,
                    pynvml.nvmlMemory_v2,
                    name="nvmlDeviceGetMemoryInfo_v2",
                )
            except pynvml.NVMLError as exc:
                if exc.value not in ABSENT:
                    raise
                info = self._calls.call(index, pynvml.nvmlDeviceGetMemoryInfo, handle)
        except pynvml.NVMLError as exc:
            if exc.value != pynvml.NVML_ERROR_NO_PERMISSION:
                raise
            return None, exc
        return int(info.total), None

    def _numa_node(self, index: int, handle: Any, bus_id: str) -> int | None:
        """NUMA node from NVML where the driver offers it, else from sysfs; ``None`` if unknown."""
        node = self._calls.optional(index, pynvml.nvmlDeviceGetNumaNodeId, handle)
        if node is None:
            node = self._sysfs_numa_node(bus_id)
        return None if node is None or node < 0 else int(node)

    def _sysfs_numa_node(self, bus_id: str) -> int | None:
        domain, _, rest = bus_id.partition(":")
        try:
            name = f"{int(domain, 16):04x}:{rest.lower()}"
            text = (self._sysfs_root / "bus/pci/devices" / name / "numa_node").read_text()
            return int(text.strip())
        except (OSError, ValueError):
            return None

    # ----- topology ----------------------------------------------------------------------------
    def begin_topology(self, gpus: tuple[Gpu, ...]) -> None:
        described = {g.index for g in gpus if g.pci_bus_id}
        handles = {i: h for i, h in self._described_handles().items() if i in described}
        buses = {g.index: g.pci_bus_id for g in gpus if g.index in described}
        self._topology = TopologyReader(handles, self._calls, buses)

    def walk_links(self, index: int) -> GpuLinks | None:
        reader = self._topology
        if reader is None or index not in reader.indexes:
            return None
        return reader.walk(index)

    def ancestors(self, index: int) -> list[tuple[Pair, P2PLevel | None]]:
        reader = self._topology
        if reader is None or index not in reader.indexes:
            return []
        return reader.ancestors(index)

    def end_topology(
        self, walks: dict[int, GpuLinks | None], levels: dict[Pair, P2PLevel | None]
    ) -> Topology:
        reader, self._topology = self._topology, None
        if reader is None:
            return self.topology
        self.topology = reader.assemble(walks, levels)
        return self.topology

    def refresh_topology(self) -> Topology:
        """Read the pairwise topology again (after a GPU came back); never raises."""
        with self._lock:
            buses = {i: g.pci_bus_id for i, g in self._gpus.items()}
        self.topology = read_topology(self._described_handles(), self._calls, buses)
        return self.topology

    def _described_handles(self) -> dict[int, Any]:
        with self._lock:
            return {i: h for i, h in self._handles.items() if i in self._gpus}

    # ----- events ------------------------------------------------------------------------------
    def create_event_set(self) -> str | None:
        """Create the event set; the error when it cannot be (GPUs then rely on probes)."""
        return self._events.create()

    def register_events(self, index: int) -> str | None:
        """Register GPU ``index`` for health events (again, after it was lost); the error if not."""
        return self._events.register(index)

    def rebuild_events(self, indexes: tuple[int, ...]) -> dict[int, str]:
        """A fresh event set holding only ``indexes``, the old one drained and freed."""
        return self._events.rebuild(indexes)

    def open_events(self) -> dict[int, str]:
        """:meth:`create_event_set` and :meth:`register_events` for every described GPU, in turn."""
        error = self._events.create()
        indexes = list(self._described_handles())
        if error is not None:
            return dict.fromkeys(indexes, error)
        failed = {}
        for index in indexes:
            problem = self._events.register(index)
            if problem is not None:
                failed[index] = problem
        return failed

    def wait_event(self, timeout_ms: int) -> DriverEvent | None:
        """The next health event, or ``None`` after ``timeout_ms`` or for an event to skip."""
        return self._events.wait(timeout_ms)

    def _handle(self, index: int) -> Any:
        with self._lock:
            return self._handles.get(index)

    def mig_handle(self, index: int) -> Any:
        """GPU ``index``'s handle for MIG management (:mod:`gpuagent.gpu.migmake`)."""
        with self._lock:
            if index not in self._gpus:
                raise MigRefused(f"gpu {index} has not been described")
            return self._handles[index]

    # ----- liveness and telemetry --------------------------------------------------------------
    def probe(self, index: int) -> Probe:
        """The liveness check and every reading of GPU ``index``.

        A lost GPU (``GPU_IS_LOST`` from any call) is ``GpuLost`` with no telemetry; otherwise the
        liveness check decides ``Responding`` or ``LivenessFailed``, and the readings that worked
        are kept either way.
        """
        with self._lock:
            handle = self._handles[index]
        migs = self._mig.handles(index)
        try:
            alive = self._liveness(index, handle)
            reading = self._reader.read(index, handle)
            instances = self._reader.read_instances(index, handle, migs) if migs else {}
            processes = self._processes.read(index, handle) if self._read_processes else None
        except pynvml.NVMLError_GpuIsLost:
            return Probe(events=(GpuLost(),), telemetry=Telemetry())
        return Probe(
            events=(alive,),
            telemetry=reading.telemetry,
            recovery_action=reading.recovery_action,
            processes=processes,
            mig_telemetry=MappingProxyType(instances),
            nvlink_kib=reading.nvlink_kib,
            taken_at=reading.taken_at,
        )

    def _liveness(self, index: int, handle: Any) -> HealthEvent:
        try:
            self._calls.call(index, pynvml.nvmlDeviceGetPerformanceState, handle)
        except pynvml.NVMLError as exc:
            if exc.value == pynvml.NVML_ERROR_GPU_IS_LOST:
                raise
            if exc.value in ABSENT:  # no liveness check on this GPU: hangs still count
                self._calls.absent(index, "nvmlDeviceGetPerformanceState", exc.value)
                return Responding()
            return LivenessFailed(describe(exc))
        return Responding()

    @property
    def indexes(self) -> Iterable[int]:
        with self._lock:
            return tuple(self._handles)


def _unnamed(index: int) -> Gpu:
    return Gpu.undescribed(index, "", Condition(DISCOVERY))


#: NVML_DEVICE_ARCH_* → the family name NVIDIA's GPU feature discovery uses (``gpu.family``).
ARCHITECTURES: dict[int, str] = {
    pynvml.NVML_DEVICE_ARCH_KEPLER: "kepler",
    pynvml.NVML_DEVICE_ARCH_MAXWELL: "maxwell",
    pynvml.NVML_DEVICE_ARCH_PASCAL: "pascal",
    pynvml.NVML_DEVICE_ARCH_VOLTA: "volta",
    pynvml.NVML_DEVICE_ARCH_TURING: "turing",
    pynvml.NVML_DEVICE_ARCH_AMPERE: "ampere",
    pynvml.NVML_DEVICE_ARCH_ADA: "ada-lovelace",
    pynvml.NVML_DEVICE_ARCH_HOPPER: "hopper",
    pynvml.NVML_DEVICE_ARCH_BLACKWELL: "blackwell",
    pynvml.NVML_DEVICE_ARCH_RUBIN: "rubin",
}


def architecture_name(value: int | None) -> str:
    """GFD's family name for an ``NVML_DEVICE_ARCH_*`` value; ``""`` when unknown or absent."""
    return "" if value is None else ARCHITECTURES.get(int(value), "")


def compute_capability(value: tuple[int, int] | None) -> str:
    """``"9.0"`` from NVML's ``(major, minor)``; ``""`` when absent."""
    return "" if value is None else f"{int(value[0])}.{int(value[1])}"


def cuda_version(value: int | None) -> tuple[int, int] | None:
    """NVML's CUDA driver version (``13000``: major * 1000 + minor * 10) as ``(13, 0)``."""
    if value is None or value <= 0:
        return None
    return value // 1000, (value % 1000) // 10


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
