"""The host around a simulated node: what its ``/sys`` says that NVML does not.

GPU feature discovery labels a node from these files (``nvidia.com/gpu.machine`` from the DMI
product name, ``nvidia.com/gpu.mode`` from a GPU's PCI class), and on x86 servers the agent reads a
GPU's NUMA node from sysfs, since NVML gives one only where the GPUs are NUMA nodes themselves
(Grace platforms). A GPU's PCI class is a fact of the GPU
(:class:`~gpuagent.gpu.sim.spec.SimGpuSpec`); the rest is the host's.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["COMPUTE_CLASS", "DISPLAY_CLASS", "SimHost"]

#: PCI class codes: a 3D controller (a data-centre GPU: GFD's ``gpu.mode=compute``) and a VGA
#: controller (a GPU with display output enabled: ``graphics``).
COMPUTE_CLASS = "0x030200"
DISPLAY_CLASS = "0x030000"


@dataclass(frozen=True)
class SimHost:
    """``product_name``: ``/sys/class/dmi/id/product_name`` (None: no such file, as in a
    Firecracker VM: GFD's ``gpu.machine=unknown``). ``numa``: whether the kernel knows the GPUs'
    NUMA nodes (false: each GPU's sysfs ``numa_node`` reads -1, as in a VM without a NUMA
    topology)."""

    product_name: str | None = None
    numa: bool = True
