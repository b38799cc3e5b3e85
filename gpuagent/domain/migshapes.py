"""What MIG a GPU could be partitioned into, as its driver says: every GPU-instance profile it
offers (``nvmlDeviceGetGpuInstanceProfileInfo``) and that profile's placements
(``nvmlDeviceGetGpuInstancePossiblePlacements``), in memory slices.

Read by discovery where MIG is made on demand (``--dra-mig dynamic``) and published through DRA
(:mod:`gpuagent.domain.dynmig`). Plain values; no rules here.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Instance", "MigPartitions", "MigRefused", "MigShape", "Placement"]


@dataclass(frozen=True, slots=True, order=True)
class Placement:
    """Where a GPU instance sits: its first memory slice and how many it occupies."""

    start: int
    size: int

    @property
    def slices(self) -> range:
        """The memory slices it occupies."""
        return range(self.start, self.start + self.size)


@dataclass(frozen=True, slots=True)
class MigShape:
    """One GPU-instance profile of a GPU, with the compute instance spanning it.

    ``name`` as NVIDIA spells it (``1g.10gb``, ``1g.10gb+me``); ``gi_profile`` the
    ``NVML_GPU_INSTANCE_PROFILE_*`` index, ``profile_id`` the driver's ID for it (``nvidia-smi mig
    -lgip``'s, what a GPU instance is created with); ``slices`` its compute slices; the engine
    counts and memory (MiB) an instance of it holds; every placement the driver offers.
    """

    name: str
    gi_profile: int
    profile_id: int
    slices: int
    memory_mib: int
    multiprocessors: int
    copy_engines: int
    decoders: int
    encoders: int
    jpeg_engines: int
    ofa_engines: int
    placements: tuple[Placement, ...]


@dataclass(frozen=True, slots=True)
class MigPartitions:
    """Every MIG shape a GPU offers. ``memory_slices``: how many the GPU has (the largest
    placement's end); ``toggles``: MIG mode switches without a GPU reset (Hopper and later)."""

    shapes: tuple[MigShape, ...]
    toggles: bool

    @property
    def memory_slices(self) -> int:
        return max((p.start + p.size for s in self.shapes for p in s.placements), default=0)


@dataclass(frozen=True, slots=True)
class Instance:
    """A GPU instance the driver lists: its ID, profile ID and placement, and whether it holds
    a compute instance (is a MIG device)."""

    gpu_instance_id: int
    profile_id: int
    placement: Placement
    computed: bool


class MigRefused(Exception):
    """The driver refused to make, destroy or switch MIG; ``reason`` is NVML's error as nvml.h
    names it without its prefix (``INSUFFICIENT_RESOURCES``, ``IN_USE``, …; empty when the
    refusal is not the driver's)."""

    def __init__(self, message: str, reason: str = "") -> None:
        super().__init__(message)
        self.reason = reason
