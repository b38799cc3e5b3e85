"""Dynamic Resource Allocation: which GPUs DRA serves, and the devices this node publishes for it.

A GPU is served by exactly one API: the device plugin (``nvidia.com/gpu``) or DRA
(``resource.k8s.io/v1``), chosen by ``--dra-gpus`` (:class:`DraGpus`). The DRA side publishes one
device per GPU, or per MIG device of a GPU in MIG mode under a MIG strategy, in ResourceSlices
whose pool is the node (:func:`gpuagent.domain.slices.slice_manifests`). With ``--dra-mig
dynamic`` (:class:`DraMig`) a GPU whose driver offers MIG shapes is published partitionable
instead: a counter set, every shape at every placement, and the whole GPU
(:mod:`gpuagent.domain.dynmig`); its MIG devices are made when a claim is prepared.

Names and attributes are those of NVIDIA's DRA driver (driver ``gpu.nvidia.com``; attributes
``type``, ``uuid``, ``productName``, ``architecture``, ``cudaComputeCapability``,
``driverVersion``, ``cudaDriverVersion``, ``parentUUID``, ``profile``, the standard
``resource.kubernetes.io/pciBusID`` and ``resource.kubernetes.io/numaNode``; capacity ``memory``
in bytes), so its DeviceClasses and claims select our devices unchanged. A GPU the health policy
marks bad is tainted: ``NoSchedule``, or ``NoExecute`` where the GPU needs a reset.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum, StrEnum
from types import MappingProxyType

from gpuagent.domain.apivalues import Version, dns_label, label_value, pci_bus_id, semver
from gpuagent.domain.devices import Condition, Gpu, GpuHealth, MigDevice, NodeState
from gpuagent.domain.drashare import DraSharing
from gpuagent.domain.dynmig import CounterSet, Partition, instance_at, partitions
from gpuagent.domain.errors import SettingError
from gpuagent.domain.health import LOST, RECOVERY, ROW_REMAP_PENDING, XID
from gpuagent.domain.migshapes import MigShape, Placement
from gpuagent.domain.resources import MigStrategy

__all__ = [
    "DEFAULT_DRIVER",
    "DraDevice",
    "DraGpus",
    "DraMig",
    "DraPlan",
    "Effect",
    "Taint",
    "dra_devices",
    "unpublished_gpus",
]

DEFAULT_DRIVER = "gpu.nvidia.com"
PCI_BUS_ID = "resource.kubernetes.io/pciBusID"
NUMA_NODE = "resource.kubernetes.io/numaNode"
MAX_TAINTS = 4
MAX_STRING = 64  # an attribute's string or version value

_INDEX = re.compile(r"\d+")
# Recovery actions after which the GPU must be reset (or the node rebooted) before it is usable.
_RESET_ACTIONS = frozenset(
    {"gpu_reset", "node_reboot", "drain_and_reset", "bus_reset", "system_reboot"}
)
_RESET_CONDITIONS = frozenset({LOST, ROW_REMAP_PENDING})
# NVML's architecture names as NVIDIA's DRA driver spells them.
_ARCHITECTURES = {
    "kepler": "Kepler",
    "maxwell": "Maxwell",
    "pascal": "Pascal",
    "volta": "Volta",
    "turing": "Turing",
    "ampere": "Ampere",
    "ada": "Ada Lovelace",
    "ada lovelace": "Ada Lovelace",
    "ada-lovelace": "Ada Lovelace",
    "hopper": "Hopper",
    "blackwell": "Blackwell",
    "rubin": "Rubin",
}


@dataclass(frozen=True, slots=True)
class DraGpus:
    """``--dra-gpus``: ``none`` (the default: every GPU to the device plugin), ``all``, or a
    list of GPU indexes and UUIDs. A GPU in the list leaves the device plugin's resources."""

    all: bool = False
    refs: frozenset[str] = frozenset()

    @classmethod
    def parse(cls, value: str) -> DraGpus:
        """Parse the setting; raises :class:`SettingError` naming ``dra-gpus``."""
        text = value.strip()
        if text.lower() == "none" or not text:
            return cls()
        if text.lower() == "all":
            return cls(all=True)
        refs = [part.strip() for part in text.split(",")]
        for ref in refs:
            if not (_INDEX.fullmatch(ref) or (ref.startswith("GPU-") and len(ref) > 4)):
                raise SettingError(
                    "dra-gpus", f"{ref!r} is not none, all, a GPU index or a GPU-… UUID"
                )
        twice = sorted({r for r in refs if refs.count(r) > 1})
        if twice:
            raise SettingError("dra-gpus", f"listed more than once: {', '.join(twice)}")
        return cls(refs=frozenset(refs))

    @property
    def enabled(self) -> bool:
        return self.all or bool(self.refs)

    def owns(self, gpu: Gpu) -> bool:
        """Whether DRA serves ``gpu`` (and the device plugin does not)."""
        return self.all or str(gpu.index) in self.refs or gpu.uuid in self.refs

    def absent(self, gpus: Sequence[Gpu], count: int) -> tuple[str, ...]:
        """The listed GPUs the node certainly does not have, of its ``count`` GPUs (the driver's
        count) as far as ``gpus`` describe them: an index past the count, or a UUID none of them
        has once every GPU's UUID is known (a GPU not described yet may still have it)."""
        every_uuid_known = len({g.index for g in gpus if g.uuid}) >= count
        uuids = {g.uuid for g in gpus}

        def absent(ref: str) -> bool:
            if ref.isdigit():
                return int(ref) >= count
            return every_uuid_known and ref not in uuids

        return tuple(sorted(filter(absent, self.refs), key=_ref_order))

    def decided(self, gpus: Sequence[Gpu], count: int) -> bool:
        """Whether :meth:`absent` is final: every listed UUID found, or every GPU's UUID known."""
        uuids = {g.uuid for g in gpus}
        known = len({g.index for g in gpus if g.uuid}) >= count
        return known or all(ref.isdigit() or ref in uuids for ref in self.refs)

    def __str__(self) -> str:
        if self.all:
            return "all"
        return ",".join(sorted(self.refs, key=_ref_order)) or "none"


