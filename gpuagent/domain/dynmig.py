"""MIG made on demand (``--dra-mig dynamic``): what a GPU served through DRA offers as
partitionable devices (KEP-4815), as NVIDIA's DRA driver publishes them ("DynamicMIG").

Per GPU whose driver offers MIG shapes (:class:`~gpuagent.domain.migshapes.MigPartitions`):

* one counter set, ``gpu-<minor>-counter-set``, holding the most of each capacity any shape
  has — ``multiprocessors``, ``copy-engines``, ``decoders``, ``encoders``, ``jpeg-engines``,
  ``ofa-engines``, ``memory`` (bytes) — and one counter of 1 per memory slice,
  ``memory-slice-<i>``;
* one device per shape and placement, ``gpu-<minor>-mig-<profile without dots>-<profile
  ID>-<placement start>`` (``gpu-0-mig-1g10gb-19-3``), consuming its shape's capacities and
  the memory slices its placement occupies — so the scheduler never picks two placements that
  overlap, nor a placement beside the whole GPU;
* the whole GPU, ``gpu-<minor>``, consuming every counter — offered while MIG mode is off, and on
  a GPU that switches MIG mode without a reset (Hopper and later) whatever the mode. An Ampere GPU
  is offered whole only while its MIG mode is off (it would take a GPU reset), and partitioned
  only while it is on.

A GPU whose shapes are unknown (not read: no privilege, no MIG support) is offered as without
``dynamic``.

A claim prepared again (after a restart of the agent or the kubelet) has its MIG device checked
against the driver's GPU instances (:func:`made_standing`): a MIG device does not outlive a
reboot or a driver reload, and may be destroyed behind the agent's back.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum

from gpuagent.domain.claims import MadeMig
from gpuagent.domain.devices import Gpu, MigDevice
from gpuagent.domain.migshapes import Instance, MigShape, Placement

__all__ = [
    "CounterSet",
    "Partition",
    "Standing",
    "counter_set_name",
    "instance_at",
    "made_standing",
    "partition_name",
    "partitions",
    "same_boot",
]

MIB = 1024 * 1024
_NOT_RFC1123 = re.compile(r"[^a-z0-9.-]")
_CAMEL = re.compile(r"([a-z0-9])([A-Z])")


@dataclass(frozen=True, slots=True)
class CounterSet:
    """A GPU's shared counters: name → value (``memory`` in bytes)."""

    name: str
    counters: Mapping[str, int] = field(hash=False)


@dataclass(frozen=True, slots=True)
class Partition:
    """One device a partitioned GPU offers: ``shape`` at ``placement``, or (both ``None``) the
    whole GPU; its extra capacities (``multiprocessors``, ``copyEngines``, …) and the counters it
    consumes from its GPU's set."""

    name: str
    shape: MigShape | None
    placement: Placement | None
    capacity: Mapping[str, int] = field(hash=False)
    consumes: Mapping[str, int] = field(hash=False)


def counter_set_name(minor: int) -> str:
    return f"gpu-{minor}-counter-set"


def partition_name(minor: int, shape: MigShape, placement: Placement) -> str:
    """NVIDIA's name of a MIG device that may be made: ``gpu-<minor>-mig-<profile, its dots
    dropped, made RFC 1123>-<profile ID>-<placement start>``."""
    profile = _NOT_RFC1123.sub("-", shape.name.replace(".", "").lower()).strip("-")
    return f"gpu-{minor}-mig-{profile}-{shape.profile_id}-{placement.start}"


def capacities(shape: MigShape) -> dict[str, int]:
    """A shape's capacities besides memory, by NVIDIA's names."""
    return {
        "multiprocessors": shape.multiprocessors,
        "copyEngines": shape.copy_engines,
        "decoders": shape.decoders,
        "encoders": shape.encoders,
        "jpegEngines": shape.jpeg_engines,
        "ofaEngines": shape.ofa_engines,
    }


