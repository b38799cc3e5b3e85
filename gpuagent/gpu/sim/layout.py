"""The GPUs, NVLinks and driver version of a ``--sim-config`` document, validated: each error names
the dotted key of the offending value (the document itself: :mod:`~gpuagent.gpu.sim.config`)."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import replace

from gpuagent.gpu.sim.profiles import (
    DEFAULT_PROFILE,
    MIG_COMPUTE_SLICES,
    GpuProfile,
    MigProfile,
    find_profile,
    place_mig,
)
from gpuagent.gpu.sim.spec import MAX_GPUS, SimConfigError, SimGpuSpec, gpu_spec

MAX_NUMA_NODE = 1023
MAX_MEMORY_MIB = 16 * 1024 * 1024
MAX_LINKS_PER_PAIR = 18
_GPU_KEYS = frozenset({"name", "memory_mib", "numa_node", "mig", "nvlink", "pci_class"})
_PCI_CLASS = re.compile(r"0x[0-9a-fA-F]{6}")
_MAX_CLASS = 0xFFFFFF


def _int(value: object, key: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SimConfigError(key, f"must be an integer, got {value!r}")
    if not low <= value <= high:
        raise SimConfigError(key, f"must be from {low} to {high}, got {value}")
    return value


def _mig(value: object, key: str, profile: GpuProfile) -> tuple[str, ...]:
    """Validate a MIG layout: known names, per-profile instance limits, slices and placements."""
    if not isinstance(value, list | tuple):
        raise SimConfigError(key, "must be a list of MIG profile names")
    shapes: list[MigProfile] = []
    for j, item in enumerate(value):
        shape = profile.mig_profile(item) if isinstance(item, str) else None
        if shape is None:
            known = ", ".join(profile.mig_profile_names)
            raise SimConfigError(
                f"{key}[{j}]", f"unknown MIG profile {item!r} for {profile.key} (known: {known})"
            )
        if sum(1 for s in shapes if s is shape) >= shape.max_instances:
            raise SimConfigError(
                f"{key}[{j}]",
                f"at most {shape.max_instances} {shape.name} instance(s) fit on one GPU",
            )
        shapes.append(shape)
    if sum(s.slices for s in shapes) > MIG_COMPUTE_SLICES:
        raise SimConfigError(
            key, f"the profiles need more than the GPU's {MIG_COMPUTE_SLICES} slices"
        )
    if place_mig(shapes) is None:
        names = ", ".join(s.name for s in shapes)
        raise SimConfigError(key, f"no valid placement holds {names} (memory slices overlap)")
    return tuple(s.name for s in shapes)


def _gpu_from(item: object, index: int, count: int) -> SimGpuSpec:
    key = f"gpus[{index}]"
    if item is None:
        item = {}
    if not isinstance(item, Mapping):
        raise SimConfigError(key, f"must be a mapping of {', '.join(sorted(_GPU_KEYS))}")
    for given in item:
        if given not in _GPU_KEYS:
            known = ", ".join(sorted(_GPU_KEYS))
            raise SimConfigError(f"{key}.{given}", f"unknown key (known: {known})")
    name, profile = _model(item, key)
    memory = item.get("memory_mib")
    numa = item.get("numa_node")
    spec = gpu_spec(
        index,
        count,
        profile,
        name=name,
        memory_mib=None if memory is None else _int(memory, f"{key}.memory_mib", 1, MAX_MEMORY_MIB),
        numa_node=None if numa is None else _int(numa, f"{key}.numa_node", 0, MAX_NUMA_NODE),
        mig=_mig(item.get("mig", []), f"{key}.mig", profile),
    )
    nvlink = item.get("nvlink", True)
    if not isinstance(nvlink, bool):
        raise SimConfigError(f"{key}.nvlink", f"must be true or false, got {nvlink!r}")
    pci_class = pci_class_from(item.get("pci_class", spec.pci_class), f"{key}.pci_class")
    return replace(spec, nvlink=nvlink, pci_class=pci_class)


def _model(item: Mapping[str, object], key: str) -> tuple[str | None, GpuProfile]:
    """The name NVML reports (None: the profile's) and the profile, from ``name``."""
    if "name" not in item:
        return None, DEFAULT_PROFILE
    raw = item["name"]
    if not isinstance(raw, str) or not raw.strip():
        raise SimConfigError(f"{key}.name", f"must be a non-empty string, got {raw!r}")
    found = find_profile(raw)
    return (raw.strip(), DEFAULT_PROFILE) if found is None else (None, found)


def pci_class_from(value: object, key: str) -> str:
    """A PCI class code as sysfs writes it (``0x030200``: a 3D controller); YAML reads an
    unquoted ``0x030200`` as a number, which is taken too."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _MAX_CLASS:
        value = f"0x{value:06x}"
    if not isinstance(value, str) or _PCI_CLASS.fullmatch(value) is None:
        raise SimConfigError(key, f"must be a PCI class such as 0x030200, got {value!r}")
    return value.lower()


def nvlinks_from(value: object, gpus: Sequence[SimGpuSpec]) -> tuple[tuple[int, int, int], ...]:
    if value is None:
        return ()
    if not isinstance(value, list | tuple):
        raise SimConfigError("nvlinks", "must be a list of [gpu_a, gpu_b, link_count]")
    links: list[tuple[int, int, int]] = []
    seen: set[frozenset[int]] = set()
    used = [0] * len(gpus)
    for k, item in enumerate(value):
        key = f"nvlinks[{k}]"
        if not isinstance(item, list | tuple) or len(item) != 3:
            raise SimConfigError(key, f"must be [gpu_a, gpu_b, link_count], got {item!r}")
        last = len(gpus) - 1
        a = _int(item[0], f"{key}[0]", 0, last)
        b = _int(item[1], f"{key}[1]", 0, last)
        count = _int(item[2], f"{key}[2]", 1, MAX_LINKS_PER_PAIR)
        if a == b:
            raise SimConfigError(key, f"joins GPU {a} to itself")
        if frozenset((a, b)) in seen:
            raise SimConfigError(key, f"GPUs {a} and {b} are already joined")
        seen.add(frozenset((a, b)))
        for gpu in (a, b):
            used[gpu] += count
            available = gpus[gpu].nvlink_slots
            if used[gpu] > available:
                raise SimConfigError(key, f"GPU {gpu} would need more than its {available} links")
        links.append((a, b, count))
    return tuple(links)


def gpus_from(items: object) -> tuple[SimGpuSpec, ...]:
    """The GPUs a node description lists (``gpus:``); :class:`SimConfigError` naming the key."""
    if not isinstance(items, list | tuple) or not items:
        raise SimConfigError("gpus", "must be a non-empty list of GPUs")
    if len(items) > MAX_GPUS:
        raise SimConfigError("gpus", f"at most {MAX_GPUS} GPUs, got {len(items)}")
    return tuple(_gpu_from(item, i, len(items)) for i, item in enumerate(items))


def driver_version_from(value: object) -> str:
    """A driver version (``driver_version:``), such as ``580.95.05``."""
    if not isinstance(value, str) or not value.split(".", 1)[0].isdigit():
        raise SimConfigError("driver_version", f"must be a version such as 580.95.05: {value!r}")
    return value
