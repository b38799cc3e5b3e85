"""A capture of a real (or simulated) node, taken by ``scripts/nvml-capture``, as a simulated node.

``capture: FILE`` in ``--sim-config`` loads one: the driver's version, the GPUs (model, memory,
NUMA node, MIG layout), how long each call took once warm, what the first call on each GPU cost
while it was cold, which calls and field values the driver did not offer, and which event types
the GPUs supported. A capture from a real machine so becomes a CI fixture: where the built-in
profile differs from it, tests say so.

The format (``"format": "gpuagent-nvml-capture/1"``) is written by ``scripts/nvml-capture``;
see that script for every key. Only what maps onto the simulator's model is read here.
"""

from __future__ import annotations

import json
import re
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pynvml

from gpuagent.gpu.sim.driver import SYMBOLS
from gpuagent.gpu.sim.host import SimHost
from gpuagent.gpu.sim.layout import driver_version_from, gpus_from, pci_class_from
from gpuagent.gpu.sim.resting import at_rest_from
from gpuagent.gpu.sim.spec import (
    CUDA_DRIVER_VERSION,
    DEFAULT_CALL_LATENCY_S,
    DEFAULT_FIELD_LATENCY_S,
    DEFAULT_LATENCY_S,
    SimConfigError,
    SimGpuSpec,
    SimLatency,
    SimNode,
)

FORMAT = "gpuagent-nvml-capture/1"
_BUS_ID = re.compile(r"[0-9A-Fa-f]{8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7]")
_ABSENT = (int(pynvml.NVML_ERROR_NOT_SUPPORTED), int(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND))
FIELD_VALUES = "nvmlDeviceGetFieldValues"


