"""Deterministic, smooth telemetry for a simulated GPU as a function of time.

Each GPU follows its own sinusoid (phases spaced by the golden angle, so no two GPUs move in
step); power follows utilisation, temperature follows power, and the energy counter is the exact
integral of power, so it only ever grows.

A GPU replayed from a capture rests instead (:func:`resting`): its captured readings, held still.

Profiling (GPM) metrics are linear in the same wave, so the mean of any of them over an interval
follows exactly from the wave's integral at the interval's two ends (:attr:`Sample.activity_s`),
the way real GPM derives rates from two counter snapshots (:func:`gpm_value`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import pynvml

from gpuagent.gpu.sim.profiles import GpuProfile
from gpuagent.gpu.sim.resting import AtRest

UTIL_PERIOD_S = 240.0
MEMORY_PERIOD_S = 600.0
UPTIME_AT_START_S = 3600.0
#: One PCIe replay every this many seconds of driver uptime (a slow, realistic trickle).
PCIE_REPLAY_EVERY_S = 900.0
#: Sampling periods NVML reports with encoder/decoder utilisation (microseconds).
ENCODER_SAMPLING_US = 167_000
DECODER_SAMPLING_US = 167_000
#: NVLink data rate (TX, KiB/s) at the wave's mean; RX runs at 90 % of TX.
NVLINK_RATE_KIB = 20_000_000.0
NVLINK_RX_SHARE = 0.9
_GOLDEN_ANGLE = math.pi * (3.0 - math.sqrt(5.0))
_MIB = 1024 * 1024
_KIB_PER_MIB = 1024.0

_G = pynvml
#: GPM metric id -> (mean, amplitude) of ``mean + amplitude * wave``, in NVML's unit
#: (percent 0..100, or MiB/s for the PCIe and NVLink rates). Other ids are NOT_SUPPORTED.
GPM_MODEL: dict[int, tuple[float, float]] = {
    _G.NVML_GPM_METRIC_GRAPHICS_UTIL: (50.0, 40.0),  # follows gpu_util_pct
    _G.NVML_GPM_METRIC_SM_UTIL: (45.0, 36.0),
    _G.NVML_GPM_METRIC_SM_OCCUPANCY: (30.0, 22.0),
    _G.NVML_GPM_METRIC_INTEGER_UTIL: (8.0, 5.0),
    _G.NVML_GPM_METRIC_ANY_TENSOR_UTIL: (25.0, 20.0),
    _G.NVML_GPM_METRIC_DFMA_TENSOR_UTIL: (0.0, 0.0),
    _G.NVML_GPM_METRIC_HMMA_TENSOR_UTIL: (20.0, 16.0),
    _G.NVML_GPM_METRIC_DMMA_TENSOR_UTIL: (0.0, 0.0),
    _G.NVML_GPM_METRIC_IMMA_TENSOR_UTIL: (5.0, 4.0),
    _G.NVML_GPM_METRIC_DRAM_BW_UTIL: (30.0, 25.0),  # follows mem_util_pct
    _G.NVML_GPM_METRIC_FP64_UTIL: (1.0, 0.5),
    _G.NVML_GPM_METRIC_FP32_UTIL: (12.0, 9.0),
    _G.NVML_GPM_METRIC_FP16_UTIL: (6.0, 4.0),
    _G.NVML_GPM_METRIC_PCIE_TX_PER_SEC: (1500.0, 1000.0),
    _G.NVML_GPM_METRIC_PCIE_RX_PER_SEC: (2500.0, 2000.0),
    # The NVLink rates match the NVLINK_THROUGHPUT_DATA_* field counters' slope (KiB -> MiB).
    _G.NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC: (
        NVLINK_RATE_KIB * 0.5 / _KIB_PER_MIB,
        NVLINK_RATE_KIB * 0.4 / _KIB_PER_MIB,
    ),
    _G.NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC: (
        NVLINK_RATE_KIB * 0.5 * NVLINK_RX_SHARE / _KIB_PER_MIB,
        NVLINK_RATE_KIB * 0.4 * NVLINK_RX_SHARE / _KIB_PER_MIB,
    ),
}
#: GPM metrics that read 0 on a GPU without active NVLinks.
GPM_NVLINK_METRICS = frozenset(
    {_G.NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC, _G.NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC}
)


@dataclass(frozen=True)
class Sample:
    """Every telemetry value of one GPU at one instant, in NVML's units."""

    gpu_util_pct: int
    mem_util_pct: int
    power_mw: int
    energy_mj: int
    temperature_c: int
    memory_temperature_c: int
    graphics_clock_mhz: int
    sm_clock_mhz: int
    mem_clock_mhz: int
    video_clock_mhz: int
    fb_total_bytes: int
    fb_reserved_bytes: int
    fb_used_bytes: int
    nvlink_tx_kib: int
    nvlink_rx_kib: int
    enc_util_pct: int
    dec_util_pct: int
    pcie_replays: int
    # Seconds since the driver started, and the integral of the GPU's wave up to then (GPM).
    t_s: float
    activity_s: float
    # A GPU at rest: its GPM metrics, held still (None: they follow the wave).
    gpm: Mapping[int, float] | None = None

    @property
    def fb_free_bytes(self) -> int:
        """Memory neither reserved by the driver nor used by processes."""
        return self.fb_total_bytes - self.fb_reserved_bytes - self.fb_used_bytes


