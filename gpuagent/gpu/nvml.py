"""The NVML backend: every driver call the agent makes, through the real pynvml wrappers.

This is the only module that imports :mod:`pynvml`. All methods block; the monitor runs them on
worker threads. NVML exceptions never leave this module: callers see :class:`DriverUnavailable`,
domain health events and ``None`` for values the GPU does not offer.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import pynvml
import structlog

from gpuagent.domain.devices import Condition, DriverState, Gpu, GpuHealth, Telemetry, Topology
from gpuagent.domain.health import (
    LOST,
    DoubleBitEccError,
    GpuLost,
    HealthEvent,
    ProbeFailed,
    RecoveryActionChanged,
    Responding,
    XidError,
)
from gpuagent.domain.usage import ProcessReading
from gpuagent.gpu.mig import DEFAULT_MIG_MINORS, read_mig
from gpuagent.gpu.processes import ProcessReader
from gpuagent.gpu.telemetry import TelemetryReader
from gpuagent.gpu.topology import read_topology

log = structlog.get_logger("gpuagent.nvml")
T = TypeVar("T")

# Values a GPU or driver may simply not offer: absent, logged once, never an error.
_ABSENT = (pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
HEALTH_EVENTS = (
    pynvml.nvmlEventTypeXidCriticalError
    | pynvml.nvmlEventTypeDoubleBitEccError
    | pynvml.nvmlEventTypeGpuRecoveryAction
)


class DriverUnavailable(Exception):
    """NVML could not be initialised (no library, no driver, version mismatch, …)."""


class EventWaitError(Exception):
    """Waiting for driver events failed; ``lost`` when NVML reported a lost GPU."""

    def __init__(self, message: str, *, lost: bool) -> None:
        super().__init__(message)
        self.lost = lost


@dataclass(frozen=True, slots=True)
class Probe:
    """One liveness-and-telemetry reading of a GPU."""

    events: tuple[HealthEvent, ...]
    telemetry: Telemetry
    recovery_action: int | None = None
    # Per-process readings (gpu/processes.py); None when the driver offers none or they failed.
    processes: ProcessReading | None = None


def describe(error: pynvml.NVMLError) -> str:
    """``"GPU is lost (NVML 15)"``: the driver's text and code, for logs and health reasons."""
    return f"{error} (NVML {error.value})"


