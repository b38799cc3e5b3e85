"""One GPU's telemetry through NVML, in dcgm-exporter's units (the backend's probe reads it).

Per GPU and poll cycle (on a GPU that offers everything, after the first cycle) this makes 11 NVML
calls: ``nvmlDeviceGetTemperature``, ``nvmlDeviceGetPowerUsage``, ``nvmlDeviceGetClockInfo``
(SM, memory), ``nvmlDeviceGetUtilizationRates``, ``nvmlDeviceGetEncoderUtilization``,
``nvmlDeviceGetDecoderUtilization``, ``nvmlDeviceGetMemoryInfo_v2`` (v1 where v2 is missing),
ONE ``nvmlDeviceGetFieldValues`` for every field-based value (:data:`FIELDS`, the driver's
recovery action included; the throttling times among them only when due, below), and on Hopper
and newer ``nvmlGpmSampleGet`` + ``nvmlGpmMetricsGet``;
and once in :data:`~gpuagent.gpu.cadence.ENERGY`'s period ``nvmlDeviceGetTotalEnergyConsumption``
(3.2 ms on a real H200: between reads the energy figure advances by the power read each poll,
:class:`~gpuagent.gpu.cadence.EnergyCounter`). Where the driver does not offer a field value that
has a call of its own, that call reads it instead (:data:`FALLBACKS`: row remapping through
``nvmlDeviceGetRemappedRows``, PCIe replays and volatile ECC totals every poll, so e.g. a failed
remap never goes unseen). The throttling times are read once in
:data:`~gpuagent.gpu.cadence.VIOLATIONS`'s period, as fields in that poll's batch or by their
call, their last values served between: on the real H200 they cost ~0.5 ms a slot in the batch
or 0.6 ms a call. On a MIG-enabled GPU each MIG device's framebuffer is
read through its own handle, and GPM per GPU instance (``nvmlGpmMigSampleGet``), as DCGM serves
them (:meth:`TelemetryReader.read_instances`).

What the field values do not carry, on purpose: the energy counter (its field,
``NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION``, costs the same 3.2 ms as the call: in the batch it would
cost every poll what the cadence saves) and the power draw (``nvmlDeviceGetPowerUsage`` is what
DCGM reports; 0.002 ms). Every other reading with a field id is in the one call.

Units:

- temperatures °C (readings above :data:`MAX_TEMPERATURE_C` are sensor errors and dropped, as DCGM
  does); power W (NVML: mW); energy mJ since the driver loaded (the counter as read, advanced by
  the power between reads); clocks MHz; ``*_util_pct`` percent;
  framebuffer in **whole** MiB, rounded down, as DCGM reports it (``fb_used_mib`` excludes the
  driver's reservation when v2 reports it separately; with v1 it includes it and
  ``fb_reserved_mib`` is absent).
- NVLink: the reading carries the raw counter, KiB moved over all NVLinks, TX + RX data payload
  (NVML's ``NVLINK_THROUGHPUT_DATA_TX``/``_RX`` with ``scopeId = UINT_MAX``: :attr:`Reading.
  nvlink_kib`); the poller turns two readings into ``nvlink_bandwidth_total``, DCGM's rate.
- GPM ratios 0..1 (NVML: percent, divided by 100); ``pcie_tx_bytes``/``pcie_rx_bytes`` in
  **bytes/s** (NVML reports MiB/s; times 1048576); each is the mean over the interval between two
  samples at least :data:`~gpuagent.gpu.gpm.GPM_MIN_INTERVAL_S` apart (:mod:`~gpuagent.gpu.gpm`).

Errors never make a GPU unhealthy here: a value that a call or a field slot fails to deliver is
``None`` (absent from /metrics), counted and logged once per GPU and call by
:class:`~gpuagent.gpu.calls.NvmlCalls`. Only a lost GPU (``GPU_IS_LOST``, from a call or a slot)
raises, as :class:`pynvml.NVMLError_GpuIsLost`, for the probe to report.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pynvml
import structlog

from gpuagent.domain.devices import Telemetry
from gpuagent.gpu.cadence import ENERGY, VIOLATIONS, Cadence, EnergyCounter
from gpuagent.gpu.calls import ABSENT, NvmlCalls
from gpuagent.gpu.gpm import GpmSampler

log = structlog.get_logger("gpuagent.nvml")

MIB = 1024 * 1024
KIB_PER_MIB = 1024
#: DCGM drops temperature readings above this as sensor errors.
MAX_TEMPERATURE_C = 200
#: ``nvmlFieldValue_t.scopeId`` for "all NVLinks together".
ALL_LINKS = 0xFFFF_FFFF

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
    ("recovery_action", pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION, 0),
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
_REMAP_KEYS = (
    "remapped_rows_correctable",
    "remapped_rows_uncorrectable",
    "row_remap_pending",
    "row_remap_failure",
)
#: Field values read into the Telemetry field of the same name.
_SAME_NAME = ("pcie_replays", *_REMAP_KEYS, "ecc_sbe_volatile", "ecc_dbe_volatile", *PLAIN_FIELDS)
#: The throttling times: read once in a cadence's period, by field or by a call of their own
#: (0.6 ms each on the real H200); as fields they are in the batch only then: the H200's
#: field-values call took 1.4 ms with them (the agent's, mean of 63 polls), 0.46 ms for 30 slots
#: without (the capture's).
_VIOLATION_KEYS = frozenset({"power_violation_ns", "thermal_violation_ns"})
_EVERY_POLL_FIELDS = tuple(f for f in FIELDS if f[0] not in _VIOLATION_KEYS)


def _ecc_total(kind: int) -> Callable[[Any], float]:
    def read(handle: Any) -> float:
        return float(pynvml.nvmlDeviceGetTotalEccErrors(handle, kind, pynvml.NVML_VOLATILE_ECC))

    read.__name__ = "nvmlDeviceGetTotalEccErrors"
    return read


def _violation_ns(policy: int) -> Callable[[Any], float]:
    def read(handle: Any) -> float:
        return float(pynvml.nvmlDeviceGetViolationStatus(handle, policy).violationTime)

    read.__name__ = "nvmlDeviceGetViolationStatus"
    return read


#: Field values with a call of their own, read by it where the field value is missing.
FALLBACKS: tuple[tuple[str, Callable[[Any], float]], ...] = (
    ("pcie_replays", pynvml.nvmlDeviceGetPcieReplayCounter),
    ("ecc_sbe_volatile", _ecc_total(pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED)),
    ("ecc_dbe_volatile", _ecc_total(pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED)),
    ("power_violation_ns", _violation_ns(pynvml.NVML_PERF_POLICY_POWER)),
    ("thermal_violation_ns", _violation_ns(pynvml.NVML_PERF_POLICY_THERMAL)),
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


@dataclass(frozen=True, slots=True)
class Reading:
    """One probe's readings of a GPU: its telemetry and the driver's recovery action.

    ``recovery_action`` is ``None`` when the driver has no such field (before R565) or it could
    not be read. ``nvlink_kib`` is the NVLink data counter (TX + RX, all links, KiB since the
    driver loaded) and ``taken_at`` when it was read (the reader's clock), for the poller's rate.
    """

    telemetry: Telemetry
    recovery_action: int | None = None
    nvlink_kib: float | None = None
    taken_at: float = 0.0


@dataclass(slots=True)
class _Costly:
    """One GPU's costly readings: the energy figure, the throttling times as last read (their
    call stands in for missing field values), and the cadence windows they were last read in."""

    energy: EnergyCounter = field(default_factory=EnergyCounter)
    energy_window: int | None = None
    violations: dict[str, float | None] = field(default_factory=dict)
    violations_window: int | None = None


def field_value(slot: Any) -> float:
    """The number in one ``nvmlFieldValue_t`` slot, by its value type."""
    member = _VALUE_MEMBER.get(int(slot.valueType), "ullVal")
    return float(getattr(slot.value, member))


def read_fields(
    calls: NvmlCalls, index: int, handle: Any, fields: Sequence[tuple[str, int, int]]
) -> dict[str, float]:
    """``fields`` in one ``nvmlDeviceGetFieldValues`` call: key -> value for the slots that read.

    A slot the driver does not offer or fails to read is left out (logged once, failures
    counted); a slot reporting a lost GPU raises :class:`pynvml.NVMLError_GpuIsLost`.
    """
    ids = [(field_id, scope) for _, field_id, scope in fields]
    slots = calls.reading(index, pynvml.nvmlDeviceGetFieldValues, handle, ids)
    if slots is None:
        return {}
    values: dict[str, float] = {}
    for (key, _, _), slot in zip(fields, slots, strict=True):
        code = int(slot.nvmlReturn)
        if code == pynvml.NVML_SUCCESS:
            values[key] = field_value(slot)
        elif code == pynvml.NVML_ERROR_GPU_IS_LOST:
            raise pynvml.NVMLError(code)
        else:
            calls.slot(index, key, code)
    return values


def _mib(value: int) -> float:
    """Bytes as whole MiB, rounded down (DCGM's framebuffer figures)."""
    return float(int(value) // MIB)


def _temperature(value: float | None) -> float | None:
    return None if value is None or value > MAX_TEMPERATURE_C else float(value)


class TelemetryReader:
    """Reads :class:`Telemetry` for GPUs through pynvml; keeps each GPU's last GPM sample, its
    energy figure and when its costly readings were last taken (:mod:`~gpuagent.gpu.cadence`).

    Safe for concurrent ``read`` calls on different GPUs (the backend probes each GPU on its own
    thread); ``close`` frees the GPM samples and must run before ``nvmlShutdown``. ``clock``
    spaces GPM samples and the costly readings (the driver's clock: monotonic seconds).
    ``energy`` and ``violations``: how often those are read (a period of 0: every poll).
    """

    def __init__(
        self,
        calls: NvmlCalls,
        clock: Callable[[], float] = time.monotonic,
        *,
        energy: Cadence = ENERGY,
        violations: Cadence = VIOLATIONS,
    ) -> None:
        self._calls = calls
        self._clock = clock
        self._energy_cadence = energy
        self._violation_cadence = violations
        self._gpm = GpmSampler(calls, clock)
        self._lock = threading.Lock()
        self._memory_v1_only: set[int] = set()
        self._costly: dict[int, _Costly] = {}

    def read(self, index: int, handle: Any) -> Reading:
        """Every value NVML offers for GPU ``index`` now (the costly ones when due)."""
        now = self._clock()
        r = self._calls.reading
        temperature = r(index, pynvml.nvmlDeviceGetTemperature, handle, pynvml.NVML_TEMPERATURE_GPU)
        power = r(index, pynvml.nvmlDeviceGetPowerUsage, handle)
        power_w = None if power is None else power / 1000.0
        energy = self._energy(index, handle, power_w, now)
        sm_clock = r(index, pynvml.nvmlDeviceGetClockInfo, handle, pynvml.NVML_CLOCK_SM)
        mem_clock = r(index, pynvml.nvmlDeviceGetClockInfo, handle, pynvml.NVML_CLOCK_MEM)
        util = r(index, pynvml.nvmlDeviceGetUtilizationRates, handle)
        enc = r(index, pynvml.nvmlDeviceGetEncoderUtilization, handle)
        dec = r(index, pynvml.nvmlDeviceGetDecoderUtilization, handle)
        used, free, reserved = self._memory(index, handle)
        fields = self._fields(index, handle, now)
        taken_at = self._clock()
        gpm = self._gpm.read(index, handle)
        tx, rx = fields.get("nvlink_tx"), fields.get("nvlink_rx")
        action = fields.get("recovery_action")
        telemetry = Telemetry(
            temperature_c=_temperature(temperature),
            memory_temperature_c=_temperature(fields.get("memory_temperature")),
            power_w=power_w,
            energy_mj=energy,
            sm_clock_mhz=None if sm_clock is None else float(sm_clock),
            mem_clock_mhz=None if mem_clock is None else float(mem_clock),
            gpu_util_pct=None if util is None else float(util.gpu),
            mem_util_pct=None if util is None else float(util.memory),
            enc_util_pct=None if enc is None else float(enc[0]),
            dec_util_pct=None if dec is None else float(dec[0]),
            fb_used_mib=used,
            fb_free_mib=free,
            fb_reserved_mib=reserved,
            **{key: fields.get(key) for key in _SAME_NAME},
            **gpm,
        )
        return Reading(
            telemetry,
            None if action is None else int(action),
            nvlink_kib=None if tx is None or rx is None else tx + rx,
            taken_at=taken_at,
        )

    # ----- the field values, and the calls that stand in for missing ones -----------------------
    def _fields(self, index: int, handle: Any, now: float) -> dict[str, float]:
        """The one field-values call, and where a slot is missing the call of its own: every poll
        for the health-relevant ones (row remapping, ECC) and PCIe replays; the throttling times
        (their fields, or their call) when due, their last values in between."""
        costly = self._costly_of(index)
        due = self._violation_cadence.due(index, now, costly.violations_window)
        fields = read_fields(self._calls, index, handle, FIELDS if due else _EVERY_POLL_FIELDS)
        if any(key not in fields for key in _REMAP_KEYS):
            fields.update(self._remapped_rows(index, handle))
        for key, call in FALLBACKS:
            if key in fields:
                continue
            if key in _VIOLATION_KEYS and not due:
                last = costly.violations.get(key)
                if last is not None:
                    fields[key] = last
                continue
            value = self._calls.reading(index, call, handle)
            if value is not None:
                fields[key] = float(value)
        if due:
            costly.violations = {key: fields.get(key) for key in _VIOLATION_KEYS}
            costly.violations_window = self._window(self._violation_cadence, index, now)
        return fields

    # ----- energy ------------------------------------------------------------------------------
    def _energy(self, index: int, handle: Any, power_w: float | None, now: float) -> float | None:
        """The energy figure (mJ): the driver's counter when due (or when the power cannot carry
        the figure forward: not read, or swinging), else the last figure advanced by the power
        since."""
        costly = self._costly_of(index)
        if not self._energy_cadence.due(index, now, costly.energy_window):
            estimate = costly.energy.advance(power_w, now)
            if estimate is not None or costly.energy.counted_mj is None:
                return estimate  # None: the counter could not be read in this period
        costly.energy_window = self._window(self._energy_cadence, index, now)
        counter = self._calls.reading(index, pynvml.nvmlDeviceGetTotalEnergyConsumption, handle)
        if counter is None:
            return None
        return costly.energy.read(float(counter), power_w, now)

    def _costly_of(self, index: int) -> _Costly:
        costly = self._costly.get(index)
        if costly is None:
            with self._lock:
                costly = self._costly.setdefault(index, _Costly())
        return costly

    @staticmethod
    def _window(cadence: Cadence, index: int, now: float) -> int | None:
        return None if cadence.period_s <= 0 else cadence.window(index, now)

    def read_instances(
        self, index: int, handle: Any, migs: Sequence[tuple[str, int, Any]]
    ) -> dict[str, Telemetry]:
        """Each MIG device's own readings (``migs``: UUID, GPU-instance ID, handle).

        Its framebuffer through its own handle, and the profiling ratios of its GPU instance
        (``nvmlGpmMigSampleGet`` on the parent's handle; compute instances of one GPU instance
        share them). Errors leave values absent, as for a GPU; a lost GPU raises.
        """
        gpm: dict[int, Mapping[str, float]] = {}
        found = {}
        for uuid, gi, mig in migs:
            if gi not in gpm:
                gpm[gi] = self._gpm.read(index, handle, instance=gi)
            used, free, reserved = self._memory(index, mig, name_suffix=":mig")
            found[uuid] = Telemetry(
                fb_used_mib=used, fb_free_mib=free, fb_reserved_mib=reserved, **gpm[gi]
            )
        return found

    def close(self) -> None:
        """Free every GPM sample (errors are logged); later reads start afresh (the energy
        counter and the throttling times read again at once)."""
        self._gpm.close()
        with self._lock:
            self._costly = {}

    # ----- framebuffer -------------------------------------------------------------------------
    def _memory(
        self, index: int, handle: Any, *, name_suffix: str = ""
    ) -> tuple[float | None, float | None, float | None]:
        """``(used, free, reserved)`` whole MiB: v2 where the driver has it, else v1 (no reserved).

        ``name_suffix`` tells a MIG device's reads from the GPU's in counts and logs.
        """
        v2 = f"nvmlDeviceGetMemoryInfo_v2{name_suffix}"
        if index not in self._memory_v1_only:
            try:
                info = self._calls.call(
                    index, pynvml.nvmlDeviceGetMemoryInfo, handle, pynvml.nvmlMemory_v2, name=v2
                )
            except pynvml.NVMLError as exc:
                if exc.value == pynvml.NVML_ERROR_GPU_IS_LOST:
                    raise
                if exc.value not in ABSENT:
                    self._calls.failed(index, v2, exc.value)
                    return None, None, None
                self._calls.absent(index, v2, exc.value)
                with self._lock:
                    self._memory_v1_only.add(index)
            else:
                return _mib(info.used), _mib(info.free), _mib(info.reserved)
        info = self._calls.reading(
            index,
            pynvml.nvmlDeviceGetMemoryInfo,
            handle,
            name=f"nvmlDeviceGetMemoryInfo{name_suffix}",
        )
        if info is None:
            return None, None, None
        return _mib(info.used), _mib(info.free), None

    def _remapped_rows(self, index: int, handle: Any) -> dict[str, float]:
        """The row-remapping state from ``nvmlDeviceGetRemappedRows`` (no field values for it)."""
        rows = self._calls.reading(index, pynvml.nvmlDeviceGetRemappedRows, handle)
        if rows is None:
            return {}
        return dict(zip(_REMAP_KEYS, (float(v) for v in rows), strict=True))
