"""The node's health as its writers see it: :func:`project` reduces a snapshot to a
:class:`NodeHealthView` (the unhealthy GPUs and MIG devices with their conditions, and the pods
holding them; the DRA claims over their share of a GPU, and the pods holding them), comparable,
so a writer acts only when it changes."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

from gpuagent.domain.attribution import Target, attributions, by_device, merged
from gpuagent.domain.devices import Condition, Gpu, NodeState, PodRef
from gpuagent.domain.pacing import NewsKey
from gpuagent.domain.shareuse import Overuse, overused

__all__ = ["DeviceRef", "Fault", "NodeHealthView", "faults_by_cause", "project"]


@dataclass(frozen=True, slots=True, order=True)
class DeviceRef:
    """A GPU, or one MIG device of it (``gpu_instance`` set)."""

    gpu: int
    uuid: str
    gpu_instance: int | None = None
    compute_instance: int | None = None
    mig_uuid: str = ""
    profile: str = ""

    def __str__(self) -> str:
        text = f"GPU {self.gpu} ({self.uuid})"
        if self.gpu_instance is None:
            return text
        return (
            f"{text} MIG {self.profile} (GPU instance {self.gpu_instance}, compute instance "
            f"{self.compute_instance}, {self.mig_uuid})"
        )


@dataclass(frozen=True, slots=True)
class Fault:
    """One unhealthy device and why (its conditions, as the health policy keeps them)."""

    device: DeviceRef
    conditions: tuple[Condition, ...]


@dataclass(frozen=True, slots=True)
class NodeHealthView:
    """What the node's health writers act on: comparable, so a writer acts only on a change."""

    gpus: int = 0
    mig_devices: int = 0
    faults: tuple[Fault, ...] = ()
    # The pods holding each unhealthy device (per the kubelet's pod-resources), sorted.
    holders: tuple[tuple[DeviceRef, tuple[PodRef, ...]], ...] = ()
    # Every GPU of the node (there is at least one) has no healthy device left.
    all_unhealthy: bool = False
    # (namespace, pod, UID) of the holders whose UID is known (from their processes' cgroups).
    pod_uids: tuple[tuple[str, str, str], ...] = ()
    # The DRA claims whose processes use more memory than their share of a GPU, with holders.
    overused: tuple[Overuse, ...] = ()

    @property
    def healthy(self) -> bool:
        return not self.faults

    def holders_of(self, device: DeviceRef) -> tuple[PodRef, ...]:
        for ref, pods in self.holders:
            if ref == device:
                return pods
        return ()


def project(
    snapshot: NodeState,
    served: Collection[str],
    claimed: Callable[[], Mapping[Target, tuple[PodRef, ...]]] | None = None,
) -> NodeHealthView | None:
    """The view of ``snapshot`` (``served``: the resources this agent serves, whose pods are
    attributed; ``claimed``: the containers holding devices through DRA claims, asked only while
    a device is unhealthy); ``None`` until the GPUs are discovered (nothing true can be said
    before)."""
    if not snapshot.discovered:
        return None
    faults: list[Fault] = []
    for gpu in sorted(snapshot.gpus, key=lambda g: g.index):
        whole = DeviceRef(gpu.index, gpu.uuid)
        if gpu.health.conditions:
            faults.append(Fault(whole, gpu.health.conditions))
        for mig in gpu.mig_devices:
            if mig.health.conditions:
                ref = DeviceRef(
                    gpu.index,
                    gpu.uuid,
                    mig.gpu_instance_id,
                    mig.compute_instance_id,
                    mig.uuid,
                    mig.profile,
                )
                faults.append(Fault(ref, mig.health.conditions))
    holders: tuple[tuple[DeviceRef, tuple[PodRef, ...]], ...] = ()
    if faults and snapshot.pods.allocated:
        held = attributions(snapshot, by_device(snapshot.pods.allocated, served))
        if claimed is not None:
            held = merged(held, claimed())
        holders = tuple(
            (fault.device, pods) for fault in faults if (pods := _held(fault.device, held))
        )
    over = overused(snapshot)
    holding = {(ref.namespace, ref.pod) for _, refs in holders for ref in refs}
    holding |= {(ref.namespace, ref.pod) for use in over for ref in use.holders}
    gpus = snapshot.gpus
    return NodeHealthView(
        gpus=len(gpus),
        mig_devices=sum(len(g.mig_devices) for g in gpus),
        faults=tuple(faults),
        holders=holders,
        all_unhealthy=bool(gpus) and all(_unusable(g) for g in gpus),
        pod_uids=tuple(u for u in snapshot.usage.pod_uids if (u[0], u[1]) in holding),
        overused=over,
    )


def faults_by_cause(view: NodeHealthView | None) -> dict[NewsKey, frozenset[DeviceRef]]:
    """What ``view`` says of each GPU's health, by GPU and cause (a condition's kind): the
    devices failing so. A key whose entry changes is a change of that GPU's health (a cause
    appeared or cleared); a cause's detail changing (the next XID's number) is not."""
    out: dict[NewsKey, set[DeviceRef]] = {}
    for fault in view.faults if view is not None else ():
        for condition in fault.conditions:
            out.setdefault((fault.device.gpu, condition.kind), set()).add(fault.device)
    return {key: frozenset(devices) for key, devices in out.items()}


def _held(device: DeviceRef, held: Mapping[Target, tuple[PodRef, ...]]) -> tuple[PodRef, ...]:
    if device.gpu_instance is not None:
        return held.get(Target(device.gpu, device.gpu_instance), ())
    # A whole GPU failing fails each of its MIG devices too.
    refs = {ref for target, pods in held.items() if target.gpu == device.gpu for ref in pods}
    return tuple(sorted(refs, key=lambda r: (r.namespace, r.pod, r.container)))


def _unusable(gpu: Gpu) -> bool:
    if not gpu.health.healthy:
        return True
    return bool(gpu.mig_devices) and all(not m.health.healthy for m in gpu.mig_devices)
