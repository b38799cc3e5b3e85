"""GPU models the simulated driver can impersonate, as NVML reports them.

Plain data: names, memory sizes and clocks are what ``nvidia-smi``/NVML show on real boards (SXM
form factor, the HGX/DGX parts); power limits are the default enforced limits.

MIG: every model here has NVIDIA's seven GPU-instance profiles of the A100/H100 generation, over
7 compute slices and 8 memory slices (``nvidia-smi mig -lgip`` / ``-lgipp``):

    profile       NVML index     ID  slices  memory slices  placements  instances
    1g.<S>gb      1_SLICE        19  1       1              0..6        7
    1g.<S>gb+me   1_SLICE_REV1   20  1       1              0..6        1
    1g.<D>gb      1_SLICE_REV2   15  1       2              0,2,4,6     4
    2g.<D>gb      2_SLICE        14  2       2              0,2,4       3
    3g.<H>gb      3_SLICE         9  3       4              0,4         2
    4g.<H>gb      4_SLICE         5  4       4              0           1
    7g.<F>gb      7_SLICE         0  7       8              0           1

Placements are the first memory slice and count of slices an instance occupies. The memory of each
instance (MiB) is what ``nvidia-smi mig -lgip`` reports on H100 (9.75 GiB for ``1g.10gb``) and
on A100 (4.75 GiB for a 40GB ``1g.5gb``, 9.5 GiB for an 80GB ``1g.10gb``); for H200 and B200 the
sizes are plausible values that give NVIDIA's names under the naming rule
(:func:`gpuagent.gpu.mig.mig_profile_name`). SM counts are approximate for B200.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

NVML_DEVICE_ARCH_AMPERE = 7
NVML_DEVICE_ARCH_HOPPER = 9
NVML_DEVICE_ARCH_BLACKWELL = 10

#: Compute and memory slices of a MIG-capable GPU of these generations.
MIG_COMPUTE_SLICES = 7
MIG_MEMORY_SLICES = 8

# NVML's GPU-instance profile indexes (``NVML_GPU_INSTANCE_PROFILE_*``).
GI_PROFILE_1_SLICE = 0x0
GI_PROFILE_2_SLICE = 0x1
GI_PROFILE_3_SLICE = 0x2
GI_PROFILE_4_SLICE = 0x3
GI_PROFILE_7_SLICE = 0x4
GI_PROFILE_1_SLICE_REV1 = 0x7
GI_PROFILE_1_SLICE_REV2 = 0x9

#: ``NVML_FI_DEV_ECC_SBE_VOL_TOTAL``: the volatile corrected-ECC total as a field value, which
#: the real H200 (R580) answered NOT_SUPPORTED while ``nvmlDeviceGetTotalEccErrors`` read it.
#: (Only the H200 says so: no H100 has been captured.)
FI_ECC_SBE_VOL_TOTAL = 3

#: ``NVML_COMPUTE_INSTANCE_PROFILE_*`` of the compute instance spanning a GPU instance of N slices.
CI_PROFILE_FOR_SLICES = {1: 0x0, 2: 0x1, 3: 0x2, 4: 0x3, 6: 0x6, 7: 0x4, 8: 0x5}


@dataclass(frozen=True)
class MigProfile:
    """One GPU-instance profile of a model, with the compute instance that spans it (C == G)."""

    name: str
    gi_profile: int  # NVML_GPU_INSTANCE_PROFILE_* (what nvmlDeviceGetGpuInstanceProfileInfo takes)
    profile_id: int  # the profile's ID (nvidia-smi's "ID" column, nvmlGpuInstanceInfo_t.profileId)
    slices: int  # compute slices: the "<n>g"
    memory_slices: int  # eighths of the memory; also the size of a placement
    memory_mib: int
    placements: tuple[int, ...]  # first memory slice of every valid placement
    max_instances: int
    multiprocessors: int
    media_extensions: bool = False

    @property
    def engines(self) -> dict[str, int]:
        """Engine counts of an instance, as ``nvidia-smi mig -lgip`` shows them on H100."""
        return {
            "copy": self.slices + (1 if self.slices == MIG_COMPUTE_SLICES else 0),
            "decoders": self.slices,
            "encoders": 0,
            "jpeg": self.slices,
            "ofa": 1 if self.media_extensions or self.slices == MIG_COMPUTE_SLICES else 0,
        }

    @property
    def ci_profile(self) -> int:
        """``NVML_COMPUTE_INSTANCE_PROFILE_*`` of the compute instance spanning the GPU instance."""
        return CI_PROFILE_FOR_SLICES[self.slices]


def _mig_table(
    gb: tuple[int, int, int, int],
    memory_mib: tuple[int, int, int, int],
    multiprocessors: tuple[int, int, int, int, int, int],
) -> tuple[MigProfile, ...]:
    """The seven profiles of a model from its sizes.

    ``gb``/``memory_mib``: the 1-slice, 2-memory-slice, half and full instances;
    ``multiprocessors``: SMs of the 1g, 1g with two memory slices, 2g, 3g, 4g and 7g instances.
    """
    small, double, half, full = memory_mib
    sm_1g, sm_1g_double, sm_2g, sm_3g, sm_4g, sm_7g = multiprocessors
    return (
        MigProfile(f"1g.{gb[0]}gb", GI_PROFILE_1_SLICE, 19, 1, 1, small, tuple(range(7)), 7, sm_1g),
        MigProfile(
            f"1g.{gb[0]}gb+me",
            GI_PROFILE_1_SLICE_REV1,
            20,
            1,
            1,
            small,
            tuple(range(7)),
            1,
            sm_1g,
            media_extensions=True,
        ),
        MigProfile(
            f"1g.{gb[1]}gb",
            GI_PROFILE_1_SLICE_REV2,
            15,
            1,
            2,
            double,
            (0, 2, 4, 6),
            4,
            sm_1g_double,
        ),
        MigProfile(f"2g.{gb[1]}gb", GI_PROFILE_2_SLICE, 14, 2, 2, double, (0, 2, 4), 3, sm_2g),
        MigProfile(f"3g.{gb[2]}gb", GI_PROFILE_3_SLICE, 9, 3, 4, half, (0, 4), 2, sm_3g),
        MigProfile(f"4g.{gb[2]}gb", GI_PROFILE_4_SLICE, 5, 4, 4, half, (0,), 1, sm_4g),
        MigProfile(f"7g.{gb[3]}gb", GI_PROFILE_7_SLICE, 0, 7, 8, full, (0,), 1, sm_7g),
    )


@dataclass(frozen=True)
class GpuProfile:
    """One GPU model: identity, capacity and limits as NVML reports them."""

    key: str
    model_name: str
    aliases: tuple[str, ...]
    memory_mib: int
    architecture: int
    compute_capability: tuple[int, int]
    pci_device_id: int
    pci_subsystem_id: int
    power_limit_mw: int
    idle_power_mw: int
    max_graphics_clock_mhz: int
    max_sm_clock_mhz: int
    max_mem_clock_mhz: int
    max_video_clock_mhz: int
    nvlink_count: int
    mig_profiles: tuple[MigProfile, ...]
    #: Field IDs the model's driver answers NOT_SUPPORTED (``nvmlDeviceGetFieldValues``).
    unsupported_fields: frozenset[int] = frozenset()

    @property
    def mig_profile_names(self) -> tuple[str, ...]:
        """The names of the model's MIG profiles, as ``nvidia-smi mig -lgip`` lists them."""
        return tuple(p.name for p in self.mig_profiles)

    def mig_profile(self, name: str) -> MigProfile | None:
        """The MIG profile called ``name`` (exactly as NVIDIA spells it) on this model, if any."""
        return next((p for p in self.mig_profiles if p.name == name), None)


