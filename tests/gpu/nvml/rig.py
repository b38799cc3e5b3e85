"""What the NVML backend's tests share: the simulated node's size, NVML's error codes, sane
ranges for an H100's readings, and the sysfs tree the backend reads beside NVML.
"""

from __future__ import annotations

from pathlib import Path

import pynvml

from gpuagent.domain.devices import Gpu
from gpuagent.gpu.nvml import (
    Nvml,
)
from gpuagent.gpu.sim import SimDriver, install, uninstall

MIB = 1024 * 1024
GPUS = 4
ABSENT_LOG = "value not offered by this gpu or driver"
GPU_RESET = int(pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET)
ACTION_NONE = int(pynvml.NVML_GPU_RECOVERY_ACTION_NONE)
NOT_SUPPORTED = int(pynvml.NVML_ERROR_NOT_SUPPORTED)
UNKNOWN = int(pynvml.NVML_ERROR_UNKNOWN)
GPU_IS_LOST = int(pynvml.NVML_ERROR_GPU_IS_LOST)


# Sane ranges for an H100 80GB: catches unit slips (mW for W, bytes for MiB).
PLAUSIBLE: dict[str, tuple[float, float]] = {
    "temperature_c": (20, 100),
    "power_w": (50, 700),
    "sm_clock_mhz": (500, 1980),
    "mem_clock_mhz": (1000, 3000),
    "gpu_util_pct": (0, 100),
    "mem_util_pct": (0, 100),
    "fb_used_mib": (1, 81559),
    "fb_free_mib": (1, 81559),
    "energy_mj": (1, 1e12),
}


def discover_on(driver: SimDriver, sysfs_root: Path) -> list[Gpu]:
    """The GPUs a fresh backend discovers on ``driver`` (installed for the call only)."""
    install(driver)
    backend = Nvml(sysfs_root=sysfs_root)
    try:
        backend.init()
        return backend.discover()
    finally:
        backend.shutdown()
        uninstall()


def sysfs_numa(root: Path, bus_id: str, value: str) -> None:
    """Write ``<root>/bus/pci/devices/<4-hex-digit domain, lower case>/numa_node``."""
    name = bus_id[4:].lower()  # NVML's 8-hex-digit domain becomes sysfs's 4.
    device = root / "bus/pci/devices" / name
    device.mkdir(parents=True)
    (device / "numa_node").write_text(f"{value}\n")
