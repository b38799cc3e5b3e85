"""The MPS daemons a node's resources need, and their devices' health while a daemon is down.

One control daemon per resource shared through MPS (NVIDIA's ``mps-control-daemon`` starts one per
shared resource with at least one device), told each GPU's default pinned memory limit (its
memory over its replicas) and the active thread percentage (100 over the replicas). A replica
may be allocated only while its daemon is up: otherwise it is unhealthy, with the daemon's
reason, so the kubelet sees it (ListAndWatch) and allocates elsewhere. Pure.
"""

from __future__ import annotations

from dataclasses import replace

from gpuagent.domain.devices import Device
from gpuagent.domain.mps import MpsDaemon, MpsGpu, MpsState, daemon_reason
from gpuagent.domain.resources import NodeResources, Resource

__all__ = ["daemon_reason", "gate_mps", "mps_daemons"]


def mps_daemons(resources: NodeResources) -> tuple[MpsDaemon, ...]:
    """The daemons ``resources`` need, by name: one per resource shared through MPS."""
    return tuple(_daemon(r) for r in resources.resources if r.mps)


def _daemon(resource: Resource) -> MpsDaemon:
    gpus: dict[int, MpsGpu] = {}
    for device in resource.devices:
        if device.is_replica and device.gpu not in gpus:
            gpus[device.gpu] = MpsGpu(
                index=device.gpu,
                uuid=device.gpu_uuid,
                memory_mib=device.memory_mib,
                replicas=device.replicas,
            )
    replicas = max((g.replicas for g in gpus.values()), default=1)
    return MpsDaemon(
        name=resource.name,
        gpus=tuple(gpus[i] for i in sorted(gpus)),
        thread_percentage=100 // replicas,
    )


def gate_mps(
    resources: NodeResources, state: MpsState, daemons: tuple[MpsDaemon, ...] | None = None
) -> NodeResources:
    """``resources`` with the replicas of each daemon that is not up as planned made unhealthy
    (``daemons``: :func:`mps_daemons` of ``resources``, when known already)."""
    if not any(r.mps for r in resources.resources):
        return resources
    planned = {d.name: d for d in (mps_daemons(resources) if daemons is None else daemons)}
    gated = []
    for resource in resources.resources:
        reason = daemon_reason(planned[resource.name], state) if resource.mps else None
        if reason is None:
            gated.append(resource)
            continue
        devices = tuple(_unhealthy(d, reason) for d in resource.devices)
        gated.append(replace(resource, devices=devices))
    return replace(resources, resources=tuple(gated))


def _unhealthy(device: Device, reason: str) -> Device:
    if not device.is_replica:
        return device
    if not device.healthy:
        return replace(device, reason=f"{device.reason}; {reason}")
    return replace(device, healthy=False, reason=reason)