def reserved_mib(memory_mib: int) -> int:
    """Memory the driver keeps for itself (``reserved`` in ``nvmlMemory_v2_t``)."""
    return max(64, min(memory_mib // 160, 1536))


def sample(profile: GpuProfile, index: int, memory_mib: int, t: float) -> Sample:
    """The telemetry of GPU ``index`` ``t`` seconds after the driver started."""
    phase = index * _GOLDEN_ANGLE
    omega = 2.0 * math.pi / UTIL_PERIOD_S
    wave = math.sin(omega * t + phase)
    util = 0.5 + 0.4 * wave
    span = profile.power_limit_mw * 0.85 - profile.idle_power_mw
    mean_mw = profile.idle_power_mw + 0.5 * span
    swing_mw = 0.4 * span
    power = mean_mw + swing_mw * wave
    elapsed = t + UPTIME_AT_START_S
    energy = mean_mw * elapsed - (swing_mw / omega) * (
        math.cos(omega * t + phase) - math.cos(omega * -UPTIME_AT_START_S + phase)
    )
    mem_wave = math.sin(2.0 * math.pi * t / MEMORY_PERIOD_S + 1.7 * phase)
    total = memory_mib * _MIB
    reserved = reserved_mib(memory_mib) * _MIB
    used = int((total - reserved) * (0.45 + 0.3 * mem_wave))
    temperature = 32.0 + 45.0 * (power - profile.idle_power_mw) / profile.power_limit_mw
    clock_scale = 0.75 + 0.25 * util
    nvlink_rate_kib = NVLINK_RATE_KIB
    nvlink = nvlink_rate_kib * (elapsed * 0.5 - (0.4 / omega) * math.cos(omega * t + phase))
    return Sample(
        gpu_util_pct=round(util * 100),
        mem_util_pct=round((0.3 + 0.25 * wave) * 100),
        power_mw=round(power),
        energy_mj=round(energy),
        temperature_c=round(temperature),
        memory_temperature_c=round(temperature + 6.0),
        graphics_clock_mhz=round(profile.max_graphics_clock_mhz * clock_scale),
        sm_clock_mhz=round(profile.max_sm_clock_mhz * clock_scale),
        mem_clock_mhz=profile.max_mem_clock_mhz,
        video_clock_mhz=round(profile.max_video_clock_mhz * clock_scale),
        fb_total_bytes=total,
        fb_reserved_bytes=reserved,
        fb_used_bytes=used,
        nvlink_tx_kib=round(nvlink + nvlink_rate_kib * 0.4 / omega * 2),
        nvlink_rx_kib=round(nvlink * NVLINK_RX_SHARE + nvlink_rate_kib * 0.4 / omega * 2),
        enc_util_pct=round(12.0 + 10.0 * math.sin(omega * t + phase + 1.1)),
        dec_util_pct=round(20.0 + 15.0 * math.sin(omega * t + phase + 2.3)),
        pcie_replays=int((elapsed + 137.0 * index) // PCIE_REPLAY_EVERY_S),
        t_s=t,
        activity_s=-math.cos(omega * t + phase) / omega,
    )


def resting(rest: AtRest, profile: GpuProfile, memory_mib: int, t: float) -> Sample:
    """The telemetry of a GPU held at the readings ``rest`` captured, ``t`` seconds after the
    driver started: its energy counter grows at the captured power; what the capture lacks
    comes from the profile at that clock (or, for the temperatures, from the GPU's)."""

    def pick(value: int | None, otherwise: int) -> int:
        return otherwise if value is None else value

    power = pick(rest.power_mw, profile.idle_power_mw)
    sm = pick(rest.sm_clock_mhz, profile.max_sm_clock_mhz)
    temperature = pick(rest.temperature_c, 32)
    total = memory_mib * _MIB
    reserved = pick(rest.fb_reserved_bytes, reserved_mib(memory_mib) * _MIB)
    return Sample(
        gpu_util_pct=pick(rest.gpu_util_pct, 0),
        mem_util_pct=pick(rest.mem_util_pct, 0),
        power_mw=power,
        energy_mj=pick(rest.energy_mj, 0) + round(power * t),
        temperature_c=temperature,
        memory_temperature_c=pick(rest.memory_temperature_c, temperature),
        graphics_clock_mhz=sm,
        sm_clock_mhz=sm,
        mem_clock_mhz=pick(rest.mem_clock_mhz, profile.max_mem_clock_mhz),
        video_clock_mhz=round(profile.max_video_clock_mhz * sm / profile.max_sm_clock_mhz),
        fb_total_bytes=total,
        fb_reserved_bytes=min(reserved, total),
        fb_used_bytes=min(pick(rest.fb_used_bytes, 0), total - min(reserved, total)),
        nvlink_tx_kib=0,
        nvlink_rx_kib=0,
        enc_util_pct=pick(rest.enc_util_pct, 0),
        dec_util_pct=pick(rest.dec_util_pct, 0),
        pcie_replays=pick(rest.pcie_replays, 0),
        t_s=t,
        activity_s=0.0,
        gpm=rest.gpm,
    )


def gpm_rate(metric_id: int, index: int, t: float, *, nvlink: bool = True) -> float:
    """GPM metric ``metric_id`` of GPU ``index`` at the instant ``t`` (NVML's unit)."""
    mean, amplitude = GPM_MODEL[metric_id]
    if metric_id in GPM_NVLINK_METRICS and not nvlink:
        return 0.0
    omega = 2.0 * math.pi / UTIL_PERIOD_S
    return mean + amplitude * math.sin(omega * t + index * _GOLDEN_ANGLE)


def gpm_value(metric_id: int, first: Sample, second: Sample, *, nvlink: bool = True) -> float:
    """What ``nvmlGpmMetricsGet`` reports for ``metric_id`` between two samples of one GPU.

    The mean of :func:`gpm_rate` over the interval; NaN when both samples are of one instant.
    """
    mean, amplitude = GPM_MODEL[metric_id]
    if metric_id in GPM_NVLINK_METRICS and not nvlink:
        return 0.0
    interval = second.t_s - first.t_s
    if interval == 0:
        return math.nan
    if second.gpm is not None:
        return second.gpm.get(metric_id, 0.0)  # at rest: what was captured (idle: 0)
    return mean + amplitude * (second.activity_s - first.activity_s) / interval