A100_40GB = GpuProfile(
    key="a100-40gb",
    model_name="NVIDIA A100-SXM4-40GB",
    aliases=("a100", "a100-40gb", "a100-sxm4-40gb", "a100-sxm-40gb"),
    memory_mib=40960,
    architecture=NVML_DEVICE_ARCH_AMPERE,
    compute_capability=(8, 0),
    pci_device_id=0x20B010DE,
    pci_subsystem_id=0x134F10DE,
    power_limit_mw=400_000,
    idle_power_mw=55_000,
    max_graphics_clock_mhz=1410,
    max_sm_clock_mhz=1410,
    max_mem_clock_mhz=1215,
    max_video_clock_mhz=1290,
    nvlink_count=12,
    mig_profiles=_mig_table((5, 10, 20, 40), (4864, 9856, 20096, 40448), (14, 14, 28, 42, 56, 98)),
)

A100_80GB = GpuProfile(
    key="a100-80gb",
    model_name="NVIDIA A100-SXM4-80GB",
    aliases=("a100-80gb", "a100-sxm4-80gb", "a100-sxm-80gb"),
    memory_mib=81920,
    architecture=NVML_DEVICE_ARCH_AMPERE,
    compute_capability=(8, 0),
    pci_device_id=0x20B210DE,
    pci_subsystem_id=0x147F10DE,
    power_limit_mw=400_000,
    idle_power_mw=60_000,
    max_graphics_clock_mhz=1410,
    max_sm_clock_mhz=1410,
    max_mem_clock_mhz=1593,
    max_video_clock_mhz=1290,
    nvlink_count=12,
    mig_profiles=_mig_table(
        (10, 20, 40, 80), (9728, 19968, 40448, 81152), (14, 14, 28, 42, 56, 98)
    ),
)

