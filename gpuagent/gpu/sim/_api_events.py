"""Event entry points of the simulated ``libnvidia-ml`` (topology and NVLink: ``_api_topology``).

As nvml.h says: ``eventData`` is the XID for XID events and 0 for every other type;
``gpuInstanceId`` and ``computeInstanceId`` name the MIG instance an event is attributed to,
``0xFFFFFFFF`` when none.
A driver before R565 has no recovery-action event (0x8000). A wait on a set that holds a lost GPU
returns ``NVML_ERROR_GPU_IS_LOST`` once its queued events are delivered, every time, until the GPU
answers again — a real driver does, so a caller must not spin on it.

A freed event set stays known to the driver: waiting on it, registering on it or freeing it
again returns ``NVML_ERROR_INVALID_ARGUMENT`` (a real driver would read freed memory). nvml.h
promises nothing for a set freed, or NVML shut down, while another thread is blocked in a wait on
it: the simulator records either in ``misuse`` (tests assert it stays empty), then wakes the
waiter with ``INVALID_ARGUMENT`` or ``UNINITIALIZED`` so that a test fails instead of hanging.
A wait may end early with ``NVML_ERROR_TIMEOUT`` "when an interrupt arrives" (nvml.h):
``SimDriver.interrupt_waits`` does that to every blocked wait.
"""

from __future__ import annotations

import pynvml

from gpuagent.gpu.sim._abi import Symbol, as_int, device, out
from gpuagent.gpu.sim.state import DriverState, EventSet, GpuState

SUCCESS = int(pynvml.NVML_SUCCESS)
INVALID_ARGUMENT = int(pynvml.NVML_ERROR_INVALID_ARGUMENT)
NOT_SUPPORTED = int(pynvml.NVML_ERROR_NOT_SUPPORTED)


def _set_create(st: DriverState, ref: object) -> int:
    out(ref).contents = st.new_event_set().handle
    return SUCCESS


def _live_set(st: DriverState, handle: object) -> EventSet | None:
    event_set = st.event_set_of(handle)
    return None if event_set is None or event_set.freed else event_set


def _supported(st: DriverState, gpu: GpuState, ref: object) -> int:
    out(ref).value = st.supported_events
    return SUCCESS


def _register(st: DriverState, gpu: GpuState, mask: object, handle: object) -> int:
    event_set = _live_set(st, handle)
    if event_set is None:
        return INVALID_ARGUMENT
    bits = as_int(mask)
    if bits & ~st.supported_events:
        return NOT_SUPPORTED
    event_set.masks[gpu.index] = event_set.masks.get(gpu.index, 0) | bits
    return SUCCESS


def _wait(st: DriverState, handle: object, ref: object, timeout_ms: object) -> int:
    event_set = _live_set(st, handle)
    if event_set is None:
        return INVALID_ARGUMENT
    data = out(ref)
    timeout = as_int(timeout_ms) / 1000.0

    def lost() -> bool:
        return any(st.gpus[index].lost for index in event_set.masks)

    interrupts = st.interrupts
    event_set.waiters += 1
    try:
        st.cond.wait_for(
            lambda: (
                bool(event_set.queue)
                or event_set.freed
                or st.init_count == 0
                or lost()
                or st.interrupts != interrupts
            ),
            timeout,
        )
    finally:
        event_set.waiters -= 1
    if event_set.freed:
        return INVALID_ARGUMENT
    if st.init_count == 0:
        return int(pynvml.NVML_ERROR_UNINITIALIZED)
    if not event_set.queue:
        return int(pynvml.NVML_ERROR_GPU_IS_LOST if lost() else pynvml.NVML_ERROR_TIMEOUT)
    event = event_set.queue.popleft()
    data.device = pynvml.c_nvmlDevice_t(st.gpus[event.gpu].handle)
    data.eventType = event.event_type
    data.eventData = event.data
    data.gpuInstanceId = event.gpu_instance
    data.computeInstanceId = event.compute_instance
    return SUCCESS


def _set_free(st: DriverState, handle: object) -> int:
    event_set = _live_set(st, handle)
    if event_set is None:
        return INVALID_ARGUMENT
    if event_set.waiters:
        st.misuse.append("nvmlEventSetFree while a thread waits on the set")
    event_set.freed = True
    event_set.queue.clear()
    st.cond.notify_all()
    return SUCCESS


SYMBOLS: dict[str, Symbol] = {
    "nvmlEventSetCreate": Symbol(_set_create),
    "nvmlDeviceGetSupportedEventTypes": device(_supported),
    "nvmlDeviceRegisterEvents": device(_register),
    "nvmlEventSetWait_v2": Symbol(_wait),
    "nvmlEventSetFree": Symbol(_set_free),
}
