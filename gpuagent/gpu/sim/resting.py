"""A captured GPU at rest: the readings a capture recorded, which a replay holds still.

A replayed GPU reads as the captured one did (76.9 W, 345 MHz, 0 % on the real H200) instead of
the simulator's synthetic load; its energy counter grows at the captured power, and simulated
processes move its utilisation and memory as they move any simulated GPU's
(:mod:`~gpuagent.gpu.sim.processes`). Readings the capture does not hold are left ``None`` and
follow from those it does (the graphics clock is the SM clock; the video clock scales with it).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

__all__ = ["AtRest", "at_rest_from"]

_SUCCESS = 0
_CLOCK_SM = 1
_CLOCK_MEM = 2
_MEMORY_TEMP_FIELD = 82  # NVML_FI_DEV_MEMORY_TEMP


@dataclass(frozen=True)
class AtRest:
    """What one GPU read at rest, in NVML's units (``None``: not captured). ``gpm``: GPM metric
    ID -> value over the capture's longest sample pair."""

    power_mw: int | None = None
    energy_mj: int | None = None
    temperature_c: int | None = None
    memory_temperature_c: int | None = None
    sm_clock_mhz: int | None = None
    mem_clock_mhz: int | None = None
    gpu_util_pct: int | None = None
    mem_util_pct: int | None = None
    enc_util_pct: int | None = None
    dec_util_pct: int | None = None
    fb_reserved_bytes: int | None = None
    fb_used_bytes: int | None = None
    pcie_replays: int | None = None
    gpm: Mapping[int, float] = field(default_factory=lambda: MappingProxyType({}))


def at_rest_from(gpu: Mapping[str, Any]) -> AtRest | None:
    """The readings a capture's GPU entry holds; ``None`` when it holds none."""
    values = _values(gpu.get("calls"))
    memory = values.get(("nvmlDeviceGetMemoryInfo_v2", ()))
    util = values.get(("nvmlDeviceGetUtilizationRates", ()))
    rest = AtRest(
        power_mw=_int(values.get(("nvmlDeviceGetPowerUsage", ()))),
        energy_mj=_int(values.get(("nvmlDeviceGetTotalEnergyConsumption", ()))),
        temperature_c=_int(values.get(("nvmlDeviceGetTemperature", (0,)))),
        memory_temperature_c=_field(gpu.get("fields"), _MEMORY_TEMP_FIELD),
        sm_clock_mhz=_int(values.get(("nvmlDeviceGetClockInfo", (_CLOCK_SM,)))),
        mem_clock_mhz=_int(values.get(("nvmlDeviceGetClockInfo", (_CLOCK_MEM,)))),
        gpu_util_pct=_int(util.get("gpu")) if isinstance(util, Mapping) else None,
        mem_util_pct=_int(util.get("memory")) if isinstance(util, Mapping) else None,
        enc_util_pct=_first(values.get(("nvmlDeviceGetEncoderUtilization", ()))),
        dec_util_pct=_first(values.get(("nvmlDeviceGetDecoderUtilization", ()))),
        fb_reserved_bytes=_int(memory.get("reserved")) if isinstance(memory, Mapping) else None,
        fb_used_bytes=_int(memory.get("used")) if isinstance(memory, Mapping) else None,
        pcie_replays=_int(values.get(("nvmlDeviceGetPcieReplayCounter", ()))),
        gpm=MappingProxyType(_gpm(gpu.get("gpm"))),
    )
    return None if rest == AtRest() else rest


def _values(calls: object) -> dict[tuple[str, tuple[object, ...]], object]:
    """Each successful call's value, by name and arguments (the first answer of each)."""
    found: dict[tuple[str, tuple[object, ...]], object] = {}
    for record in calls if isinstance(calls, list) else []:
        if not isinstance(record, Mapping) or record.get("return") != _SUCCESS:
            continue
        name, args = record.get("call"), record.get("args")
        if isinstance(name, str) and isinstance(args, list) and all(_plain(a) for a in args):
            found.setdefault((name, tuple(args)), record.get("value"))
    return found


def _plain(value: object) -> bool:
    return isinstance(value, int | float | str)


def _int(value: object) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return None
    return value


def _first(value: object) -> int | None:
    """The utilisation of an ``[utilisation, sampling period]`` answer."""
    return _int(value[0]) if isinstance(value, list) and value else None


def _field(slots: object, field_id: int) -> int | None:
    for slot in slots if isinstance(slots, list) else []:
        if isinstance(slot, Mapping) and slot.get("field") == field_id:
            return _int(slot.get("value")) if slot.get("return") == _SUCCESS else None
    return None


def _gpm(gpm: object) -> dict[int, float]:
    """The metrics of the capture's sample pair taken furthest apart (the steadiest)."""
    pairs: Sequence[object] = gpm.get("pairs", []) if isinstance(gpm, Mapping) else []
    taken = [
        p
        for p in pairs
        if isinstance(p, Mapping) and p.get("return") == _SUCCESS and p.get("apart_ms")
    ]
    if not taken:
        return {}
    widest = max(taken, key=lambda p: p["apart_ms"])
    return {
        m["metric"]: float(m["value"])
        for m in widest.get("metrics", [])
        if isinstance(m, Mapping)
        and m.get("return") == _SUCCESS
        and isinstance(m.get("metric"), int)
        and isinstance(m.get("value"), int | float)
        and math.isfinite(m["value"])
    }
