"""GPM metrics (Hopper and newer): profiling ratios and PCIe rates from pairs of samples.

Each GPU (and, on a MIG-enabled GPU, each GPU instance, through ``nvmlGpmMigSampleGet``) keeps
two sample buffers used alternately; a metric is its mean over the interval between the previous
sample and the current one. Ratios are 0..1 (NVML: percent, divided by 100); ``pcie_tx_bytes``/
``pcie_rx_bytes`` are bytes/s (NVML: MiB/s). Samples are freed before NVML shuts down.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pynvml
import structlog

from gpuagent.gpu.calls import ABSENT, NvmlCalls, describe

log = structlog.get_logger("gpuagent.nvml")

__all__ = ["GPM_METRICS", "GPM_MIN_INTERVAL_S", "GpmSampler"]

MIB = 1024 * 1024
#: How long ``close()`` waits for a probe that is using a GPU's GPM samples.
CLOSE_WAIT_S = 0.5
#: The least time between the two GPM samples of a pair (the driver needs 100 ms; margin added).
GPM_MIN_INTERVAL_S = 0.110

#: GPM metrics: (NVML metric id, Telemetry field, factor from NVML's unit to ours).
GPM_METRICS: tuple[tuple[int, str, float], ...] = (
    (pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL, "gr_engine_active", 0.01),
    (pynvml.NVML_GPM_METRIC_SM_UTIL, "sm_active", 0.01),
    (pynvml.NVML_GPM_METRIC_SM_OCCUPANCY, "sm_occupancy", 0.01),
    (pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL, "tensor_active", 0.01),
    (pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL, "dram_active", 0.01),
    (pynvml.NVML_GPM_METRIC_PCIE_TX_PER_SEC, "pcie_tx_bytes", float(MIB)),
    (pynvml.NVML_GPM_METRIC_PCIE_RX_PER_SEC, "pcie_rx_bytes", float(MIB)),
)


@dataclass(eq=False)
class _GpuSamples:
    """One GPU's two GPM sample buffers, used alternately; ``previous`` holds the last reading."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    buffers: list[Any] = field(default_factory=list)
    previous: int | None = None
    taken_at: float = 0.0
    values: dict[str, float] = field(default_factory=dict)
    closed: bool = False


