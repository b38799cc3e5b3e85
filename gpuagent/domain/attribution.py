"""Pod attribution: which GPU or MIG device each kubelet device ID names, as pure functions.

The kubelet's pod-resources ``List`` reports, per container, the device IDs a device plugin
handed out. Those IDs come in several spellings, depending on the plugin and its options:

* a GPU UUID (``GPU-…``) or, with ``--device-id-strategy index``, a GPU index (``"3"``);
* a MIG device UUID (``MIG-…``) or a MIG index ``<gpu>:<n>`` (the n-th MIG device of GPU ``gpu``);
* any of those with a replica suffix ``::<n>`` (time-slicing replicas; EKS appends it to MIG IDs);
* GKE's ``nvidia<minor>``, ``nvidia<minor>/gi<id>`` and ``…/vgpu<n>`` forms.

:func:`by_device` keeps the resources this agent serves (the plan says which) and
:func:`attributions` resolves their IDs against a snapshot's devices. Nothing here performs I/O.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from operator import attrgetter
from types import MappingProxyType

from gpuagent.domain.devices import Allocated, Gpu, NodeState, PodRef

__all__ = [
    "MIG_RESOURCE_PREFIX",
    "Allocated",
    "DeviceIndex",
    "Target",
    "attributable",
    "attributions",
    "base_id",
    "by_device",
    "merged",
]

MIG_RESOURCE_PREFIX = "nvidia.com/mig-"

_REPLICA_RE = re.compile(r"^(.+)::\d+$")
_GKE_VGPU_RE = re.compile(r"^(.+)/vgpu\d+$")


@dataclass(frozen=True, slots=True, order=True)
class Target:
    """A metric series' device: a full GPU (``gpu_instance`` None) or one MIG GPU instance."""

    gpu: int
    gpu_instance: int | None = None


def attributable(resource: str, served: Collection[str]) -> bool:
    """Whether devices of ``resource`` are ours to attribute: a served resource, or a MIG one
    (``<domain>/mig-…``) of ``nvidia.com`` or of a served resource's domain."""
    if resource in served or resource.startswith(MIG_RESOURCE_PREFIX):
        return True
    domain, _, name = resource.partition("/")
    return name.startswith("mig-") and any(s.partition("/")[0] == domain for s in served)


def base_id(device_id: str) -> str:
    """The device ID without a replica suffix (``GPU-x::3`` → ``GPU-x``) or GKE ``/vgpuN``."""
    if "::" not in device_id and "/vgpu" not in device_id:
        return device_id  # neither pattern can match: most IDs, at no regex's cost
    match = _REPLICA_RE.match(device_id)
    if match is not None:
        device_id = match.group(1)
    match = _GKE_VGPU_RE.match(device_id)
    if match is not None:
        device_id = match.group(1)
    return device_id


def by_device(
    allocations: Iterable[Allocated], served: Collection[str]
) -> Mapping[str, tuple[PodRef, ...]]:
    """Containers per kubelet device ID (as listed, replica suffix kept), for served resources.

    The result is deterministic: containers are sorted and duplicates dropped.
    """
    found: dict[str, set[PodRef]] = {}
    ours: dict[str, bool] = {}  # per resource name: a node has a handful, listed ~400 times
    for item in allocations:
        resource = item.resource
        mine = ours.get(resource)
        if mine is None:
            mine = ours[resource] = attributable(resource, served)
        if not mine:
            continue
        ref = PodRef(item.namespace, item.pod, item.container)
        for device_id in item.device_ids:
            if device_id:
                found.setdefault(device_id, set()).add(ref)
    return MappingProxyType({device_id: _sorted(refs) for device_id, refs in sorted(found.items())})


class DeviceIndex:
    """Every spelling of every device of a snapshot, mapped to its :class:`Target`."""

    __slots__ = ("_ids",)

    def __init__(self, gpus: Iterable[Gpu]) -> None:
        ids: dict[str, Target] = {}
        for gpu in gpus:
            whole = Target(gpu.index)
            ids[gpu.uuid] = whole
            ids[str(gpu.index)] = whole
            ids[f"nvidia{gpu.minor}"] = whole
            for position, mig in enumerate(gpu.mig_devices):
                target = Target(gpu.index, mig.gpu_instance_id)
                ids.setdefault(mig.uuid, target)
                if mig.uuid.startswith("MIG-"):
                    ids.setdefault(mig.uuid[len("MIG-") :], target)
                ids.setdefault(f"{gpu.index}:{position}", target)
                ids.setdefault(f"nvidia{gpu.minor}/gi{mig.gpu_instance_id}", target)
        self._ids = ids

    def resolve(self, device_id: str) -> Target | None:
        """The device a kubelet device ID names, or ``None`` when it is not one of ours."""
        return self._ids.get(device_id) or self._ids.get(base_id(device_id))


def attributions(
    snapshot: NodeState, mapping: Mapping[str, tuple[PodRef, ...]]
) -> dict[Target, tuple[PodRef, ...]]:
    """Containers per device of ``snapshot``, from a :func:`by_device` mapping of its pods.

    A device shared by several containers (replicas) lists each once, sorted; IDs that name no
    device of this snapshot are ignored.
    """
    if not mapping:
        return {}
    index = DeviceIndex(snapshot.gpus)
    found: dict[Target, set[PodRef]] = {}
    for device_id, refs in mapping.items():
        target = index.resolve(device_id)
        if target is not None:
            found.setdefault(target, set()).update(refs)
    return {target: _sorted(refs) for target, refs in found.items()}


_POD_ORDER = attrgetter("namespace", "pod", "container")


def merged(
    *maps: Mapping[Target, tuple[PodRef, ...]],
) -> dict[Target, tuple[PodRef, ...]]:
    """The containers per device of every map (one map's devices through the device plugin,
    another's through DRA claims), each device's sorted and without duplicates."""
    found: dict[Target, set[PodRef]] = {}
    for holders in maps:
        for target, refs in holders.items():
            found.setdefault(target, set()).update(refs)
    return {target: _sorted(refs) for target, refs in found.items()}


def _sorted(refs: Collection[PodRef]) -> tuple[PodRef, ...]:
    """``refs`` without duplicates, by namespace, pod and container."""
    if len(refs) == 1:
        return tuple(refs)
    return tuple(sorted(set(refs), key=_POD_ORDER))
