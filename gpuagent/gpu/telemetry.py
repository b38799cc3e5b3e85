"""One GPU's telemetry through NVML, in dcgm-exporter's units (the backend's ``_telemetry``).

Per GPU and poll cycle (on a GPU that offers everything, after the first cycle) this makes 12 NVML
calls: ``nvmlDeviceGetTemperature``, ``nvmlDeviceGetPowerUsage``,
``nvmlDeviceGetTotalEnergyConsumption``, ``nvmlDeviceGetClockInfo`` (SM, memory),
``nvmlDeviceGetUtilizationRates``, ``nvmlDeviceGetEncoderUtilization``,
``nvmlDeviceGetDecoderUtilization``, ``nvmlDeviceGetMemoryInfo_v2`` (v1 where v2 is missing),
ONE ``nvmlDeviceGetFieldValues`` for every field-based value (:data:`FIELDS`), and on Hopper and
newer ``nvmlGpmSampleGet`` + ``nvmlGpmMetricsGet``.

Units:

- temperatures °C (readings above :data:`MAX_TEMPERATURE_C` are sensor errors and dropped, as DCGM
  does); power W (NVML: mW); energy mJ since the driver loaded; clocks MHz; ``*_util_pct`` percent;
  framebuffer MiB (``fb_used_mib`` excludes the driver's reservation when v2 reports it separately;
  with v1 it includes it and ``fb_reserved_mib`` is absent).
- ``nvlink_bandwidth_total``: a counter of **MiB** moved over all NVLinks, TX + RX data payload
  (NVML's ``NVLINK_THROUGHPUT_DATA_TX``/``_RX`` with ``scopeId = UINT_MAX`` count KiB; we add them
  and divide by 1024). Take ``rate()`` of it for MiB/s.
- GPM ratios 0..1 (NVML: percent, divided by 100); ``pcie_tx_bytes``/``pcie_rx_bytes`` in
  **bytes/s** (NVML reports MiB/s; times 1048576); each is the mean over the interval since the
  previous probe.

What a GPU or driver does not offer (NOT_SUPPORTED, FUNCTION_NOT_FOUND — for a whole call or one
field slot) is ``None`` and logged once through the backend's ``optional`` hook. Any other NVML
error from a call raises out of :meth:`TelemetryReader.read` (the probe turns it into ``GpuLost``
or ``ProbeFailed``); a field slot reporting a lost GPU raises too, while a slot with another error
is absent and logged when its error first appears.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn, Protocol, TypeVar

import pynvml
import structlog

from gpuagent.domain.devices import Telemetry

log = structlog.get_logger("gpuagent.nvml")
T = TypeVar("T")

MIB = 1024 * 1024
KIB_PER_MIB = 1024
#: DCGM drops temperature readings above this as sensor errors.
MAX_TEMPERATURE_C = 200
#: ``nvmlFieldValue_t.scopeId`` for "all NVLinks together".
ALL_LINKS = 0xFFFF_FFFF
#: How long ``close()`` waits for a probe that is using a GPU's GPM samples.
CLOSE_WAIT_S = 0.5

_ABSENT = (pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)

#: Field-based values, read in one ``nvmlDeviceGetFieldValues`` call: (key, field id, scope id).
FIELDS: tuple[tuple[str, int, int], ...] = (
    ("memory_temperature", pynvml.NVML_FI_DEV_MEMORY_TEMP, 0),
    ("pcie_replays", pynvml.NVML_FI_DEV_PCIE_REPLAY_COUNTER, 0),
    ("nvlink_tx", pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, ALL_LINKS),
    ("nvlink_rx", pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, ALL_LINKS),
    ("remapped_rows_correctable", pynvml.NVML_FI_DEV_REMAPPED_COR, 0),
    ("remapped_rows_uncorrectable", pynvml.NVML_FI_DEV_REMAPPED_UNC, 0),
    ("row_remap_pending", pynvml.NVML_FI_DEV_REMAPPED_PENDING, 0),
    ("row_remap_failure", pynvml.NVML_FI_DEV_REMAPPED_FAILURE, 0),
    ("ecc_sbe_volatile", pynvml.NVML_FI_DEV_ECC_SBE_VOL_TOTAL, 0),
    ("ecc_dbe_volatile", pynvml.NVML_FI_DEV_ECC_DBE_VOL_TOTAL, 0),
    *(
        (key, field_id, 0)
        for key, field_id in (
            ("power_violation_ns", pynvml.NVML_FI_DEV_PERF_POLICY_POWER),
            ("thermal_violation_ns", pynvml.NVML_FI_DEV_PERF_POLICY_THERMAL),
            ("nvlink_crc_flit_errors", pynvml.NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL),
            ("nvlink_crc_data_errors", pynvml.NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL),
            ("nvlink_replay_errors", pynvml.NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL),
            ("nvlink_recovery_errors", pynvml.NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL),
        )
    ),
)
#: Field values read into the Telemetry field of the same name, as NVML counts them.
PLAIN_FIELDS = (
    "power_violation_ns",
    "thermal_violation_ns",
    "nvlink_crc_flit_errors",
    "nvlink_crc_data_errors",
    "nvlink_replay_errors",
    "nvlink_recovery_errors",
)

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

_VALUE_MEMBER = {
    pynvml.NVML_VALUE_TYPE_DOUBLE: "dVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_INT: "uiVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG: "ulVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: "ullVal",
    pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG: "sllVal",
    pynvml.NVML_VALUE_TYPE_SIGNED_INT: "siVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_SHORT: "usVal",
}


class OptionalCall(Protocol):
    """The backend's log-once hook: ``fn(*args)``, or ``None`` (logged once per GPU and ``what``)
    when NVML answers NOT_SUPPORTED or FUNCTION_NOT_FOUND; other NVML errors raise."""

    def __call__(self, index: int, what: str, fn: Callable[..., T], *args: Any) -> T | None: ...


def _fail(code: int) -> NoReturn:
    """Raise the NVML error ``code`` (to route a field slot's code through ``OptionalCall``)."""
    raise pynvml.NVMLError(code)


def field_value(slot: Any) -> float:
    """The number in one ``nvmlFieldValue_t`` slot, by its value type."""
    member = _VALUE_MEMBER.get(int(slot.valueType), "ullVal")
    return float(getattr(slot.value, member))


def _temperature(value: float | None) -> float | None:
    return None if value is None or value > MAX_TEMPERATURE_C else float(value)


class TelemetryReader:
    """Reads :class:`Telemetry` for GPUs through pynvml; keeps each GPU's last GPM sample.

    Safe for concurrent ``read`` calls on different GPUs (the backend probes each GPU on its own
    thread); ``close`` frees the GPM samples and must run before ``nvmlShutdown``.
    """

    def __init__(self, optional: OptionalCall) -> None:
        self._optional = optional
        self._gpm = GpmSampler(optional)
        self._lock = threading.Lock()
        self._memory_v1_only: set[int] = set()
        self._slot_errors: dict[tuple[int, str], int] = {}

    def read(self, index: int, handle: Any) -> Telemetry:
        """Every value NVML offers for GPU ``index`` now."""
        opt = self._optional
        temperature = opt(
            index,
            "temperature",
            pynvml.nvmlDeviceGetTemperature,
            handle,
            pynvml.NVML_TEMPERATURE_GPU,
        )
        power = opt(index, "power", pynvml.nvmlDeviceGetPowerUsage, handle)
        energy = opt(index, "energy", pynvml.nvmlDeviceGetTotalEnergyConsumption, handle)
        sm_clock = opt(
            index, "sm_clock", pynvml.nvmlDeviceGetClockInfo, handle, pynvml.NVML_CLOCK_SM
        )
        mem_clock = opt(
            index, "mem_clock", pynvml.nvmlDeviceGetClockInfo, handle, pynvml.NVML_CLOCK_MEM
        )
        util = opt(index, "utilization", pynvml.nvmlDeviceGetUtilizationRates, handle)
        enc = opt(index, "encoder_utilization", pynvml.nvmlDeviceGetEncoderUtilization, handle)
        dec = opt(index, "decoder_utilization", pynvml.nvmlDeviceGetDecoderUtilization, handle)
        used, free, reserved = self._memory(index, handle)
        fields = self._fields(index, handle)
        gpm = self._gpm.read(index, handle)
        tx, rx = fields.get("nvlink_tx"), fields.get("nvlink_rx")
        return Telemetry(
            temperature_c=_temperature(temperature),
            memory_temperature_c=_temperature(fields.get("memory_temperature")),
            power_w=None if power is None else power / 1000.0,
            energy_mj=None if energy is None else float(energy),
            sm_clock_mhz=None if sm_clock is None else float(sm_clock),
            mem_clock_mhz=None if mem_clock is None else float(mem_clock),
            gpu_util_pct=None if util is None else float(util.gpu),
            mem_util_pct=None if util is None else float(util.memory),
            enc_util_pct=None if enc is None else float(enc[0]),
            dec_util_pct=None if dec is None else float(dec[0]),
            fb_used_mib=used,
            fb_free_mib=free,
            fb_reserved_mib=reserved,
            pcie_replays=fields.get("pcie_replays"),
            nvlink_bandwidth_total=None if tx is None or rx is None else (tx + rx) / KIB_PER_MIB,
            remapped_rows_correctable=fields.get("remapped_rows_correctable"),
            remapped_rows_uncorrectable=fields.get("remapped_rows_uncorrectable"),
            row_remap_pending=fields.get("row_remap_pending"),
            row_remap_failure=fields.get("row_remap_failure"),
            ecc_sbe_volatile=fields.get("ecc_sbe_volatile"),
            ecc_dbe_volatile=fields.get("ecc_dbe_volatile"),
            **{key: fields.get(key) for key in PLAIN_FIELDS},
            **gpm,
        )

    def close(self) -> None:
        """Free every GPM sample (errors are logged); later reads start afresh."""
        self._gpm.close()

    # ----- framebuffer -------------------------------------------------------------------------
    def _memory(self, index: int, handle: Any) -> tuple[float | None, float | None, float | None]:
        """``(used, free, reserved)`` MiB: v2 where the driver has it, else v1 (no reserved)."""
        if index not in self._memory_v1_only:
            try:
                info = pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
            except pynvml.NVMLError as exc:
                if exc.value not in _ABSENT:
                    raise
                with self._lock:
                    self._memory_v1_only.add(index)
            else:
                return info.used / MIB, info.free / MIB, info.reserved / MIB
        info = self._optional(index, "memory", pynvml.nvmlDeviceGetMemoryInfo, handle)
        if info is None:
            return None, None, None
        return info.used / MIB, info.free / MIB, None

    # ----- field values ------------------------------------------------------------------------
    def _fields(self, index: int, handle: Any) -> dict[str, float | None]:
        """Every :data:`FIELDS` value in one call; a missing call or slot leaves its key absent."""
        ids = [(field_id, scope) for _, field_id, scope in FIELDS]
        slots = self._optional(index, "field_values", pynvml.nvmlDeviceGetFieldValues, handle, ids)
        if slots is None:
            return {}
        values: dict[str, float | None] = {}
        for (key, _, _), slot in zip(FIELDS, slots, strict=True):
            code = int(slot.nvmlReturn)
            if code == pynvml.NVML_SUCCESS:
                self._slot_recovered(index, key)
                values[key] = field_value(slot)
            elif code in _ABSENT:
                values[key] = self._optional(index, key, _fail, code)
            elif code == pynvml.NVML_ERROR_GPU_IS_LOST:
                _fail(code)
            else:
                self._slot_failed(index, key, code)
        return values

    def _slot_failed(self, index: int, key: str, code: int) -> None:
        with self._lock:
            changed = self._slot_errors.get((index, key)) != code
            self._slot_errors[(index, key)] = code
        if changed:
            log.warning(
                "nvml field value unreadable; left out",
                gpu=index,
                value=key,
                error=f"{pynvml.NVMLError(code)} (NVML {code})",
            )

    def _slot_recovered(self, index: int, key: str) -> None:
        if self._slot_errors:
            with self._lock:
                self._slot_errors.pop((index, key), None)


@dataclass(eq=False)
class _GpuSamples:
    """One GPU's two GPM sample buffers, used alternately; ``previous`` holds the last reading."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    buffers: list[Any] = field(default_factory=list)
    previous: int | None = None
    closed: bool = False


class GpmSampler:
    """GPM metrics (Hopper and newer) from the previous and the current sample of each GPU.

    The first read of a GPU only takes a sample (values absent); each later read takes a new one
    and reports every metric as its mean over the interval between the two. A GPU without GPM
    (``nvmlGpmQueryDeviceSupport`` missing, failing as not supported, or saying no) is asked once
    and logged once. NaN and per-metric errors leave that value absent.
    """

    def __init__(self, optional: OptionalCall) -> None:
        self._optional = optional
        self._lock = threading.Lock()
        self._supported: dict[int, bool] = {}
        self._gpus: dict[int, _GpuSamples] = {}

    def read(self, index: int, handle: Any) -> dict[str, float | None]:
        """Telemetry field -> value for the GPM metrics; empty when there is no pair yet."""
        if not self._is_supported(index, handle):
            return {}
        with self._lock:
            gpu = self._gpus.setdefault(index, _GpuSamples())
        with gpu.lock:
            if gpu.closed:
                return {}
            return self._read_locked(index, handle, gpu)

    def _is_supported(self, index: int, handle: Any) -> bool:
        known = self._supported.get(index)
        if known is not None:
            return known
        support = self._optional(index, "gpm", pynvml.nvmlGpmQueryDeviceSupport, handle)
        supported = support is not None and bool(support.isSupportedDevice)
        if support is not None and not supported:
            self._optional(index, "gpm", _fail, pynvml.NVML_ERROR_NOT_SUPPORTED)
        with self._lock:
            self._supported[index] = supported
        return supported

    def _read_locked(self, index: int, handle: Any, gpu: _GpuSamples) -> dict[str, float | None]:
        if not gpu.buffers and not self._allocate(index, gpu):
            return {}
        current = 0 if gpu.previous is None else 1 - gpu.previous
        try:
            pynvml.nvmlGpmSampleGet(handle, gpu.buffers[current])
        except pynvml.NVMLError as exc:
            gpu.previous = None  # a later sample must not pair with one from before a failure
            if exc.value not in _ABSENT:
                raise
            self._optional(index, "gpm", _fail, exc.value)
            return {}
        previous, gpu.previous = gpu.previous, current
        if previous is None:
            return {}
        request = pynvml.c_nvmlGpmMetricsGet_t()
        request.version = pynvml.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = len(GPM_METRICS)
        request.sample1 = gpu.buffers[previous]
        request.sample2 = gpu.buffers[current]
        for i, (metric_id, _, _) in enumerate(GPM_METRICS):
            request.metrics[i].metricId = metric_id
        if self._optional(index, "gpm", pynvml.nvmlGpmMetricsGet, request) is None:
            return {}
        return self._values(index, request.metrics)

    def _values(self, index: int, metrics: Sequence[Any]) -> dict[str, float | None]:
        values: dict[str, float | None] = {}
        for i, (_, name, factor) in enumerate(GPM_METRICS):
            metric = metrics[i]
            code = int(metric.nvmlReturn)
            if code != pynvml.NVML_SUCCESS:
                if code in _ABSENT:
                    self._optional(index, f"gpm_{name}", _fail, code)
                continue
            value = float(metric.value)
            if math.isfinite(value):
                values[name] = value * factor
        return values

    def _allocate(self, index: int, gpu: _GpuSamples) -> bool:
        buffers: list[Any] = []
        try:
            for _ in range(2):
                sample = self._optional(index, "gpm", pynvml.nvmlGpmSampleAlloc)
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
        for index, gpu in gpus.items():
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
            log.warning("freeing a gpm sample failed", gpu=index, error=f"{exc} (NVML {exc.value})")
