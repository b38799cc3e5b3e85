"""The extended resources a node advertises, computed from a snapshot and the sharing settings.

One :class:`Resource` per resource name, each with its devices as the kubelet sees them: the ID,
the health, the NUMA node, which GPU or MIG device it is, and its replica number when time-sliced.
The names and rules follow NVIDIA's k8s-device-plugin (``internal/rm/device_map.go``,
``internal/rm/rm.go``; time-slicing is :mod:`gpuagent.domain.timeslicing`), with one deliberate
difference: with ``mig-strategy none`` a GPU in MIG mode is not advertised as a full GPU (NVIDIA
advertises it, and a container given it sees no usable CUDA device, gpu-operator #637);
``mig_enabled_gpus_as_full`` restores NVIDIA's behaviour.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType

from gpuagent.domain.devices import Device, Gpu, IdStrategy, MigDevice, NodeState
from gpuagent.domain.errors import ResourceError, SettingError
from gpuagent.domain.naming import (
    DEFAULT_RESOURCE,
    mig_index,
    mig_resource_name,
    resource_name,
    socket_name,
)
from gpuagent.domain.sharing import MPS_KEY, MpsSharing
from gpuagent.domain.timeslicing import TimeSlicing

__all__ = [
    "MigStrategy",
    "NodeResources",
    "Resource",
    "ResourceSettings",
    "build_resources",
]

# A compute-instance profile ("1c.3g.20gb": fewer compute slices than its GPU instance).
# NVIDIA's mixed strategy only names profiles whose C == G.
_CI_PROFILE = re.compile(r"\d+c\.")


class MigStrategy(StrEnum):
    """How MIG devices are advertised (``--mig-strategy``)."""

    NONE = "none"
    SINGLE = "single"
    MIXED = "mixed"


@dataclass(frozen=True, slots=True)
class ResourceSettings:
    """What shapes the advertised resources.

    ``kubelet_ids`` is how devices are named *to the kubelet*. NVIDIA always advertises UUIDs and
    applies ``--device-id-strategy`` only to what the container receives (UUIDs stay stable when
    GPUs are renumbered, which matters for the kubelet's checkpoint).

    ``time_slicing`` and ``mps`` are the two ways of sharing (at most one of them enabled:
    :class:`~gpuagent.domain.sharing.Sharing` checks); :attr:`replication` is the one in use.
    """

    resource_name: str = DEFAULT_RESOURCE
    mig_strategy: MigStrategy = MigStrategy.NONE
    kubelet_ids: IdStrategy = IdStrategy.UUID
    time_slicing: TimeSlicing = field(default_factory=TimeSlicing)
    mig_enabled_gpus_as_full: bool = False
    mps: MpsSharing = field(default_factory=MpsSharing)

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "resource_name", resource_name(self.resource_name))
        except ValueError as exc:
            raise SettingError("resource-name", str(exc)) from None
        if self.mps.enabled and self.mig_strategy is MigStrategy.MIXED:
            raise SettingError(
                MPS_KEY,
                "cannot be combined with mig-strategy mixed: MIG devices cannot be shared "
                "through MPS (NVIDIA's plugin refuses it too)",
            )

    @property
    def domain(self) -> str:
        return self.resource_name.partition("/")[0]

    @property
    def replication(self) -> TimeSlicing:
        """The rules replicating devices: MPS's when MPS shares them, else time-slicing's."""
        return self.mps.rules if self.mps.enabled else self.time_slicing


def _frozen_devices() -> Mapping[str, Device]:
    return MappingProxyType({})


@dataclass(frozen=True, slots=True)
class Resource:
    """One extended resource: its name and devices, in GPU order.

    ``origin`` is the name before a time-slicing rename (equal to ``name`` otherwise). ``mps``:
    its replicas are shared through an MPS control daemon named after the resource. Equality
    covers the devices' IDs, health and placement, never telemetry.
    """

    name: str
    devices: tuple[Device, ...]
    origin: str = ""
    fail_requests_greater_than_one: bool = False
    mps: bool = False
    _by_id: Mapping[str, Device] = field(
        default_factory=_frozen_devices, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        if not self.origin:
            object.__setattr__(self, "origin", self.name)
        object.__setattr__(self, "_by_id", MappingProxyType({d.id: d for d in self.devices}))

    def device(self, device_id: str) -> Device | None:
        return self._by_id.get(device_id)

    @property
    def ids(self) -> tuple[str, ...]:
        return tuple(d.id for d in self.devices)

    @property
    def shared(self) -> bool:
        return any(d.is_replica for d in self.devices)

    @property
    def renamed(self) -> bool:
        return self.origin != self.name

    @property
    def socket_name(self) -> str:
        return socket_name(self.name)

    def kubelet_devices(self) -> tuple[tuple[str, str, int | None], ...]:
        """``(ID, health, NUMA node)`` per device: exactly what ListAndWatch sends."""
        return tuple((d.id, d.health, d.numa_node) for d in self.devices)


@dataclass(frozen=True, slots=True)
class NodeResources:
    """Every resource the node advertises, sorted by name, and why anything was left out."""

    resources: tuple[Resource, ...] = ()
    notes: tuple[str, ...] = ()

    def get(self, name: str) -> Resource | None:
        for resource in self.resources:
            if resource.name == name:
                return resource
        return None

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(r.name for r in self.resources)


def build_resources(
    snapshot: NodeState, settings: ResourceSettings = ResourceSettings()
) -> NodeResources:
    """The node's resources under ``settings``; raises :class:`ResourceError`.

    ``none``: full GPUs (not those in MIG mode, see the module doc). ``single``: MIG devices as
    ``resource_name`` — every GPU must be in MIG mode and every MIG device of one profile, else
    an error (NVIDIA: "all devices on the node must be configured with the same migEnabled
    value", "more than one MIG device type present on node"). ``mixed``: full GPUs as
    ``resource_name``, MIG devices as ``<domain>/mig-<profile>``; compute-instance profiles
    (C < G) are left out as NVIDIA does. A GPU in MIG mode without MIG devices is left out with
    a note rather than failing the node (NVIDIA fails).
    """
    notes: list[str] = []
    base = _base_devices(snapshot, settings, notes)
    resources = _apply_time_slicing(base, settings.replication, mps=settings.mps.enabled)
    return NodeResources(
        resources=tuple(sorted(resources, key=lambda r: r.name)), notes=tuple(notes)
    )


def _kubelet_id(uuid: str, index: str, strategy: IdStrategy) -> str:
    return uuid if strategy is IdStrategy.UUID else index


def _gpu_device(gpu: Gpu, settings: ResourceSettings) -> Device:
    index = str(gpu.index)
    return Device(
        id=_kubelet_id(gpu.uuid, index, settings.kubelet_ids),
        uuid=gpu.uuid,
        index=index,
        gpu=gpu.index,
        gpu_uuid=gpu.uuid,
        minor=gpu.minor,
        healthy=gpu.overall_health.healthy,
        reason=gpu.overall_health.reason,
        numa_node=gpu.numa_node,
        memory_mib=gpu.memory_mib,
    )


def _mig_device(gpu: Gpu, position: int, mig: MigDevice, settings: ResourceSettings) -> Device:
    index = mig_index(gpu.index, position)
    return Device(
        id=_kubelet_id(mig.uuid, index, settings.kubelet_ids),
        uuid=mig.uuid,
        index=index,
        gpu=gpu.index,
        gpu_uuid=gpu.uuid,
        minor=gpu.minor,
        healthy=gpu.health_of(mig).healthy,
        reason=gpu.health_of(mig).reason,
        numa_node=gpu.numa_node,
        mig_profile=mig.profile,
        caps=mig.device_nodes,
        memory_mib=mig.memory_mib,
    )


def _base_devices(
    snapshot: NodeState, settings: ResourceSettings, notes: list[str]
) -> dict[str, list[Device]]:
    """Unreplicated devices per resource name, GPUs in index order."""
    gpus = sorted(snapshot.gpus, key=lambda g: g.index)
    out: dict[str, list[Device]] = {}
    name = settings.resource_name
    strategy = settings.mig_strategy
    if strategy is MigStrategy.NONE:
        for gpu in gpus:
            if gpu.mig_enabled and not settings.mig_enabled_gpus_as_full:
                notes.append(
                    f"GPU {gpu.index} is in MIG mode: not advertised with mig-strategy none"
                )
                continue
            out.setdefault(name, []).append(_gpu_device(gpu, settings))
        return out

    in_mig = [g for g in gpus if g.mig_enabled]
    if strategy is MigStrategy.SINGLE and in_mig and len(in_mig) != len(gpus):
        whole = ", ".join(str(g.index) for g in gpus if not g.mig_enabled)
        raise ResourceError(
            "mig-strategy single: all devices on the node must be configured with the same "
            f"migEnabled value (GPUs {', '.join(str(g.index) for g in in_mig)} are in MIG mode, "
            f"{whole} are not)"
        )
    profiles: dict[str, list[int]] = {}
    for gpu in gpus:
        if not gpu.mig_enabled:
            out.setdefault(name, []).append(_gpu_device(gpu, settings))
            continue
        if not gpu.mig_devices:
            notes.append(f"GPU {gpu.index} is in MIG mode without MIG devices: not advertised")
            continue
        for position, mig in enumerate(gpu.mig_devices):
            if strategy is MigStrategy.SINGLE:
                target = name
            elif _CI_PROFILE.match(mig.profile):
                notes.append(
                    f"MIG device {mig_index(gpu.index, position)} has compute-instance profile "
                    f"{mig.profile}: not advertised with mig-strategy mixed"
                )
                continue
            else:
                try:
                    target = mig_resource_name(mig.profile, settings.domain)
                except ValueError as exc:
                    raise ResourceError(f"MIG profile {mig.profile!r}: {exc}") from None
            profiles.setdefault(mig.profile, []).append(gpu.index)
            out.setdefault(target, []).append(_mig_device(gpu, position, mig, settings))
    if strategy is MigStrategy.SINGLE and len(profiles) > 1:
        seen = "; ".join(
            f"{profile} on GPU {', '.join(str(i) for i in sorted(set(where)))}"
            for profile, where in sorted(profiles.items())
        )
        raise ResourceError(
            f"mig-strategy single: more than one MIG device type present on node ({seen})"
        )
    return out


def _apply_time_slicing(
    base: Mapping[str, Sequence[Device]], sharing: TimeSlicing, *, mps: bool = False
) -> list[Resource]:
    by_target: dict[str, list[Device]] = {}
    origin_of: dict[str, str] = {}
    for name, devices in base.items():
        for target, device in sharing.placements(name, devices):
            other = origin_of.setdefault(target, name)
            if other != name:
                raise ResourceError(
                    f"{target}: devices of both {other} and {name} would be advertised under it"
                )
            by_target.setdefault(target, []).append(device)
    # Every target name was checked when its rule was built, but `<name>.shared` may be too long.
    resources = []
    for target, devices in by_target.items():
        try:
            resource_name(target)
        except ValueError as exc:
            raise ResourceError(f"shared resource name: {exc}") from None
        shared = any(d.is_replica for d in devices)
        if shared and mps:
            _no_mig_through_mps(target, devices)
        resources.append(
            Resource(
                name=target,
                devices=tuple(devices),
                origin=origin_of[target],
                fail_requests_greater_than_one=shared and sharing.fail_requests_greater_than_one,
                mps=shared and mps,
            )
        )
    return resources


def _no_mig_through_mps(name: str, devices: Sequence[Device]) -> None:
    """NVIDIA: "sharing using MPS is not supported for MIG devices" (mig-strategy single)."""
    migs = sorted({d.index for d in devices if d.is_replica and d.is_mig})
    if migs:
        raise ResourceError(
            f"{MPS_KEY}: {name} would share MIG devices {', '.join(migs)} through MPS, which "
            "cannot run on MIG devices (mig-strategy single); share full GPUs, or use "
            "time-slicing"
        )
