"""ResourceSlices: the node's DRA devices (:mod:`gpuagent.domain.dra`) as the API server keeps
them, ``resource.k8s.io/v1`` manifests whose pool is the node, split at the API's limit.

Partitionable devices (``--dra-mig dynamic``) are published as Kubernetes 1.35 and later require
them: their GPUs' counter sets in slices of their own (a slice holds devices or shared counters,
never both; at most :data:`MAX_COUNTER_SETS_PER_SLICE` sets each), first, then the devices.
Shared GPUs (``--dra-sharing mps``) are published with ``allowMultipleAllocations`` and their
consumable capacities' request policies (KEP-5075, :mod:`gpuagent.domain.drashare`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from gpuagent.domain.apivalues import Version
from gpuagent.domain.dra import DraDevice
from gpuagent.domain.drashare import COMPUTE, COMPUTE_POLICY, MEMORY, RequestPolicy, memory_policy
from gpuagent.domain.dynmig import CounterSet
from gpuagent.domain.pacing import NewsKey

__all__ = [
    "API_VERSION",
    "MAX_COUNTER_SETS_PER_SLICE",
    "MAX_DEVICES_PER_SLICE",
    "slice_manifests",
    "slice_name",
    "taints_by_cause",
]

API_VERSION = "resource.k8s.io/v1"
# The API's limit for a slice whose devices carry taints or consume counters (128 without).
MAX_DEVICES_PER_SLICE = 64
# The API's limit on counter sets in one slice (1.35 and later).
MAX_COUNTER_SETS_PER_SLICE = 8


def slice_name(node: str, driver: str, index: int) -> str:
    """The name of the node's ``index``-th slice: ``<node>-<driver>-<index>`` (a DNS subdomain),
    shortened with a hash when the node's name is long."""
    name = f"{node}-{driver}-{index}"
    if len(name) <= 253:
        return name
    digest = hashlib.sha256(f"{node}/{driver}".encode()).hexdigest()[:12]
    return f"{node[:200].rstrip('.-')}-{digest}-{index}"


def slice_manifests(
    devices: Sequence[DraDevice],
    *,
    node: str,
    node_uid: str,
    driver: str,
    generation: int,
) -> list[dict[str, Any]]:
    """The node's ResourceSlices (``resource.k8s.io/v1``) for ``devices`` at ``generation``.

    Pool = node; owner = the Node (so the slices go when the Node does); at most
    :data:`MAX_DEVICES_PER_SLICE` devices each, after the slices of the devices' counter sets
    (each named once, in the order the devices name them). A node without devices publishes
    one empty slice, so the scheduler knows the pool exists and is empty.
    """
    sets = list({d.counter_set.name: d.counter_set for d in devices if d.counter_set}.values())
    shared = [
        {"sharedCounters": [_counter_set(c) for c in sets[i : i + MAX_COUNTER_SETS_PER_SLICE]]}
        for i in range(0, len(sets), MAX_COUNTER_SETS_PER_SLICE)
    ]
    chunks: list[dict[str, Any]] = [
        {"devices": [_device_manifest(d) for d in devices[i : i + MAX_DEVICES_PER_SLICE]]}
        for i in range(0, len(devices), MAX_DEVICES_PER_SLICE)
    ]
    contents = shared + chunks or [{"devices": []}]
    owner = {"apiVersion": "v1", "kind": "Node", "name": node, "uid": node_uid, "controller": True}
    return [
        {
            "apiVersion": API_VERSION,
            "kind": "ResourceSlice",
            "metadata": {
                "name": slice_name(node, driver, index),
                "labels": {"app.kubernetes.io/managed-by": "gpuagent"},
                "ownerReferences": [owner],
            },
            "spec": {
                "driver": driver,
                "nodeName": node,
                "pool": {
                    "name": node,
                    "generation": generation,
                    "resourceSliceCount": len(contents),
                },
                **content,
            },
        }
        for index, content in enumerate(contents)
    ]


def taints_by_cause(devices: Iterable[DraDevice]) -> dict[NewsKey, frozenset[tuple[str, ...]]]:
    """What the slices say of each GPU's health, by GPU and taint key (a cause): the devices
    tainted so, with the taint's value and effect. A key whose entry changes is a change of that
    GPU's health (a cause appeared, cleared or changed its remedy); nothing else in a slice is."""
    out: dict[NewsKey, set[tuple[str, ...]]] = {}
    for device in devices:
        for taint in device.taints:
            entry = (device.name, taint.value, taint.effect.value)
            out.setdefault((device.gpu_index, taint.key), set()).add(entry)
    return {key: frozenset(entries) for key, entries in out.items()}


def _counter_set(counters: CounterSet) -> dict[str, Any]:
    return {"name": counters.name, "counters": _counters(counters.counters)}


def _counters(values: Mapping[str, int]) -> dict[str, Any]:
    return {
        name: {"value": _quantity(v) if name == "memory" else str(v)} for name, v in values.items()
    }


def _device_manifest(device: DraDevice) -> dict[str, Any]:
    capacity = {name: {"value": str(value)} for name, value in device.capacity.items()}
    out: dict[str, Any] = {
        "name": device.name,
        "attributes": {name: _attribute(value) for name, value in device.attributes.items()},
        "capacity": {**capacity, MEMORY: {"value": _quantity(device.memory_bytes)}},
    }
    if device.shared:
        out["allowMultipleAllocations"] = True
        out["capacity"] = {
            **capacity,
            MEMORY: _consumable(device.memory_bytes, memory_policy(device.memory_bytes), _quantity),
            COMPUTE: _consumable(COMPUTE_POLICY.max, COMPUTE_POLICY, str),
        }
    if device.counter_set is not None and device.consumes:
        out["consumesCounters"] = [
            {"counterSet": device.counter_set.name, "counters": _counters(device.consumes)}
        ]
    if device.taints:
        out["taints"] = [
            {"key": t.key, "effect": t.effect.value, **({"value": t.value} if t.value else {})}
            for t in device.taints
        ]
    return out


def _consumable(value: int, policy: RequestPolicy, unit: Callable[[int], str]) -> dict[str, Any]:
    """A consumable capacity of ``value`` with its request policy, in ``unit``'s quantities."""
    valid = {"min": unit(policy.min), "max": unit(policy.max), "step": unit(policy.step)}
    return {
        "value": unit(value),
        "requestPolicy": {"default": unit(policy.default), "validRange": valid},
    }


def _attribute(value: str | int | bool | Version) -> dict[str, Any]:
    if isinstance(value, Version):
        return {"version": value.text}
    if isinstance(value, bool):
        return {"bool": value}
    if isinstance(value, int):
        return {"int": value}
    return {"string": value}


def _quantity(size: int) -> str:
    """Bytes as a Kubernetes quantity in binary units (``81559Mi``)."""
    for suffix, unit in (("Ti", 1 << 40), ("Gi", 1 << 30), ("Mi", 1 << 20), ("Ki", 1 << 10)):
        if size and size % unit == 0:
            return f"{size // unit}{suffix}"
    return str(size)
