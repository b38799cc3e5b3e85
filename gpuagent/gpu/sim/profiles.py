"""GPU models the simulated driver can impersonate, as NVML reports them.

Plain data: names, memory sizes and clocks are what ``nvidia-smi``/NVML show on real boards (SXM
form factor, the HGX/DGX parts); power limits are the default enforced limits.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

NVML_DEVICE_ARCH_AMPERE = 7
NVML_DEVICE_ARCH_HOPPER = 9
NVML_DEVICE_ARCH_BLACKWELL = 10


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
    mig_profiles: tuple[str, ...]


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
    mig_profiles=("1g.5gb", "1g.5gb+me", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb"),
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
    mig_profiles=("1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"),
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
    mig_profiles=("1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"),
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
    mig_profiles=(
        "1g.18gb",
        "1g.18gb+me",
        "1g.35gb",
        "2g.35gb",
        "3g.71gb",
        "4g.71gb",
        "7g.141gb",
    ),
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
    mig_profiles=(
        "1g.23gb",
        "1g.23gb+me",
        "1g.45gb",
        "2g.45gb",
        "3g.90gb",
        "4g.90gb",
        "7g.180gb",
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


def mig_slices(mig_profile: str) -> int:
    """Compute slices used by a MIG profile name such as ``"3g.40gb"`` (the number before "g")."""
    return int(mig_profile.split("g.", 1)[0])