H100_80GB = GpuProfile(
    key="h100-80gb",
    model_name="NVIDIA H100 80GB HBM3",
    aliases=("h100", "h100-80gb", "h100-sxm", "h100-sxm5", "h100-sxm5-80gb", "h100-80gb-hbm3"),
    memory_mib=81559,
    architecture=NVML_DEVICE_ARCH_HOPPER,
    compute_capability=(9, 0),
    pci_device_id=0x233010DE,
    pci_subsystem_id=0x16C110DE,
    power_limit_mw=700_000,
    idle_power_mw=70_000,
    max_graphics_clock_mhz=1980,
    max_sm_clock_mhz=1980,
    max_mem_clock_mhz=2619,
    max_video_clock_mhz=1545,
    nvlink_count=18,
    mig_profiles=_mig_table(
        (10, 20, 40, 80), (9984, 20096, 40448, 81152), (16, 26, 32, 60, 64, 132)
    ),
)

H200_141GB = GpuProfile(
    key="h200-141gb",
    model_name="NVIDIA H200",
    aliases=("h200", "h200-141gb", "h200-sxm", "h200-sxm5", "h200-141gb-hbm3e"),
    memory_mib=143771,
    architecture=NVML_DEVICE_ARCH_HOPPER,
    compute_capability=(9, 0),
    pci_device_id=0x233510DE,
    pci_subsystem_id=0x18BE10DE,
    power_limit_mw=700_000,
    idle_power_mw=75_000,
    max_graphics_clock_mhz=1980,
    max_sm_clock_mhz=1980,
    max_mem_clock_mhz=3201,
    max_video_clock_mhz=1545,
    nvlink_count=18,
    mig_profiles=_mig_table(
        (18, 35, 71, 141), (16640, 33280, 71424, 142592), (16, 26, 32, 60, 64, 132)
    ),
    unsupported_fields=frozenset({FI_ECC_SBE_VOL_TOTAL}),
)

B200_180GB = GpuProfile(
    key="b200-180gb",
    model_name="NVIDIA B200",
    aliases=("b200", "b200-180gb", "b200-sxm", "b200-180gb-hbm3e"),
    memory_mib=183359,
    architecture=NVML_DEVICE_ARCH_BLACKWELL,
    compute_capability=(10, 0),
    pci_device_id=0x290110DE,
    pci_subsystem_id=0x199910DE,
    power_limit_mw=1_000_000,
    idle_power_mw=140_000,
    max_graphics_clock_mhz=1965,
    max_sm_clock_mhz=1965,
    max_mem_clock_mhz=3996,
    max_video_clock_mhz=1695,
    nvlink_count=18,
    mig_profiles=_mig_table(
        (23, 45, 90, 180), (22528, 45056, 91136, 182272), (18, 26, 36, 60, 72, 148)
    ),
)

PROFILES: tuple[GpuProfile, ...] = (A100_40GB, A100_80GB, H100_80GB, H200_141GB, B200_180GB)
DEFAULT_PROFILE = H100_80GB


def _normalise(name: str) -> str:
    text = re.sub(r"[\s_]+", "-", name.strip().lower())
    return text.removeprefix("nvidia-")


_BY_NAME: dict[str, GpuProfile] = {
    _normalise(alias): profile
    for profile in PROFILES
    for alias in (profile.model_name, profile.key, *profile.aliases)
}


def find_profile(name: str) -> GpuProfile | None:
    """The profile whose model name, key or alias matches ``name`` (case-insensitive), if any.

    Spaces and underscores count as hyphens and a leading "NVIDIA " is optional, so
    ``"NVIDIA H100 80GB HBM3"``, ``"h100-80gb"`` and ``"H100"`` all name the H100 profile.
    """
    return _BY_NAME.get(_normalise(name))


def place_mig(profiles: Sequence[MigProfile]) -> tuple[int, ...] | None:
    """A placement start for each of ``profiles`` (same order) with no two overlapping, or None.

    Larger instances are placed first, each at its highest free start (as the driver fills a GPU
    when ``nvidia-smi mig -cgi`` is given no placement), backtracking when a later one does not fit.
    """
    order = sorted(range(len(profiles)), key=lambda i: -profiles[i].memory_slices)
    starts = [0] * len(profiles)
    used = [False] * MIG_MEMORY_SLICES

    def solve(k: int) -> bool:
        if k == len(order):
            return True
        i = order[k]
        profile = profiles[i]
        for start in sorted(profile.placements, reverse=True):
            span = range(start, start + profile.memory_slices)
            if any(used[s] for s in span):
                continue
            for s in span:
                used[s] = True
            starts[i] = start
            if solve(k + 1):
                return True
            for s in span:
                used[s] = False
        return False

    return tuple(starts) if solve(0) else None


def gpu_instance_id(start: int, memory_slices: int) -> int:
    """The simulated GPU-instance ID of a placement: its node in the memory-slice binary tree.

    0 is the whole GPU, 1-2 the halves, 3-6 the quarters, 7-14 the eighths. Real drivers number
    instances their own way; the agent reads IDs from NVML and never derives them.
    """
    first = {8: 0, 4: 1, 2: 3, 1: 7}[memory_slices]
    return first + start // memory_slices