def load_capture(path: Path) -> SimNode:
    """The simulated node a capture file describes; :class:`SimConfigError` (key ``capture``)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise SimConfigError("capture", f"cannot read {path}: {exc}") from exc
    return node_from_capture(data)


def node_from_capture(data: object) -> SimNode:
    """The simulated node a loaded capture describes."""
    if not isinstance(data, Mapping) or data.get("format") != FORMAT:
        raise SimConfigError("capture", f"not a capture (format {FORMAT!r} expected)")
    driver = _mapping(data.get("driver"), "capture.driver")
    gpus = data.get("gpus")
    if not isinstance(gpus, list) or not gpus:
        raise SimConfigError("capture.gpus", "must list the captured GPUs")
    captured = [_mapping(g, f"capture.gpus[{i}]") for i, g in enumerate(gpus)]
    specs = tuple(
        _as_captured(spec, gpu)
        for spec, gpu in zip(gpus_from([_gpu_config(g) for g in captured]), captured, strict=True)
    )
    driver_version = driver_version_from(str(driver.get("version", "")))
    cuda = driver.get("cuda_version")
    symbols = _symbols()
    calls = [c for g in gpus for c in _records(g)] + _records(data.get("system", {}))
    return SimNode(
        gpus=specs,
        driver_version=driver_version,
        cuda_driver_version=int(cuda)
        if isinstance(cuda, int) and cuda > 0
        else CUDA_DRIVER_VERSION,
        latency=_latency(
            [*calls, *_gpm_records(gpus)], symbols, _field_costs(gpus), _asked_fields(gpus)
        ),
        absent_calls=frozenset(
            symbol
            for name in _always_absent(calls)
            if (symbol := _symbol(name, symbols)) is not None
        ),
        absent_fields=_absent_fields(gpus),
        supported_events=_events(gpus),
        numa_from_nvml=any(_numa(g.get("numa_node")) is not None for g in captured),
        host=_host(data.get("host"), captured),
    )


def _mapping(value: object, key: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise SimConfigError(key, "must be a mapping")
    return value


def _numa(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _gpu_config(gpu: Mapping[str, Any]) -> dict[str, object]:
    config: dict[str, object] = {}
    if isinstance(gpu.get("name"), str) and gpu["name"]:
        config["name"] = gpu["name"]
    memory = gpu.get("memory_mib")
    if isinstance(memory, int) and memory > 0:
        config["memory_mib"] = memory
    numa = _numa(gpu.get("numa_node"))  # NVML's; else the host's (newer captures)
    numa = _numa(gpu.get("sysfs_numa_node")) if numa is None else numa
    if numa is not None:
        config["numa_node"] = numa
    mig = gpu.get("mig")
    devices = mig.get("devices") if isinstance(mig, Mapping) else None
    if isinstance(devices, list) and devices and isinstance(memory, int) and memory > 0:
        config["mig"] = [_profile(d, memory) for d in devices if isinstance(d, Mapping)]
    return config


def _as_captured(spec: SimGpuSpec, gpu: Mapping[str, Any]) -> SimGpuSpec:
    """``spec`` with what the capture says of the GPU: its readings at rest, UUID and PCI
    address (so a replay reads as the captured node), its PCI class (newer captures) and
    whether the driver showed any NVLink (the first link's state NOT_SUPPORTED: none)."""
    uuid, bus_id, pci_class = gpu.get("uuid"), gpu.get("pci_bus_id"), gpu.get("pci_class")
    links = gpu.get("nvlinks")
    first = links[0] if isinstance(links, list) and links else None
    no_nvlink = isinstance(first, Mapping) and first.get("return") in _ABSENT
    if not isinstance(uuid, str) or not uuid.startswith("GPU-"):
        uuid = spec.uuid
    if not isinstance(bus_id, str) or _BUS_ID.fullmatch(bus_id) is None:
        bus_id = spec.pci_bus_id
    if pci_class is not None:
        pci_class = pci_class_from(pci_class, f"capture.gpus[{spec.index}].pci_class")
    return replace(
        spec,
        at_rest=at_rest_from(gpu),
        uuid=uuid,
        pci_bus_id=bus_id.upper(),
        pci_class=pci_class or spec.pci_class,
        nvlink=spec.nvlink and not no_nvlink,
    )


def _host(host: object, gpus: Sequence[Mapping[str, Any]]) -> SimHost:
    """The host's facts GFD and the agent read (newer captures; an older one's are the
    defaults): the DMI product name (null: the file is absent) and the GPUs' sysfs NUMA nodes
    (all -1: the kernel knows none)."""
    name = host.get("dmi_product_name") if isinstance(host, Mapping) else None
    sysfs = [n for g in gpus if isinstance(n := g.get("sysfs_numa_node"), int)]
    return SimHost(
        product_name=name.strip() if isinstance(name, str) else None,
        numa=not sysfs or any(n >= 0 for n in sysfs),
    )


def _profile(device: Mapping[str, Any], gpu_memory_mib: int) -> str:
    """NVIDIA's name of a captured MIG device's profile (the agent's naming rule)."""
    from gpuagent.gpu.mig import mig_profile_name  # noqa: PLC0415 (pynvml-free use)

    return mig_profile_name(
        int(device.get("gpu_slices") or 0),
        int(device.get("compute_slices") or 0),
        int(device.get("memory_mib") or 0),
        gpu_memory_mib * 1024 * 1024,
    )


def _records(holder: object) -> list[Mapping[str, Any]]:
    if not isinstance(holder, Mapping):
        return []
    calls = holder.get("calls")
    return [c for c in calls if isinstance(c, Mapping)] if isinstance(calls, list) else []


def _symbols() -> frozenset[str]:
    return frozenset(SYMBOLS)


def _symbol(name: str, symbols: frozenset[str]) -> str | None:
    """The simulated C symbol behind a pynvml function name (``…_v2``, ``…_v3`` tried)."""
    for candidate in (name, f"{name}_v2", f"{name}_v3"):
        if candidate in symbols:
            return candidate
    return None


def _gpm_records(gpus: Sequence[object]) -> list[Mapping[str, Any]]:
    """``nvmlGpmMetricsGet``'s latency from the GPM pairs (samples taken apart, not at once)."""
    found: list[Mapping[str, Any]] = []
    for gpu in gpus:
        gpm = gpu.get("gpm") if isinstance(gpu, Mapping) else None
        pairs = gpm.get("pairs") if isinstance(gpm, Mapping) else None
        for pair in pairs if isinstance(pairs, list) else []:
            if isinstance(pair, Mapping) and pair.get("apart_ms") and pair.get("return") == 0:
                found.append({"call": "nvmlGpmMetricsGet", "warm_ms": pair.get("ms")})
    return found


def _field_costs(gpus: Sequence[object]) -> dict[int, float]:
    """What asking for a field adds to a field-values call (``field_costs``, newer captures):
    the warm latency of a call for that field alone, less the cheapest such call's (the call's
    own cost)."""
    costs: dict[int, list[float]] = {}
    for gpu in gpus:
        entries = gpu.get("field_costs") if isinstance(gpu, Mapping) else None
        for entry in entries if isinstance(entries, list) else []:
            if not isinstance(entry, Mapping):
                continue
            field, ms = entry.get("field"), entry.get("warm_ms")
            if isinstance(field, int) and isinstance(ms, int | float) and ms >= 0:
                costs.setdefault(field, []).append(float(ms) / 1000.0)
    medians = {field: statistics.median(values) for field, values in costs.items()}
    base = min(medians.values(), default=0.0)
    return {field: seconds - base for field, seconds in medians.items()}


def _asked_fields(gpus: Sequence[object]) -> set[int]:
    """The field IDs of the capture's field-values call (what its latency was measured for)."""
    return {
        slot["field"]
        for gpu in gpus
        if isinstance(gpu, Mapping) and isinstance(gpu.get("fields"), list)
        for slot in gpu["fields"]
        if isinstance(slot, Mapping) and isinstance(slot.get("field"), int)
    }


def _latency(
    calls: Sequence[Mapping[str, Any]],
    symbols: frozenset[str],
    fields: Mapping[int, float],
    asked: set[int],
) -> SimLatency:
    """Each call's median warm latency; a field-values call's less what its fields explain
    (their measured costs are added back for the fields each call asks for)."""
    warm: dict[str, list[float]] = {}
    cold_extra = 0.0
    for record in calls:
        name = record.get("call")
        symbol = _symbol(name, symbols) if isinstance(name, str) else None
        warm_ms, cold_ms = record.get("warm_ms"), record.get("cold_ms")
        if symbol is None or not isinstance(warm_ms, int | float):
            continue
        warm.setdefault(symbol, []).append(float(warm_ms) / 1000.0)
        if name == "nvmlDeviceGetHandleByIndex" and isinstance(cold_ms, int | float):
            cold_extra = max(cold_extra, (float(cold_ms) - float(warm_ms)) / 1000.0)
    per_call = dict(DEFAULT_CALL_LATENCY_S)
    per_call.update({symbol: statistics.median(values) for symbol, values in warm.items()})
    default = statistics.median(per_call.values()) if warm else DEFAULT_LATENCY_S
    if fields and FIELD_VALUES in warm:
        explained = sum(fields.get(f, 0.0) for f in asked)
        per_call[FIELD_VALUES] = max(0.0, per_call[FIELD_VALUES] - explained)
    return SimLatency(
        default_s=default,
        calls=MappingProxyType(per_call),
        cold_start_s=max(0.0, cold_extra),
        fields=MappingProxyType({**DEFAULT_FIELD_LATENCY_S, **fields}),
    )


def _always_absent(calls: Sequence[Mapping[str, Any]]) -> set[str]:
    """Calls that answered NOT_SUPPORTED or FUNCTION_NOT_FOUND every time they were made."""
    outcomes: dict[str, set[bool]] = {}
    for record in calls:
        name, code = record.get("call"), record.get("return")
        if isinstance(name, str) and isinstance(code, int):
            outcomes.setdefault(name, set()).add(code in _ABSENT)
    return {name for name, seen in outcomes.items() if seen == {True}}


def _absent_fields(gpus: Sequence[object]) -> frozenset[int]:
    seen: dict[int, set[bool]] = {}
    for gpu in gpus:
        fields = gpu.get("fields") if isinstance(gpu, Mapping) else None
        for slot in fields if isinstance(fields, list) else []:
            if isinstance(slot, Mapping) and isinstance(slot.get("field"), int):
                code = slot.get("return")
                seen.setdefault(slot["field"], set()).add(code in _ABSENT)
    return frozenset(field for field, absent in seen.items() if absent == {True})


def _events(gpus: Sequence[object]) -> int | None:
    first = gpus[0] if gpus else None
    events = first.get("events") if isinstance(first, Mapping) else None
    supported = events.get("supported") if isinstance(events, Mapping) else None
    return supported if isinstance(supported, int) and supported >= 0 else None
