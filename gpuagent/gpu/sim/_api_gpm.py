"""GPU Performance Monitoring (GPM) entry points of the simulated ``libnvidia-ml``.

GPM is Hopper and newer: older GPUs answer ``nvmlGpmQueryDeviceSupport`` with
``isSupportedDevice = 0`` and ``nvmlGpmSampleGet`` with NOT_SUPPORTED, as a real A100 does.
A sample (``nvmlGpmSample_t``) is an opaque handle from ``nvmlGpmSampleAlloc``; ``nvmlGpmSampleGet``
records the GPU's telemetry at that instant into it, and ``nvmlGpmMetricsGet`` derives each
metric from two samples of one GPU as the mean over the interval between them
(:func:`gpuagent.gpu.sim.telemetry.gpm_value`). Using a freed, unknown or not yet filled sample,
or samples of two GPUs, is INVALID_ARGUMENT; so is a pair taken less than
:data:`MIN_SAMPLE_INTERVAL_S` apart (by the driver's clock): the driver needs 100 ms between two
samples, and what it answers for a closer pair is undefined — the simulator makes it an error, the
loudest choice.
"""

from __future__ import annotations

import ctypes
import math
import threading
import weakref
from dataclasses import dataclass

import pynvml

from gpuagent.gpu.sim import telemetry
from gpuagent.gpu.sim._abi import BadArgument, Symbol, as_int, device, out
from gpuagent.gpu.sim.profiles import NVML_DEVICE_ARCH_HOPPER
from gpuagent.gpu.sim.state import DriverState, GpuState