def _counters(capacity: Mapping[str, int], memory_mib: int, slices: range) -> dict[str, int]:
    """Capacities as counters (DNS labels: ``copyEngines`` → ``copy-engines``), memory in bytes,
    and one counter per memory slice."""
    out = {_CAMEL.sub(r"\1-\2", name).lower(): value for name, value in capacity.items()}
    out["memory"] = memory_mib * MIB
    out.update({f"memory-slice-{i}": 1 for i in slices})
    return out


def _largest(gpu: Gpu) -> tuple[dict[str, int], int]:
    """The most of each capacity, and of memory (MiB), any of the GPU's shapes has."""
    shapes = gpu.mig_partitions.shapes if gpu.mig_partitions is not None else ()
    most: dict[str, int] = {}
    for shape in shapes:
        for name, value in capacities(shape).items():
            most[name] = max(most.get(name, 0), value)
    return most, max((s.memory_mib for s in shapes), default=0)


def partitions(gpu: Gpu) -> tuple[CounterSet, tuple[Partition, ...]] | None:
    """The GPU's counter set and the devices it offers partitioned; ``None`` where it is offered
    as without ``dynamic`` (shapes unknown, or an Ampere GPU whose MIG mode is off)."""
    offered = gpu.mig_partitions
    if offered is None or not offered.shapes:
        return None
    if not gpu.mig_enabled and not offered.toggles:
        return None
    most, memory_mib = _largest(gpu)
    every = range(offered.memory_slices)
    counters = CounterSet(counter_set_name(gpu.minor), _counters(most, memory_mib, every))
    out: list[Partition] = []
    if offered.toggles or not gpu.mig_enabled:
        out.append(Partition(f"gpu-{gpu.minor}", None, None, most, counters.counters))
    for shape in offered.shapes:
        own = capacities(shape)
        out.extend(
            Partition(
                partition_name(gpu.minor, shape, placement),
                shape,
                placement,
                own,
                _counters(own, shape.memory_mib, placement.slices),
            )
            for placement in shape.placements
        )
    return counters, tuple(out)


def instance_at(gpu: Gpu, shape: MigShape, placement: Placement) -> MigDevice | None:
    """The GPU's MIG device made as ``shape`` at ``placement``, if one exists."""
    return next(
        (
            m
            for m in gpu.mig_devices
            if m.profile_id == shape.profile_id and m.placement == placement
        ),
        None,
    )


class Standing(Enum):
    """Where the MIG device made for a prepared claim stands."""

    HELD = "held"  # its GPU instance is there, with its compute instance
    GONE = "gone"  # gone, its placement free: made again there
    TAKEN = "taken"  # gone, and another GPU instance holds (part of) its placement


def same_boot(made: MadeMig, boot: str) -> bool:
    """Whether ``made`` may still exist in ``boot`` (the kernel's boot ID now): made in it, or
    either boot is unknown (a checkpoint from before boots were recorded, an unreadable boot
    ID) — then only the driver can tell."""
    return not made.boot or not boot or made.boot == boot


def made_standing(
    made: MadeMig, found: Iterable[Instance], *, boot: str, placement: Placement | None
) -> tuple[Standing, Instance | None]:
    """Where ``made`` stands among the GPU instances ``found`` on its GPU now, and the instance
    in its place when that is taken.

    Held: an instance of its ID, profile and placement start holding a compute instance, in the
    boot it was made in (in another boot such an instance is someone else's: the checkpoint's
    IDs are reused after a reboot). Otherwise taken when an instance occupies a memory slice of
    its ``placement`` (``None``: unknown, nothing is taken), else gone.
    """
    found = tuple(found)
    if same_boot(made, boot) and any(
        i.gpu_instance_id == made.gpu_instance_id
        and i.profile_id == made.profile_id
        and i.placement.start == made.start
        and i.computed
        for i in found
    ):
        return Standing.HELD, None
    wanted = set(placement.slices) if placement is not None else set()
    blocker = next((i for i in found if wanted & set(i.placement.slices)), None)
    if blocker is not None:
        return Standing.TAKEN, blocker
    return Standing.GONE, None
