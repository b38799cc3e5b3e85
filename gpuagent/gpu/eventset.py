"""The backend's NVML event set: health events registered, waited for and decoded.

XIDs, double-bit ECC errors and the driver's recovery action (:data:`HEALTH_EVENTS`) are
registered per GPU on one event set. A set that holds a lost GPU fails every wait, so it is
rebuilt with the GPUs that answer (the old one drained, then freed). An event names its GPU by
device handle, or — a handle the backend has not seen, a MIG device's — by UUID; a MIG device
names its instance. The recovery-action event carries no value (``eventData`` is 0 by nvml.h):
the field is read at once instead.
"""

from __future__ import annotations

import ctypes
import threading
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import pynvml
import structlog

from gpuagent.domain import xids
from gpuagent.domain.devices import MigDevice
from gpuagent.domain.health import (
    DoubleBitEccError,
    GpuLost,
    HealthEvent,
    RecoveryActionChanged,
    XidError,
)
from gpuagent.gpu.backend import DriverEvent, EventWaitError
from gpuagent.gpu.calls import ABSENT, NO_GPU, NvmlCalls, describe
from gpuagent.gpu.telemetry import FIELDS, read_fields

log = structlog.get_logger("gpuagent.nvml")

__all__ = ["HEALTH_EVENTS", "NO_INSTANCE", "EventSet"]

HEALTH_EVENTS = (
    pynvml.nvmlEventTypeXidCriticalError
    | pynvml.nvmlEventTypeDoubleBitEccError
    | pynvml.nvmlEventTypeGpuRecoveryAction
)
#: ``gpuInstanceId``/``computeInstanceId`` of an event attributed to no MIG instance.
NO_INSTANCE = 0xFFFF_FFFF
_RECOVERY_FIELD = [f for f in FIELDS if f[0] == "recovery_action"]
#: An event wait's answer when no event came in time: not a failure.
_NO_EVENT = (pynvml.NVML_ERROR_TIMEOUT,)


