"""Which containers hold the node's DRA devices, from the kubelet's pod-resources ``List``.

Since Kubernetes 1.34 (``KubeletPodResourcesDynamicResources``, beta) ``List`` also names, per
container, the devices of its ResourceClaims: driver, pool and device name. The pod-resources
client keeps each such device in ``Attribution.allocated`` as an :class:`Allocated` under
:func:`claimed_resource` (``dra:`` and the driver's name: no extended resource name has a colon,
so the device plugin's attribution never takes them for its own), the device name its one ID.
:func:`dra_holders` resolves this agent's driver's devices to GPUs and MIG GPU instances, as the
DRA side publishes them (whole GPUs, MIG devices, and MIG devices made on demand, which hold
their instance only once it is made).
"""

from __future__ import annotations

from collections.abc import Iterable

from gpuagent.domain.attribution import Target, merged
from gpuagent.domain.devices import DRA_CLAIMED, Gpu, NodeState, PodRef, claimed_resource
from gpuagent.domain.dra import DraDevice, DraPlan
from gpuagent.domain.dynmig import instance_at

__all__ = ["DRA_CLAIMED", "claimed_resource", "dra_holders"]


def dra_holders(snapshot: NodeState, plan: DraPlan) -> dict[Target, tuple[PodRef, ...]]:
    """Containers per device of ``snapshot`` that hold it through a ResourceClaim of ``plan``'s
    driver (empty when no container does, at no cost)."""
    resource = claimed_resource(plan.driver)
    claims = [a for a in snapshot.pods.allocated if a.resource == resource]
    if not claims:
        return {}
    gpus = {gpu.index: gpu for gpu in snapshot.gpus}
    targets = dict(_targets(plan.devices(snapshot), gpus))
    found: dict[Target, set[PodRef]] = {}
    for item in claims:
        ref = PodRef(item.namespace, item.pod, item.container)
        for name in item.device_ids:
            target = targets.get(name)
            if target is not None:
                found.setdefault(target, set()).add(ref)
    return merged({target: tuple(refs) for target, refs in found.items()})


def _targets(devices: Iterable[DraDevice], gpus: dict[int, Gpu]) -> Iterable[tuple[str, Target]]:
    for device in devices:
        gpu = gpus.get(device.gpu_index)
        if gpu is None:
            continue
        if device.kind == "gpu":
            yield device.name, Target(gpu.index)
        elif device.uuid:  # a MIG device that exists (static MIG)
            made = next((m for m in gpu.mig_devices if m.uuid == device.uuid), None)
            if made is not None:
                yield device.name, Target(gpu.index, made.gpu_instance_id)
        elif device.shape is not None and device.placement is not None:  # made on demand
            made = instance_at(gpu, device.shape, device.placement)
            if made is not None:
                yield device.name, Target(gpu.index, made.gpu_instance_id)