def _ref_order(ref: str) -> tuple[bool, int, str]:
    """Indexes first, in number order, then UUIDs."""
    return (not ref.isdigit(), len(ref), ref)


class DraMig(StrEnum):
    """``--dra-mig``: MIG as it is on the node (``static``: the MIG strategy decides), or made on
    demand when a claim is prepared (``dynamic``)."""

    STATIC = "static"
    DYNAMIC = "dynamic"


class Effect(Enum):
    """What a device taint does to claims that do not tolerate it."""

    NO_SCHEDULE = "NoSchedule"
    NO_EXECUTE = "NoExecute"


@dataclass(frozen=True, slots=True)
class Taint:
    """A device taint: key ``<driver>/<condition>``, the condition's detail as value."""

    key: str
    value: str
    effect: Effect


@dataclass(frozen=True, slots=True)
class DraDevice:
    """One device of the node's pool, as published and as prepared.

    ``uuid`` names the GPU or MIG device (and its CDI device); ``gpu_uuid`` the physical GPU.
    ``attributes`` map a name to a typed value: ``str``, ``int``, ``bool`` or :class:`Version`.

    A partitionable device (``--dra-mig dynamic``) carries its GPU's ``counter_set`` (published
    once per pool), the counters it ``consumes`` from it and its other ``capacity``; a MIG device
    that is made when prepared has its ``shape`` and ``placement``, and no ``uuid``. A
    ``shared`` device (``--dra-sharing mps``: a whole GPU) may be allocated to many claims, each
    consuming part of its memory and compute (:mod:`gpuagent.domain.drashare`).
    """

    name: str
    uuid: str
    gpu_uuid: str
    gpu_index: int
    kind: str  # "gpu" or "mig"
    attributes: Mapping[str, str | int | bool | Version] = field(hash=False)
    memory_bytes: int = 0
    taints: tuple[Taint, ...] = ()
    healthy: bool = True
    reason: str = ""
    capacity: Mapping[str, int] = field(default_factory=lambda: _NONE, hash=False)
    counter_set: CounterSet | None = None
    consumes: Mapping[str, int] = field(default_factory=lambda: _NONE, hash=False)
    shape: MigShape | None = None
    placement: Placement | None = None
    shared: bool = False

    @property
    def made_on_prepare(self) -> bool:
        """A MIG device that exists only once a claim is prepared (``--dra-mig dynamic``)."""
        return self.shape is not None and self.placement is not None


_NONE: Mapping[str, int] = MappingProxyType({})