class EventSet:
    """Health events of the GPUs the backend described. ``handle_of`` gives a GPU's device
    handle (``None`` before it was named). Waits and rebuilds run on one thread only."""

    def __init__(self, calls: NvmlCalls, handle_of: Callable[[int], Any]) -> None:
        self._calls = calls
        self._handle_of = handle_of
        self._lock = threading.Lock()
        self._by_address: dict[int, int] = {}
        self._by_uuid: dict[str, tuple[int, int | None, int | None]] = {}
        self._event_set: Any = None
        self._drained: deque[DriverEvent] = deque()

    # ----- what events name --------------------------------------------------------------------
    def name_gpu(self, index: int, handle: Any, uuid: str) -> None:
        """GPU ``index`` is known by this handle and UUID from now on."""
        with self._lock:
            self._by_address[ctypes.addressof(handle.contents)] = index
            self._by_uuid[uuid] = (index, None, None)

    def name_migs(self, index: int, migs: Iterable[MigDevice]) -> None:
        """GPU ``index``'s MIG devices, by UUID, with their instance IDs."""
        with self._lock:
            for mig in migs:
                self._by_uuid[mig.uuid] = (index, mig.gpu_instance_id, mig.compute_instance_id)

    # ----- the set ----------------------------------------------------------------------------
    def create(self) -> str | None:
        """Create the event set; the error when it cannot be (GPUs then rely on probes)."""
        try:
            self._event_set = self._calls.call(NO_GPU, pynvml.nvmlEventSetCreate)
        except pynvml.NVMLError as exc:
            log.error("cannot create nvml event set", error=describe(exc))
            return describe(exc)
        return None

    def register(self, index: int, mask: int = HEALTH_EVENTS) -> str | None:
        """Register GPU ``index`` for health events (again, after it was lost); the error if not.

        A GPU (or driver) without event support is logged and left to the liveness check.
        """
        handle = self._handle_of(index)
        if self._event_set is None or handle is None:
            return "no event set"
        try:
            supported = int(
                self._calls.call(index, pynvml.nvmlDeviceGetSupportedEventTypes, handle)
            )
            self._calls.call(
                index, pynvml.nvmlDeviceRegisterEvents, handle, mask & supported, self._event_set
            )
        except pynvml.NVMLError as exc:
            if exc.value in ABSENT:
                log.warning("gpu does not support health events", gpu=index)
                return None
            log.error("gpu event registration failed", gpu=index, error=describe(exc))
            return describe(exc)
        if not supported & pynvml.nvmlEventTypeGpuRecoveryAction:
            log.info("no recovery-action event on this driver; the field is read by probes",
                     gpu=index)  # fmt: skip
        return None

    def rebuild(self, indexes: tuple[int, ...]) -> dict[int, str]:
        """A fresh event set holding only ``indexes`` (a set that holds a lost GPU fails every
        wait); the old set is drained, then freed. Only between waits, from the waiting thread.

        An event raised while the new set is being registered may be read from both sets (a
        duplicate count); none is lost.
        """
        old = self._event_set
        error = self.create()
        if error is not None:
            self._event_set = old
            return dict.fromkeys(indexes, error)
        failed = {}
        for index in indexes:
            problem = self.register(index)
            if problem is not None:
                failed[index] = problem
        if old is not None:
            self._drain(old)
            try:
                self._calls.call(NO_GPU, pynvml.nvmlEventSetFree, old)
            except pynvml.NVMLError as exc:
                log.warning("freeing the old nvml event set failed", error=describe(exc))
        log.info("health events registered again", gpus=list(indexes))
        return failed

    def free(self) -> None:
        """Free the event set (before NVML shuts down); errors are logged."""
        event_set, self._event_set = self._event_set, None
        if event_set is not None:
            try:
                self._calls.call(NO_GPU, pynvml.nvmlEventSetFree, event_set)
            except pynvml.NVMLError as exc:
                log.warning("freeing the nvml event set failed", error=describe(exc))

    def _drain(self, event_set: Any) -> None:
        """Keep the events still queued in a set about to be freed (for :meth:`wait`)."""
        while True:
            try:
                data = self._calls.call(
                    NO_GPU, pynvml.nvmlEventSetWait_v2, event_set, 0, answers=_NO_EVENT
                )
            except pynvml.NVMLError:
                return  # empty (TIMEOUT), or it holds a lost GPU: nothing more to read
            event = self._decode(data)
            if event is not None:
                self._drained.append(event)

    # ----- events -----------------------------------------------------------------------------
    def wait(self, timeout_ms: int) -> DriverEvent | None:
        """The next health event, or ``None`` after ``timeout_ms`` or for an event to skip.

        The recovery-action event is acted on by reading the recovery-action field at once (the
        event's ``eventData`` is 0 by nvml.h); an XID value outside the XID range is refused.
        """
        if self._drained:
            return self._drained.popleft()
        if self._event_set is None:
            raise EventWaitError("no event set", lost=False)
        try:
            data = self._calls.call(
                NO_GPU, pynvml.nvmlEventSetWait_v2, self._event_set, timeout_ms, answers=_NO_EVENT
            )
        except pynvml.NVMLError as exc:
            if exc.value == pynvml.NVML_ERROR_TIMEOUT:
                return None
            lost = exc.value == pynvml.NVML_ERROR_GPU_IS_LOST
            raise EventWaitError(describe(exc), lost=lost) from exc
        return self._decode(data)

    def _decode(self, data: Any) -> DriverEvent | None:
        found = self._event_gpu(data)
        if found is None:
            log.warning("event for an unknown device", event_type=hex(int(data.eventType)))
            return None
        index, gi, ci = found
        event = self._health_event(index, data, gi, ci)
        return None if event is None else DriverEvent(index, event)

    def _event_gpu(self, data: Any) -> tuple[int, int | None, int | None] | None:
        """``(GPU index, GPU instance, compute instance)`` the event names: handle, then UUID."""
        if not data.device:
            return None
        with self._lock:
            index = self._by_address.get(ctypes.addressof(data.device.contents))
        if index is not None:
            return index, _instance(data.gpuInstanceId), _instance(data.computeInstanceId)
        try:
            uuid = str(self._calls.call(NO_GPU, pynvml.nvmlDeviceGetUUID, data.device))
        except pynvml.NVMLError as exc:
            log.warning("event device cannot be named", error=describe(exc))
            return None
        with self._lock:
            found = self._by_uuid.get(uuid)
        if found is None:
            return None
        index, gi, ci = found
        if gi is None:  # the GPU itself: the event's own instance IDs apply
            return index, _instance(data.gpuInstanceId), _instance(data.computeInstanceId)
        return index, gi, ci  # a MIG device handle: that instance

    def _health_event(
        self, index: int, data: Any, gi: int | None, ci: int | None
    ) -> HealthEvent | None:
        event_type = int(data.eventType)
        if event_type & pynvml.nvmlEventTypeXidCriticalError:
            xid = int(data.eventData)
            if not xids.is_valid(xid):
                self._calls.refused(index, "nvmlEventSetWait_v2", f"xid {xid} out of range")
                return None
            return XidError(xid, gi, ci)
        if event_type & pynvml.nvmlEventTypeDoubleBitEccError:
            return DoubleBitEccError()
        if event_type & pynvml.nvmlEventTypeGpuRecoveryAction:
            return self._recovery_action(index)
        return None

    def _recovery_action(self, index: int) -> HealthEvent | None:
        """The recovery-action field of GPU ``index`` read now, as an event (``GpuLost`` if the
        GPU is lost); ``None`` when it cannot be read (the next probe reads it)."""
        handle = self._handle_of(index)
        if handle is None:
            return None
        try:
            values = read_fields(self._calls, index, handle, _RECOVERY_FIELD)
        except pynvml.NVMLError_GpuIsLost:
            return GpuLost()
        value = values.get("recovery_action")
        return None if value is None else RecoveryActionChanged(int(value))


def _instance(value: int) -> int | None:
    """An event's GPU/compute instance ID; ``None`` for 0xFFFFFFFF (the whole GPU)."""
    value = int(value)
    return None if value == NO_INSTANCE else value