class GpmSampler:
    """GPM metrics (Hopper and newer) from the previous and the current sample of each GPU.

    The first read of a GPU only takes a sample (values absent); each later read takes a new one
    and reports every metric as its mean over the interval between the two. A read sooner than
    :data:`GPM_MIN_INTERVAL_S` after the last sample takes none and repeats the last values (the
    driver's pairs need 100 ms; back-to-back polls happen). A GPU without GPM is asked once and
    logged once. NaN and per-metric errors leave that value absent.
    """

    def __init__(self, calls: NvmlCalls, clock: Callable[[], float] = time.monotonic) -> None:
        self._calls = calls
        self._clock = clock
        self._lock = threading.Lock()
        self._supported: dict[int, bool] = {}
        self._gpus: dict[tuple[int, int | None], _GpuSamples] = {}

    def read(self, index: int, handle: Any, instance: int | None = None) -> dict[str, float]:
        """Telemetry field -> value for the GPM metrics; empty when there is no pair yet.

        ``instance``: a GPU instance of the (MIG-enabled) GPU ``handle`` names, sampled with
        ``nvmlGpmMigSampleGet``; its samples pair with each other only.
        """
        if not self._is_supported(index, handle):
            return {}
        with self._lock:
            gpu = self._gpus.setdefault((index, instance), _GpuSamples())
        with gpu.lock:
            if gpu.closed:
                return {}
            return self._read_locked(index, handle, gpu, instance)

    def _is_supported(self, index: int, handle: Any) -> bool:
        known = self._supported.get(index)
        if known is not None:
            return known
        support = self._calls.reading(index, pynvml.nvmlGpmQueryDeviceSupport, handle)
        supported = support is not None and bool(support.isSupportedDevice)
        if support is not None and not supported:
            self._calls.absent(index, "nvmlGpmQueryDeviceSupport", pynvml.NVML_ERROR_NOT_SUPPORTED)
        with self._lock:
            self._supported[index] = supported
        return supported

    def _read_locked(
        self, index: int, handle: Any, gpu: _GpuSamples, instance: int | None
    ) -> dict[str, float]:
        now = self._clock()
        if gpu.previous is not None and now - gpu.taken_at < GPM_MIN_INTERVAL_S:
            return dict(gpu.values)
        if not gpu.buffers and not self._allocate(index, gpu):
            return {}
        current = 0 if gpu.previous is None else 1 - gpu.previous
        sample: tuple[Any, ...] = (handle, gpu.buffers[current])
        call: Callable[..., Any] = pynvml.nvmlGpmSampleGet
        if instance is not None:
            sample, call = (handle, instance, gpu.buffers[current]), pynvml.nvmlGpmMigSampleGet
        try:
            self._calls.call(index, call, *sample)
        except pynvml.NVMLError as exc:
            gpu.previous = None  # a later sample must not pair with one from before a failure
            gpu.values = {}
            if exc.value == pynvml.NVML_ERROR_GPU_IS_LOST:
                raise
            if exc.value in ABSENT:
                self._calls.absent(index, call.__name__, exc.value)
            else:
                self._calls.failed(index, call.__name__, exc.value)
            return {}
        previous, gpu.previous, gpu.taken_at = gpu.previous, current, now
        if previous is None:
            return {}
        request = pynvml.c_nvmlGpmMetricsGet_t()
        request.version = pynvml.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = len(GPM_METRICS)
        request.sample1 = gpu.buffers[previous]
        request.sample2 = gpu.buffers[current]
        for i, (metric_id, _, _) in enumerate(GPM_METRICS):
            request.metrics[i].metricId = metric_id
        if self._calls.reading(index, pynvml.nvmlGpmMetricsGet, request) is None:
            gpu.values = {}
            return {}
        gpu.values = self._values(index, request.metrics)
        return dict(gpu.values)

    def _values(self, index: int, metrics: Sequence[Any]) -> dict[str, float]:
        values: dict[str, float] = {}
        for i, (_, name, factor) in enumerate(GPM_METRICS):
            metric = metrics[i]
            code = int(metric.nvmlReturn)
            if code != pynvml.NVML_SUCCESS:
                self._calls.slot(index, name, code, call="nvmlGpmMetricsGet")
                continue
            value = float(metric.value)
            if math.isfinite(value):
                values[name] = value * factor
        return values

    def _allocate(self, index: int, gpu: _GpuSamples) -> bool:
        buffers: list[Any] = []
        try:
            for _ in range(2):
                sample = self._calls.reading(index, pynvml.nvmlGpmSampleAlloc)
                if sample is None:
                    break
                buffers.append(sample)
        except pynvml.NVMLError:
            _free_all(index, buffers)
            raise
        if len(buffers) < 2:
            _free_all(index, buffers)
            return False
        gpu.buffers = buffers
        return True

    def close(self) -> None:
        """Free every GPU's samples (a GPU whose probe is stuck in the driver keeps them)."""
        with self._lock:
            gpus, self._gpus = self._gpus, {}
            self._supported = {}
        for (index, _), gpu in gpus.items():
            if not gpu.lock.acquire(timeout=CLOSE_WAIT_S):
                log.warning("gpm samples still in use; not freed", gpu=index)
                continue
            try:
                gpu.closed = True
                buffers, gpu.buffers = gpu.buffers, []
                _free_all(index, buffers)
            finally:
                gpu.lock.release()


def _free_all(index: int, samples: Sequence[Any]) -> None:
    for sample in samples:
        try:
            pynvml.nvmlGpmSampleFree(sample)
        except pynvml.NVMLError as exc:
            log.warning("freeing a gpm sample failed", gpu=index, error=describe(exc))