def taints(health: GpuHealth, driver: str) -> tuple[Taint, ...]:
    """The taints of a device on a GPU with ``health`` (none while healthy).

    One per condition (a cause), at most four (the API's limit: those that need a reset first,
    then by key), each ``NoExecute`` when the GPU needs a reset (lost, a pending row remap, a
    reset-type recovery action), else ``NoSchedule``. A taint stays the same while its cause
    holds: the XID's number is not its value (the next XID on a GPU already failing changes
    nothing in the slice; the condition, the events and /metrics name it), the other details
    are fixed while their condition holds, or (the recovery action) are the remedy.
    """
    out: list[Taint] = []
    for condition in sorted(health.conditions, key=_taint_order)[:MAX_TAINTS]:
        effect = Effect.NO_EXECUTE if _needs_reset(condition) else Effect.NO_SCHEDULE
        key = f"{driver}/{dns_label(condition.kind.replace('_', '-'))}"
        value = "" if condition.kind == XID else label_value(condition.detail)
        out.append(Taint(key=key, value=value, effect=effect))
    return tuple(out)


def _taint_order(condition: Condition) -> tuple[bool, str]:
    return (not _needs_reset(condition), condition.kind)


def _needs_reset(condition: Condition) -> bool:
    if condition.kind in _RESET_CONDITIONS:
        return True
    return condition.kind == RECOVERY and condition.detail in _RESET_ACTIONS


def _architecture(gpu: Gpu) -> str:
    name = gpu.architecture.strip()
    return _ARCHITECTURES.get(name.lower(), name)


def _common_attributes(
    gpu: Gpu, driver_version: str, cuda_version: str
) -> dict[str, str | int | bool | Version]:
    attrs: dict[str, str | int | bool | Version] = {}
    if gpu.name:
        attrs["productName"] = gpu.name[:MAX_STRING]
    architecture = _architecture(gpu)
    if architecture:
        attrs["architecture"] = architecture[:MAX_STRING]
    for name, raw in (
        ("cudaComputeCapability", gpu.compute_capability),
        ("driverVersion", driver_version),
        ("cudaDriverVersion", cuda_version),
    ):
        version = semver(raw) if raw else None
        if version is not None:
            attrs[name] = version
    bus = pci_bus_id(gpu.pci_bus_id)
    if bus is not None:
        attrs[PCI_BUS_ID] = bus
    if gpu.numa_node is not None:
        attrs[NUMA_NODE] = gpu.numa_node
    return attrs


def gpu_device_name(gpu: Gpu) -> str:
    """A whole GPU's device name: ``gpu-<minor>``, NVIDIA's."""
    return f"gpu-{gpu.minor}"


def _gpu_device(gpu: Gpu, driver: str, driver_version: str, cuda_version: str) -> DraDevice:
    attrs: dict[str, str | int | bool | Version] = {
        "type": "gpu",
        "uuid": gpu.uuid,
        "index": gpu.index,
        "minor": gpu.minor,
    }
    attrs.update(_common_attributes(gpu, driver_version, cuda_version))
    return DraDevice(
        name=gpu_device_name(gpu),
        uuid=gpu.uuid,
        gpu_uuid=gpu.uuid,
        gpu_index=gpu.index,
        kind="gpu",
        attributes=attrs,
        memory_bytes=gpu.memory_mib * 1024 * 1024,
        taints=taints(gpu.health, driver),
        healthy=gpu.health.healthy,
        reason=gpu.health.reason,
    )


def _mig_device(
    gpu: Gpu, mig: MigDevice, driver: str, driver_version: str, cuda_version: str
) -> DraDevice:
    """Its GPU's device (the GPU's taints and health) with its own name, UUID and attributes."""
    attrs: dict[str, str | int | bool | Version] = {
        "type": "mig",
        "uuid": mig.uuid,
        "parentUUID": gpu.uuid,
        "profile": mig.profile[:MAX_STRING],
        "index": gpu.index,
        "minor": gpu.minor,
    }
    attrs.update(_common_attributes(gpu, driver_version, cuda_version))
    profile = dns_label(mig.profile.replace(".", "").replace("+", "-"))
    return replace(
        _gpu_device(gpu, driver, driver_version, cuda_version),
        name=dns_label(
            f"gpu-{gpu.minor}-mig-{profile}-{mig.gpu_instance_id}-{mig.compute_instance_id}"
        ),
        uuid=mig.uuid,
        kind="mig",
        attributes=attrs,
        memory_bytes=mig.memory_mib * 1024 * 1024,
    )


