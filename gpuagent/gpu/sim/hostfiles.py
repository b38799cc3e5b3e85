"""The simulated node's host as files: a ``/sys`` tree the agent reads as it reads a real one.

Under ``root``: ``bus/pci/devices/<address>/`` of each GPU (``class``, ``vendor``, ``device``,
``numa_node`` and a 256-byte ``config`` whose header carries the IDs and class and no capability
list: not a vGPU) and ``class/dmi/id/product_name`` when the host has one. The agent is pointed at
the tree as its sysfs root, so a simulated node's NUMA nodes and GFD's host labels come the way
a real node's do (:attr:`~gpuagent.gpu.sim.driver.SimDriver.sys_root`). The folder is made on
first use and removed with the driver object (or at exit), as its ``/proc``
(:mod:`~gpuagent.gpu.sim.procfiles`).
"""

from __future__ import annotations

from pathlib import Path

from gpuagent.gpu.sim.scratch import scratch_folder
from gpuagent.gpu.sim.spec import SimGpuSpec, SimNode

__all__ = ["SimSysFiles", "machine_type_file", "pci_address", "write_host_files"]

CONFIG_SPACE = 256
NVIDIA_VENDOR = 0x10DE


class SimSysFiles:
    """The sysfs root of one simulated node."""

    def __init__(self, node: SimNode) -> None:
        self._node = node
        self._root: Path | None = None

    @property
    def root(self) -> Path:
        """The folder standing for ``/sys``, its files written (made on first use)."""
        if self._root is None:
            root = scratch_folder(self, "sys")
            write_host_files(self._node, root)
            self._root = root
        return self._root


def pci_address(bus_id: str) -> str:
    """sysfs's name of a PCI function (``0000:00:06.0``) for NVML's bus ID
    (``00000000:00:06.0``)."""
    domain, _, rest = bus_id.partition(":")
    return f"{int(domain, 16):04x}:{rest.lower()}"


def machine_type_file(root: Path) -> Path:
    """Where the DMI product name lies under a sysfs root."""
    return root / "class" / "dmi" / "id" / "product_name"


def write_host_files(node: SimNode, root: Path) -> None:
    """Write the host's files for ``node`` under ``root`` (a new, empty directory)."""
    for gpu in node.gpus:
        device = root / "bus" / "pci" / "devices" / pci_address(gpu.pci_bus_id)
        device.mkdir(parents=True, exist_ok=True)
        numa = gpu.numa_node if node.host.numa else -1
        device_id = gpu.profile.pci_device_id >> 16
        (device / "class").write_text(f"{gpu.pci_class}\n")
        (device / "vendor").write_text(f"0x{NVIDIA_VENDOR:04x}\n")
        (device / "device").write_text(f"0x{device_id:04x}\n")
        (device / "numa_node").write_text(f"{numa}\n")
        (device / "config").write_bytes(_config(gpu, device_id))
    if node.host.product_name is not None:
        path = machine_type_file(root)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{node.host.product_name}\n")


def _config(gpu: SimGpuSpec, device_id: int) -> bytes:
    """A type-0 configuration header: vendor and device IDs, status without a capability list
    (so no vendor capability: GFD's vGPU labeler finds no vGPU), the class code."""
    config = bytearray(CONFIG_SPACE)
    config[0:2] = NVIDIA_VENDOR.to_bytes(2, "little")
    config[2:4] = device_id.to_bytes(2, "little")
    config[9:12] = int(gpu.pci_class, 16).to_bytes(3, "little")  # prog-if, subclass, class
    return bytes(config)
