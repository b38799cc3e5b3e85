"""The ``--sim-config`` document: a simulated node in YAML (or a capture of a real one).

Keys: ``version: v1``, ``gpus:``, ``nvlinks:``, ``driver_version:``, ``cap_sys_admin:``,
``numa_from_nvml:``, ``latency:``, ``host:`` and ``capture:`` (:mod:`~gpuagent.gpu.sim.capture`);
what the GPUs, links and driver version may be is :mod:`~gpuagent.gpu.sim.layout`'s.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType

from gpuagent.gpu.sim.capture import load_capture
from gpuagent.gpu.sim.driver import SYMBOLS
from gpuagent.gpu.sim.host import SimHost
from gpuagent.gpu.sim.layout import driver_version_from, gpus_from, nvlinks_from
from gpuagent.gpu.sim.spec import SimConfigError, SimLatency, SimNode
from gpuagent.yamlfile import YamlFileError, read_yaml

__all__ = ["load_sim_config", "node_from_mapping"]

MAX_LATENCY_MS = 60_000.0
MAX_COLD_START_MS = 600_000.0
_TOP_KEYS = frozenset(
    {
        "version",
        "gpus",
        "nvlinks",
        "driver_version",
        "cap_sys_admin",
        "numa_from_nvml",
        "latency",
        "host",
        "capture",
    }
)
_HOST_KEYS = frozenset({"product_name", "numa"})
_LATENCY_KEYS = frozenset({"default_ms", "calls", "cold_start_ms", "fields"})
#: NVML's field IDs are small numbers (nvml.h's NVML_FI_MAX is under 1,000).
MAX_FIELD_ID = 10_000


def node_from_mapping(data: object, *, base: Path | None = None) -> SimNode:
    """Parse a loaded ``--sim-config`` document.

    Keys: ``version: v1``, ``gpus:``, ``nvlinks:``, and for the driver ``driver_version:``
    (a version before 565 has no recovery-action field or event), ``cap_sys_admin:`` (default
    false), ``numa_from_nvml:`` (default false: the GPUs are not NUMA nodes, the host's sysfs
    says where they are), ``latency: {default_ms, calls: {symbol: ms}, cold_start_ms, fields:
    {id: ms}}``, ``host: {product_name, numa}`` (:class:`~gpuagent.gpu.sim.host.SimHost`) and
    ``capture: FILE`` (a capture by ``scripts/nvml-capture``, relative to ``base``, whose driver,
    GPUs, latencies and host are the defaults of the other keys). Raises
    :class:`SimConfigError` naming the dotted key of the first invalid value.
    """
    if not isinstance(data, Mapping):
        raise SimConfigError("sim-config", "must be a mapping with version, gpus and nvlinks")
    for key in data:
        if key not in _TOP_KEYS:
            known = ", ".join(sorted(_TOP_KEYS))
            raise SimConfigError(str(key), f"unknown key (known: {known})")
    if data.get("version") != "v1":
        raise SimConfigError("version", f"must be v1, got {data.get('version')!r}")
    node = _captured(data["capture"], base) if "capture" in data else SimNode(gpus=())
    gpus = node.gpus if node.gpus and "gpus" not in data else gpus_from(data.get("gpus"))
    return replace(
        node,
        gpus=gpus,
        nvlinks=nvlinks_from(data.get("nvlinks"), gpus),
        driver_version=driver_version_from(data.get("driver_version", node.driver_version)),
        cap_sys_admin=_flag(data, "cap_sys_admin", default=False),
        numa_from_nvml=_flag(data, "numa_from_nvml", default=node.numa_from_nvml),
        latency=_latency(data["latency"], node.latency) if "latency" in data else node.latency,
        host=_host(data["host"], node.host) if "host" in data else node.host,
    )


def _captured(raw: object, base: Path | None) -> SimNode:
    if not isinstance(raw, str) or not raw:
        raise SimConfigError("capture", f"must be a file name, got {raw!r}")
    path = Path(raw) if base is None or Path(raw).is_absolute() else base / raw
    return load_capture(path)


def _flag(data: Mapping[str, object], key: str, *, default: bool) -> bool:
    value = data.get(key, default)
    if not isinstance(value, bool):
        raise SimConfigError(key, f"must be true or false, got {value!r}")
    return value


def _host(value: object, base: SimHost) -> SimHost:
    """``host: {product_name, numa}``: the DMI product name (null: none) and whether the kernel
    knows the GPUs' NUMA nodes."""
    if not isinstance(value, Mapping):
        raise SimConfigError("host", "must be a mapping of product_name, numa")
    for key in value:
        if key not in _HOST_KEYS:
            known = ", ".join(sorted(_HOST_KEYS))
            raise SimConfigError(f"host.{key}", f"unknown key (known: {known})")
    name = value.get("product_name", base.product_name)
    if name is not None and (not isinstance(name, str) or "\n" in name):
        raise SimConfigError("host.product_name", f"must be one line of text or null: {name!r}")
    numa = value.get("numa", base.numa)
    if not isinstance(numa, bool):
        raise SimConfigError("host.numa", f"must be true or false, got {numa!r}")
    return SimHost(product_name=name, numa=numa)