SUCCESS = int(pynvml.NVML_SUCCESS)
INVALID_ARGUMENT = int(pynvml.NVML_ERROR_INVALID_ARGUMENT)
NOT_SUPPORTED = int(pynvml.NVML_ERROR_NOT_SUPPORTED)
VERSION_MISMATCH = int(pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
#: The least time between two GPM samples that ``nvmlGpmMetricsGet`` accepts.
MIN_SAMPLE_INTERVAL_S = 0.1

# (shortName, longName, unit) as nvmlGpmMetricsGet fills metricInfo; kept alive at module level.
_PERCENT = b"%"
_MIB_PER_S = b"MiB/sec"
_INFO: dict[int, tuple[bytes, bytes, bytes]] = {
    pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL: (b"gr_util", b"graphics utilization", _PERCENT),
    pynvml.NVML_GPM_METRIC_SM_UTIL: (b"sm_util", b"SM utilization", _PERCENT),
    pynvml.NVML_GPM_METRIC_SM_OCCUPANCY: (b"sm_occupancy", b"SM occupancy", _PERCENT),
    pynvml.NVML_GPM_METRIC_INTEGER_UTIL: (b"int_util", b"integer utilization", _PERCENT),
    pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL: (b"tensor_util", b"tensor utilization", _PERCENT),
    pynvml.NVML_GPM_METRIC_DFMA_TENSOR_UTIL: (b"dfma_util", b"DFMA tensor utilization", _PERCENT),
    pynvml.NVML_GPM_METRIC_HMMA_TENSOR_UTIL: (b"hmma_util", b"HMMA tensor utilization", _PERCENT),
    pynvml.NVML_GPM_METRIC_DMMA_TENSOR_UTIL: (b"dmma_util", b"DMMA tensor utilization", _PERCENT),
    pynvml.NVML_GPM_METRIC_IMMA_TENSOR_UTIL: (b"imma_util", b"IMMA tensor utilization", _PERCENT),
    pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL: (b"dram_bw_util", b"DRAM bandwidth utilization", _PERCENT),
    pynvml.NVML_GPM_METRIC_FP64_UTIL: (b"fp64_util", b"FP64 utilization", _PERCENT),
    pynvml.NVML_GPM_METRIC_FP32_UTIL: (b"fp32_util", b"FP32 utilization", _PERCENT),
    pynvml.NVML_GPM_METRIC_FP16_UTIL: (b"fp16_util", b"FP16 utilization", _PERCENT),
    pynvml.NVML_GPM_METRIC_PCIE_TX_PER_SEC: (b"pcie_tx", b"PCIe TX bandwidth", _MIB_PER_S),
    pynvml.NVML_GPM_METRIC_PCIE_RX_PER_SEC: (b"pcie_rx", b"PCIe RX bandwidth", _MIB_PER_S),
    pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC: (
        b"nvlink_tx",
        b"NVLink total TX bandwidth",
        _MIB_PER_S,
    ),
    pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC: (
        b"nvlink_rx",
        b"NVLink total RX bandwidth",
        _MIB_PER_S,
    ),
}


@dataclass(eq=False)
class GpmSample:
    """One allocated ``nvmlGpmSample_t`` and what ``nvmlGpmSampleGet`` last recorded in it."""

    handle: pynvml.struct_c_nvmlGpmSample_t
    gpu: int | None = None
    instance: int | None = None  # the GPU instance of a MIG sample (nvmlGpmMigSampleGet)
    nvlink: bool = False
    reading: telemetry.Sample | None = None


class _Samples:
    """The live GPM samples of one simulated driver, by the address of their opaque handle."""

    def __init__(self) -> None:
        self.by_address: dict[int, GpmSample] = {}


# One registry per driver state (the driver's lock guards it: every entry point runs under it).
_REGISTRIES: weakref.WeakKeyDictionary[DriverState, _Samples] = weakref.WeakKeyDictionary()
_REGISTRIES_LOCK = threading.Lock()


def samples_of(st: DriverState) -> dict[int, GpmSample]:
    """The live (allocated, not yet freed) GPM samples of a driver, by handle address."""
    with _REGISTRIES_LOCK:
        registry = _REGISTRIES.get(st)
        if registry is None:
            registry = _REGISTRIES[st] = _Samples()
    return registry.by_address


def gpm_supported(gpu: GpuState) -> bool:
    """Whether this device offers GPM: a full GPU (not a MIG device) of Hopper or newer."""
    if getattr(gpu, "mig", None) is not None:
        return False
    return gpu.spec.profile.architecture >= NVML_DEVICE_ARCH_HOPPER


def _sample_of(st: DriverState, handle: object) -> GpmSample | None:
    try:
        if not handle:
            return None
        contents = handle.contents  # type: ignore[attr-defined]
        return samples_of(st).get(ctypes.addressof(contents))
    except (AttributeError, TypeError, ValueError):
        return None


def _query_support(st: DriverState, gpu: GpuState, ref: object) -> int:
    support = out(ref)
    if support.version != pynvml.NVML_GPM_SUPPORT_VERSION:
        return VERSION_MISMATCH
    support.isSupportedDevice = int(gpm_supported(gpu))
    return SUCCESS


def _sample_alloc(st: DriverState, ref: object) -> int:
    sample = GpmSample(handle=pynvml.struct_c_nvmlGpmSample_t())
    try:
        out(ref).contents = sample.handle
    except (AttributeError, TypeError) as exc:
        raise BadArgument("expected an nvmlGpmSample_t reference") from exc
    samples_of(st)[ctypes.addressof(sample.handle)] = sample
    return SUCCESS


def _sample_free(st: DriverState, handle: object) -> int:
    sample = _sample_of(st, handle)
    if sample is None:
        return INVALID_ARGUMENT
    del samples_of(st)[ctypes.addressof(sample.handle)]
    return SUCCESS


def _sample_get(st: DriverState, gpu: GpuState, handle: object) -> int:
    if not gpm_supported(gpu):
        return NOT_SUPPORTED
    sample = _sample_of(st, handle)
    if sample is None:
        return INVALID_ARGUMENT
    sample.gpu = gpu.index
    sample.instance = None
    sample.nvlink = any(end is not None for end in gpu.links)
    sample.reading = st.sample(gpu)
    return SUCCESS


def _mig_sample_get(st: DriverState, gpu: GpuState, gi_id: object, handle: object) -> int:
    """A sample of one GPU instance of a MIG-enabled GPU (the parent's handle, the GI's ID).

    The instance's activity follows its own wave (its GPU-instance ID shifts the phase), so each
    instance reads differently from its parent and its neighbours.
    """
    if not gpm_supported(gpu):
        return NOT_SUPPORTED
    if not gpu.mig_enabled:
        return NOT_SUPPORTED
    wanted = as_int(gi_id)
    mig = next((m for m in gpu.migs if m.spec.gpu_instance_id == wanted), None)
    if mig is None:
        return int(pynvml.NVML_ERROR_NOT_FOUND)
    sample = _sample_of(st, handle)
    if sample is None:
        return INVALID_ARGUMENT
    sample.gpu = gpu.index
    sample.instance = wanted
    sample.nvlink = False
    sample.reading = st.sample_instance(mig.device, wanted)
    return SUCCESS


def _metrics_get(st: DriverState, ref: object) -> int:
    request = out(ref)
    if as_int(request.version) != pynvml.NVML_GPM_METRICS_GET_VERSION:
        return VERSION_MISMATCH
    count = as_int(request.numMetrics)
    if not 0 <= count <= pynvml.NVML_GPM_METRIC_MAX:
        return INVALID_ARGUMENT
    first = _sample_of(st, request.sample1)
    second = _sample_of(st, request.sample2)
    if first is None or second is None or first.reading is None or second.reading is None:
        return INVALID_ARGUMENT
    if first.gpu != second.gpu or first.instance != second.instance:
        return INVALID_ARGUMENT
    if abs(second.reading.t_s - first.reading.t_s) < MIN_SAMPLE_INTERVAL_S:
        return INVALID_ARGUMENT
    nvlink = first.nvlink and second.nvlink
    for i in range(count):
        metric = request.metrics[i]
        metric_id = int(metric.metricId)
        if metric_id not in telemetry.GPM_MODEL:
            metric.nvmlReturn = NOT_SUPPORTED
            metric.value = math.nan
            continue
        metric.value = telemetry.gpm_value(metric_id, first.reading, second.reading, nvlink=nvlink)
        metric.nvmlReturn = SUCCESS
        info = _INFO.get(metric_id)
        if info is not None:
            short, long, unit = info
            metric.metricInfo.shortName = short
            metric.metricInfo.longName = long
            metric.metricInfo.unit = unit
    return SUCCESS


SYMBOLS: dict[str, Symbol] = {
    "nvmlGpmQueryDeviceSupport": device(_query_support),
    "nvmlGpmSampleAlloc": Symbol(_sample_alloc),
    "nvmlGpmSampleFree": Symbol(_sample_free),
    "nvmlGpmSampleGet": device(_sample_get),
    "nvmlGpmMigSampleGet": device(_mig_sample_get),
    "nvmlGpmMetricsGet": Symbol(_metrics_get),
}
