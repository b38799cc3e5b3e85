"""NVML's health events as the fault tests read them: the event types, a GPU's handle, an event
set drained, the counters a fault moves; a wait blocked in another thread, a call made in one."""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from typing import Any

import pynvml
from support.clock import WAIT_S, blocked_in

XID = pynvml.nvmlEventTypeXidCriticalError
DBE = pynvml.nvmlEventTypeDoubleBitEccError
RECOVERY = pynvml.nvmlEventTypeGpuRecoveryAction
HEALTH = XID | DBE | RECOVERY
GPU_RESET = pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET
NONE = pynvml.NVML_GPU_RECOVERY_ACTION_NONE


def handle(index: int) -> Any:
    return pynvml.nvmlDeviceGetHandleByIndex(index)


def drain(event_set: Any, *, until_lost: bool = False) -> list[tuple[int, int, int]]:
    """Every queued event as ``(gpu index, event type, event data)``, until a wait times out
    (``until_lost``: until the wait answers GPU_IS_LOST, as for a set holding a lost GPU)."""
    end, wait_ms = (
        (pynvml.NVMLError_GpuIsLost, 1000) if until_lost else (pynvml.NVMLError_Timeout, 0)
    )
    addresses = {ctypes.addressof(handle(i).contents): i for i in range(4)}
    seen: list[tuple[int, int, int]] = []
    while True:
        try:
            data = pynvml.nvmlEventSetWait_v2(event_set, wait_ms)
        except end:
            return seen
        gpu = addresses[ctypes.addressof(data.device.contents)]
        seen.append((gpu, int(data.eventType), int(data.eventData)))


def volatile_dbe(index: int) -> int:
    (count,) = pynvml.nvmlDeviceGetFieldValues(
        handle(index), [pynvml.NVML_FI_DEV_ECC_DBE_VOL_TOTAL]
    )
    return int(count.value.ullVal)


def recovery_action(index: int) -> int:
    (value,) = pynvml.nvmlDeviceGetFieldValues(
        handle(index), [pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION]
    )
    assert value.nvmlReturn == pynvml.NVML_SUCCESS
    return int(value.value.uiVal)


def blocked_wait(timeout_ms: int = 600_000) -> tuple[Any, threading.Thread, list[BaseException]]:
    """A fresh event set (GPU 0's XIDs) and a thread blocked in its wait (shown by its stack);
    what the wait raises is appended to the list."""
    event_set = pynvml.nvmlEventSetCreate()
    pynvml.nvmlDeviceRegisterEvents(handle(0), XID, event_set)
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            pynvml.nvmlEventSetWait_v2(event_set, timeout_ms)
        except pynvml.NVMLError as exc:
            errors.append(exc)

    thread = threading.Thread(target=wait)
    thread.start()
    assert thread.ident is not None
    assert blocked_in(thread.ident, "_wait", via=("wait", "wait_for")), "the wait never blocked"
    return event_set, thread, errors


def in_thread(call: Callable[[], object]) -> object:
    """``call()`` on a thread of its own, its result or exception here; it must end in time."""
    outcome: list[object] = []
    failed: list[BaseException] = []

    def run() -> None:
        try:
            outcome.append(call())
        except BaseException as exc:
            failed.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(WAIT_S)
    assert not thread.is_alive(), "the call did not return"
    if failed:
        raise failed[0]
    return outcome[0]