def _milliseconds(value: object, key: str, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise SimConfigError(key, f"must be a number of milliseconds, got {value!r}")
    if not 0 <= value <= high:
        raise SimConfigError(key, f"must be from 0 to {high:g} ms, got {value}")
    return float(value) / 1000.0


def _latency(value: object, base: SimLatency) -> SimLatency:
    """``latency: {default_ms, calls: {symbol: ms}, cold_start_ms, fields: {id: ms}}`` over
    ``base``."""
    if not isinstance(value, Mapping):
        raise SimConfigError(
            "latency", "must be a mapping of default_ms, calls, cold_start_ms, fields"
        )
    for key in value:
        if key not in _LATENCY_KEYS:
            known = ", ".join(sorted(_LATENCY_KEYS))
            raise SimConfigError(f"latency.{key}", f"unknown key (known: {known})")
    default = base.default_s
    if "default_ms" in value:
        default = _milliseconds(value["default_ms"], "latency.default_ms", MAX_LATENCY_MS)
    calls = dict(base.calls)
    raw_calls = value.get("calls", {})
    if not isinstance(raw_calls, Mapping):
        raise SimConfigError("latency.calls", "must map NVML symbols to milliseconds")
    for symbol, ms in raw_calls.items():
        key = f"latency.calls.{symbol}"
        if symbol not in SYMBOLS:
            raise SimConfigError(key, "not a C symbol of the simulated driver")
        calls[symbol] = _milliseconds(ms, key, MAX_LATENCY_MS)
    cold = base.cold_start_s
    if "cold_start_ms" in value:
        cold = _milliseconds(value["cold_start_ms"], "latency.cold_start_ms", MAX_COLD_START_MS)
    return SimLatency(
        default_s=default,
        calls=MappingProxyType(calls),
        cold_start_s=cold,
        fields=_field_latency(value.get("fields", {}), base.fields),
    )


def _field_latency(value: object, base: Mapping[int, float]) -> Mapping[int, float]:
    """``latency.fields: {field_id: ms}``: what asking for a field adds to a field-values call."""
    if not isinstance(value, Mapping):
        raise SimConfigError("latency.fields", "must map NVML field IDs to milliseconds")
    fields = dict(base)
    for field_id, ms in value.items():
        key = f"latency.fields.{field_id}"
        if isinstance(field_id, bool) or not isinstance(field_id, int):
            raise SimConfigError(key, "not a field ID (a number, such as 83)")
        if not 0 < field_id < MAX_FIELD_ID:
            raise SimConfigError(key, f"field IDs are from 1 to {MAX_FIELD_ID - 1}")
        fields[field_id] = _milliseconds(ms, key, MAX_LATENCY_MS)
    return MappingProxyType(fields)


def load_sim_config(path: Path) -> SimNode:
    """Read and parse a ``--sim-config`` YAML file; unreadable or malformed → key ``sim-config``."""
    try:
        data = read_yaml(path)
    except YamlFileError as exc:
        raise SimConfigError("sim-config", str(exc)) from None
    return node_from_mapping(data, base=path.parent)
