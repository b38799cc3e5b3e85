"""Library, system and device-enumeration entry points of the simulated ``libnvidia-ml``."""

from __future__ import annotations

import pynvml

from gpuagent.gpu.sim._abi import Symbol, as_bytes, as_int, out, write_str
from gpuagent.gpu.sim.state import DriverState
from gpuagent.overrides.nvml import nvml_error_text

SUCCESS = int(pynvml.NVML_SUCCESS)

#: nvmlErrorString texts for the codes pynvml has no text of its own for.
_ERROR_STRINGS = {
    pynvml.NVML_ERROR_IN_USE: "In use by another client",
    pynvml.NVML_ERROR_NO_DATA: "No data",
    pynvml.NVML_ERROR_VGPU_ECC_NOT_SUPPORTED: "ECC is not supported on vGPU",
    pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES: "Insufficient resources",
    pynvml.NVML_ERROR_FREQ_NOT_SUPPORTED: "Frequency not supported",
    pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH: "Argument version mismatch",
    pynvml.NVML_ERROR_DEPRECATED: "Deprecated",
    pynvml.NVML_ERROR_NOT_READY: "Not ready",
    pynvml.NVML_ERROR_GPU_NOT_FOUND: "GPU not found",
    pynvml.NVML_ERROR_INVALID_STATE: "Invalid state",
    pynvml.NVML_ERROR_RESET_TYPE_NOT_SUPPORTED: "Reset type not supported",
}


def _init_with_flags(st: DriverState, flags: object) -> int:
    as_int(flags)
    st.init_count += 1
    return SUCCESS


def _shutdown(st: DriverState) -> int:
    st.init_count -= 1
    if st.init_count == 0:
        if any(s.waiters for s in st.event_sets.values()):
            st.misuse.append("nvmlShutdown while a thread waits on an event set")
        st.warm.clear()  # without persistence mode, GPUs go cold when the last client leaves
        st.cond.notify_all()
    return SUCCESS


def _error_string(st: DriverState, code: object) -> bytes:
    value = as_int(code)
    known = nvml_error_text(value) or _ERROR_STRINGS.get(value)
    return str(known or "Unknown Error").encode()


def _driver_version(st: DriverState, buffer: object, length: object) -> int:
    return write_str(buffer, length, st.node.driver_version)


def _nvml_version(st: DriverState, buffer: object, length: object) -> int:
    cuda = st.node.cuda_driver_version
    return write_str(buffer, length, f"{cuda // 1000}.{st.node.driver_version}")


def _cuda_version(st: DriverState, ref: object) -> int:
    out(ref).value = st.node.cuda_driver_version
    return SUCCESS


def _count(st: DriverState, ref: object) -> int:
    out(ref).value = len(st.gpus)
    return SUCCESS


def _by_index(st: DriverState, index: object, ref: object) -> int:
    i = as_int(index)
    if not 0 <= i < len(st.gpus):
        return int(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    out(ref).contents = st.gpus[i].handle
    return SUCCESS


def _by_uuid(st: DriverState, uuid: object, ref: object) -> int:
    gpu = st.find_uuid(as_bytes(uuid))
    if gpu is None:
        return int(pynvml.NVML_ERROR_NOT_FOUND)
    out(ref).contents = gpu.handle
    return SUCCESS


def _by_bus_id(st: DriverState, bus_id: object, ref: object) -> int:
    gpu = st.find_bus_id(as_bytes(bus_id))
    if gpu is None:
        return int(pynvml.NVML_ERROR_NOT_FOUND)
    out(ref).contents = gpu.handle
    return SUCCESS


SYMBOLS: dict[str, Symbol] = {
    "nvmlInitWithFlags": Symbol(_init_with_flags, needs_init=False),
    "nvmlShutdown": Symbol(_shutdown),
    "nvmlErrorString": Symbol(_error_string, needs_init=False),
    "nvmlSystemGetDriverVersion": Symbol(_driver_version),
    "nvmlSystemGetNVMLVersion": Symbol(_nvml_version),
    "nvmlSystemGetCudaDriverVersion": Symbol(_cuda_version),
    "nvmlSystemGetCudaDriverVersion_v2": Symbol(_cuda_version),
    "nvmlDeviceGetCount_v2": Symbol(_count),
    "nvmlDeviceGetHandleByIndex_v2": Symbol(_by_index, target="index", lost_ok=True),
    "nvmlDeviceGetHandleByUUID": Symbol(_by_uuid, target="uuid", lost_ok=True),
    "nvmlDeviceGetHandleByPciBusId_v2": Symbol(_by_bus_id, target="pci", lost_ok=True),
}