class Nvml:
    """Blocking access to the driver. Safe to call from several threads (NVML is thread-safe)."""

    def __init__(
        self, sysfs_root: Path = Path("/sys"), mig_minors: Path = DEFAULT_MIG_MINORS
    ) -> None:
        self._sysfs_root = sysfs_root
        self._mig_minors = mig_minors
        self.topology = Topology()
        self._handles: dict[int, Any] = {}
        self._by_address: dict[int, int] = {}
        self._event_set: Any = None
        self._absent_logged: set[tuple[int, str]] = set()
        self._absent_lock = threading.Lock()
        self._reader = TelemetryReader(self._optional)
        self._processes = ProcessReader(self._optional)

    # ----- lifecycle ---------------------------------------------------------------------------
    def init(self) -> DriverState:
        """Initialise NVML; returns the driver as up, with its version and CUDA version."""
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise DriverUnavailable(describe(exc)) from exc
        try:
            version = str(pynvml.nvmlSystemGetDriverVersion())
        except pynvml.NVMLError as exc:
            self.shutdown()
            raise DriverUnavailable(describe(exc)) from exc
        cuda = self._optional(-1, "cuda_version", pynvml.nvmlSystemGetCudaDriverVersion)
        return DriverState(up=True, version=version, cuda_version=cuda_version(cuda))

    def shutdown(self) -> None:
        """Free GPM samples and the event set, shut NVML down; errors are logged, never raised."""
        self._reader.close()
        event_set, self._event_set = self._event_set, None
        if event_set is not None:
            try:
                pynvml.nvmlEventSetFree(event_set)
            except pynvml.NVMLError as exc:
                log.warning("freeing the nvml event set failed", error=describe(exc))
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError as exc:
            log.warning("nvml shutdown failed", error=describe(exc))

    # ----- discovery ---------------------------------------------------------------------------
    def discover(self) -> list[Gpu]:
        """Every GPU the driver lists. A GPU that cannot even name itself is left out (logged)."""
        try:
            count = int(pynvml.nvmlDeviceGetCount())
        except pynvml.NVMLError as exc:
            raise DriverUnavailable(describe(exc)) from exc
        gpus = []
        for index in range(count):
            gpu = self._discover_one(index)
            if gpu is not None:
                gpus.append(gpu)
        # Read once here, never per RPC; a lost GPU leaves its pairs unknown instead of failing.
        self.topology = read_topology(self._handles)
        return gpus

    def refresh_topology(self) -> Topology:
        """Read the pairwise topology again (after a GPU came back); never raises."""
        self.topology = read_topology(self._handles)
        return self.topology

    def _discover_one(self, index: int) -> Gpu | None:
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            uuid = str(pynvml.nvmlDeviceGetUUID(handle))
        except pynvml.NVMLError as exc:
            log.error("gpu cannot be identified; not advertised", gpu=index, error=describe(exc))
            return None
        self._handles[index] = handle
        self._by_address[ctypes.addressof(handle.contents)] = index
        try:
            pci = pynvml.nvmlDeviceGetPciInfo(handle)
            bus_id = _text(pci.busId)
            memory = self._memory_total_mib(handle)
            gpu = Gpu(
                index=index,
                uuid=uuid,
                minor=int(pynvml.nvmlDeviceGetMinorNumber(handle)),
                name=str(pynvml.nvmlDeviceGetName(handle)),
                memory_mib=memory,
                pci_bus_id=bus_id,
                numa_node=self._numa_node(index, handle, bus_id),
                architecture=architecture_name(
                    self._optional(index, "architecture", pynvml.nvmlDeviceGetArchitecture, handle)
                ),
                compute_capability=compute_capability(
                    self._optional(
                        index,
                        "compute_capability",
                        pynvml.nvmlDeviceGetCudaComputeCapability,
                        handle,
                    )
                ),
            )
            enabled, migs = read_mig(index, handle, gpu.minor, mig_minors=self._mig_minors)
            gpu = replace(gpu, mig_enabled=enabled, mig_devices=migs)
        except pynvml.NVMLError as exc:
            # Named but not describable: advertise it so the kubelet sees it, as unhealthy.
            log.error("gpu discovery failed", gpu=index, uuid=uuid, error=describe(exc))
            kind = LOST if isinstance(exc, pynvml.NVMLError_GpuIsLost) else "discovery"
            detail = "" if kind == LOST else describe(exc)
            return Gpu(
                index=index,
                uuid=uuid,
                minor=index,
                name="",
                memory_mib=0,
                pci_bus_id="",
                health=GpuHealth((Condition(kind, detail),)),
            )
        return gpu

    def _memory_total_mib(self, handle: Any) -> int:
        info = self._memory_info(handle)
        return int(info.total) // (1024 * 1024)

    @staticmethod
    def _memory_info(handle: Any) -> Any:
        try:
            return pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
        except pynvml.NVMLError as exc:
            if exc.value not in _ABSENT:
                raise
            return pynvml.nvmlDeviceGetMemoryInfo(handle)

    def _numa_node(self, index: int, handle: Any, bus_id: str) -> int | None:
        """NUMA node from NVML where the driver offers it, else from sysfs; ``None`` if unknown."""
        node = self._optional(index, "numa_node", pynvml.nvmlDeviceGetNumaNodeId, handle)
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

    # ----- events ------------------------------------------------------------------------------
    def open_events(self, mask: int = HEALTH_EVENTS) -> dict[int, str]:
        """Register every discovered GPU for health events; returns GPUs that could not be.

        A GPU (or driver) without event support is logged and left to the liveness probe; any other
        failure is returned as that GPU's error.
        """
        failed: dict[int, str] = {}
        try:
            self._event_set = pynvml.nvmlEventSetCreate()
        except pynvml.NVMLError as exc:
            log.error("cannot create nvml event set", error=describe(exc))
            return {index: describe(exc) for index in self._handles}
        for index, handle in self._handles.items():
            try:
                supported = int(pynvml.nvmlDeviceGetSupportedEventTypes(handle))
                pynvml.nvmlDeviceRegisterEvents(handle, mask & supported, self._event_set)
            except pynvml.NVMLError as exc:
                if exc.value in _ABSENT:
                    log.warning("gpu does not support health events", gpu=index)
                else:
                    log.error("gpu event registration failed", gpu=index, error=describe(exc))
                    failed[index] = describe(exc)
        return failed

    def wait_event(self, timeout_ms: int) -> tuple[int, HealthEvent] | None:
        """The next health event as ``(gpu index, event)``, or ``None`` after ``timeout_ms``."""
        if self._event_set is None:
            raise EventWaitError("no event set", lost=False)
        try:
            data = pynvml.nvmlEventSetWait_v2(self._event_set, timeout_ms)
        except pynvml.NVMLError as exc:
            if exc.value == pynvml.NVML_ERROR_TIMEOUT:
                return None
            lost = exc.value == pynvml.NVML_ERROR_GPU_IS_LOST
            raise EventWaitError(describe(exc), lost=lost) from exc
        index = None
        if data.device:
            index = self._by_address.get(ctypes.addressof(data.device.contents))
        if index is None:
            log.warning("event for an unknown device", event_type=hex(int(data.eventType)))
            return None
        event = _health_event(int(data.eventType), int(data.eventData))
        if event is None:
            return None
        return index, event

    # ----- liveness and telemetry --------------------------------------------------------------
    def probe(self, index: int) -> Probe:
        """Read the GPU's telemetry; a lost or failing GPU shows up as a health event."""
        handle = self._handles[index]
        try:
            telemetry = self._telemetry(index, handle)
            action = self._recovery_action(handle)
            processes = self._processes.read(index, handle)
        except pynvml.NVMLError_GpuIsLost:
            return Probe(events=(GpuLost(),), telemetry=Telemetry())
        except pynvml.NVMLError as exc:
            return Probe(events=(ProbeFailed(describe(exc)),), telemetry=Telemetry())
        return Probe(
            events=(Responding(),),
            telemetry=telemetry,
            recovery_action=action,
            processes=processes,
        )

    def _telemetry(self, index: int, handle: Any) -> Telemetry:
        return self._reader.read(index, handle)

    def _recovery_action(self, handle: Any) -> int | None:
        try:
            (value,) = pynvml.nvmlDeviceGetFieldValues(
                handle, [pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION]
            )
        except pynvml.NVMLError as exc:
            if exc.value in _ABSENT:
                return None
            raise
        if value.nvmlReturn != pynvml.NVML_SUCCESS:
            return None
        return int(value.value.uiVal)

    def _optional(self, index: int, what: str, fn: Callable[..., T], *args: Any) -> T | None:
        """``fn(*args)``, or ``None`` when the GPU or driver does not offer it (logged once)."""
        try:
            return fn(*args)
        except pynvml.NVMLError as exc:
            if exc.value not in _ABSENT:
                raise
            with self._absent_lock:
                first = (index, what) not in self._absent_logged
                self._absent_logged.add((index, what))
            if first:
                log.info(
                    "value not offered by this gpu or driver",
                    gpu=index,
                    value=what,
                    error=describe(exc),
                )
            return None

    @property
    def indexes(self) -> Iterable[int]:
        return tuple(self._handles)


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


def _health_event(event_type: int, data: int) -> HealthEvent | None:
    if event_type & pynvml.nvmlEventTypeXidCriticalError:
        return XidError(data)
    if event_type & pynvml.nvmlEventTypeDoubleBitEccError:
        return DoubleBitEccError()
    if event_type & pynvml.nvmlEventTypeGpuRecoveryAction:
        return RecoveryActionChanged(data)
    return None


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
