"""Deterministic, smooth telemetry for a simulated GPU as a function of time.

Each GPU follows its own sinusoid (phases spaced by the golden angle, so no two GPUs move in
step); power follows utilisation, temperature follows power, and the energy counter is the exact
integral of power, so it only ever grows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gpuagent.gpu.sim.profiles import GpuProfile

UTIL_PERIOD_S = 240.0
MEMORY_PERIOD_S = 600.0
UPTIME_AT_START_S = 3600.0
_GOLDEN_ANGLE = math.pi * (3.0 - math.sqrt(5.0))
_MIB = 1024 * 1024


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
    nvlink_rate_kib = 20_000_000.0
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
        nvlink_rx_kib=round(nvlink * 0.9 + nvlink_rate_kib * 0.4 / omega * 2),
    )