def _partitioned(
    gpu: Gpu,
    counters: CounterSet,
    offered: tuple[Partition, ...],
    driver: str,
    versions: tuple[str, str],
) -> list[DraDevice]:
    """A partitionable GPU's devices: the whole GPU (if offered) and every shape at every
    placement; a placement where an instance was made has that instance's health."""
    out: list[DraDevice] = []
    whole = _gpu_device(gpu, driver, *versions)
    for part in offered:
        if part.shape is None or part.placement is None:
            out.append(
                replace(whole, capacity=part.capacity, counter_set=counters, consumes=part.consumes)
            )
            continue
        made = instance_at(gpu, part.shape, part.placement)
        health = gpu.health if made is None else gpu.health_of(made)
        attrs: dict[str, str | int | bool | Version] = {
            "type": "mig",
            "parentUUID": gpu.uuid,
            "profile": part.shape.name[:MAX_STRING],
            "index": gpu.index,
            "minor": gpu.minor,
        }
        attrs.update(_common_attributes(gpu, *versions))
        out.append(
            replace(
                whole,
                name=part.name,
                uuid="",
                kind="mig",
                attributes=attrs,
                memory_bytes=part.shape.memory_mib * 1024 * 1024,
                taints=taints(health, driver),
                healthy=health.healthy,
                reason=health.reason,
                capacity=part.capacity,
                counter_set=counters,
                consumes=part.consumes,
                shape=part.shape,
                placement=part.placement,
            )
        )
    return out


def dra_devices(
    snapshot: NodeState,
    owned: DraGpus,
    *,
    driver: str = DEFAULT_DRIVER,
    mig_strategy: MigStrategy = MigStrategy.NONE,
    mig: DraMig = DraMig.STATIC,
) -> tuple[DraDevice, ...]:
    """The DRA devices of the GPUs ``owned`` by DRA, in GPU index order.

    A GPU in MIG mode is published as its MIG devices under the ``single`` and ``mixed``
    strategies, and not at all under ``none`` (as the device plugin treats it); a GPU in MIG
    mode with no MIG devices publishes nothing. Under ``mig`` dynamic, a GPU whose MIG shapes
    are known is published partitionable instead (:func:`gpuagent.domain.dynmig.partitions`).
    """
    out: list[DraDevice] = []
    version = snapshot.driver.version
    cuda = snapshot.driver.cuda_version
    cuda_version = f"{cuda[0]}.{cuda[1]}" if cuda is not None else ""
    for gpu in sorted(snapshot.gpus, key=lambda g: g.index):
        if not owned.owns(gpu):
            continue
        offered = partitions(gpu) if mig is DraMig.DYNAMIC else None
        if offered is not None:
            out.extend(_partitioned(gpu, *offered, driver, (version, cuda_version)))
        elif not gpu.mig_enabled:
            out.append(_gpu_device(gpu, driver, version, cuda_version))
        elif mig_strategy is not MigStrategy.NONE:
            out.extend(_mig_device(gpu, m, driver, version, cuda_version) for m in gpu.mig_devices)
    return tuple(out)


@dataclass(frozen=True, slots=True)
class DraPlan:
    """What the DRA side serves: which GPUs, under which driver name, MIG strategy, whether MIG
    is made on demand, and whether whole GPUs are shared (served as
    :func:`gpuagent.domain.drasharing.served_devices` says)."""

    gpus: DraGpus = field(default_factory=DraGpus)
    driver: str = DEFAULT_DRIVER
    mig_strategy: MigStrategy = MigStrategy.NONE
    mig: DraMig = DraMig.STATIC
    sharing: DraSharing = DraSharing.NONE

    def devices(self, snapshot: NodeState) -> tuple[DraDevice, ...]:
        return dra_devices(
            snapshot,
            self.gpus,
            driver=self.driver,
            mig_strategy=self.mig_strategy,
            mig=self.mig,
        )


def unpublished_gpus(
    current: Iterable[DraDevice], published: Collection[str] | None
) -> tuple[int, ...]:
    """The GPUs (indexes) with a device in ``current`` whose name ``published`` (the devices of
    the node's ResourceSlices as last written; ``None``: never) lacks: given to DRA, so the
    device plugin leaves them out, yet not in a slice — offered through neither API."""
    names = published or ()
    return tuple(sorted({d.gpu_index for d in current if d.name not in names}))


def devices_by_name(devices: Iterable[DraDevice]) -> dict[str, DraDevice]:
    return {d.name: d for d in devices}
