"""Topology and NVLink entry points of the simulated ``libnvidia-ml``.

The model, kept simple on purpose:

* PCIe: every GPU hangs off its own host bridge, so the common ancestor of two GPUs is decided by
  NUMA alone — the same NUMA node gives ``NVML_TOPOLOGY_NODE``, different ones
  ``NVML_TOPOLOGY_SYSTEM`` (a GPU with itself: ``NVML_TOPOLOGY_INTERNAL``). No PCIe switches are
  modelled, so SINGLE/MULTIPLE/HOSTBRIDGE never occur.
* NVLink: each GPU has its profile's number of link slots (18 on H100), or none where the driver
  shows no NVLink (``nvlink: false``: every NVLink call NOT_SUPPORTED). Direct GPU-to-GPU links
  come first, then links to NVSwitches, then inactive slots. An active link answers its state
  (enabled), its remote PCI info (the peer GPU's, or the NVSwitch's) and its remote device type
  (GPU or SWITCH); an inactive one is disabled and has no remote (NOT_SUPPORTED); a link number
  past the GPU's slots is an invalid argument.
* MIG devices take part in neither: topology and NVLink calls on them are NOT_SUPPORTED.
"""

from __future__ import annotations

from typing import Any

import pynvml

from gpuagent.gpu.sim._abi import Symbol, as_int, device, out
from gpuagent.gpu.sim._api_device import fill_pci
from gpuagent.gpu.sim.spec import switch_bus_id
from gpuagent.gpu.sim.state import DriverState, GpuState, LinkEnd

SUCCESS = int(pynvml.NVML_SUCCESS)
INVALID_ARGUMENT = int(pynvml.NVML_ERROR_INVALID_ARGUMENT)
NOT_SUPPORTED = int(pynvml.NVML_ERROR_NOT_SUPPORTED)
#: PCI device ID the simulated NVSwitches report (a third-generation NVSwitch).
NVSWITCH_PCI_DEVICE_ID = 0x22A310DE


def _common_ancestor(st: DriverState, a: GpuState, b: GpuState, ref: object) -> int:
    if a.mig is not None or b.mig is not None:
        return NOT_SUPPORTED
    if a is b:
        level = pynvml.NVML_TOPOLOGY_INTERNAL
    elif a.spec.numa_node == b.spec.numa_node:
        level = pynvml.NVML_TOPOLOGY_NODE
    else:
        level = pynvml.NVML_TOPOLOGY_SYSTEM
    out(ref).value = level
    return SUCCESS


def _end(gpu: GpuState, link: object) -> tuple[int, LinkEnd | None]:
    """``(SUCCESS, far end or None if inactive)`` of link number ``link``, or ``(error, None)``."""
    if gpu.mig is not None or not gpu.links:
        return NOT_SUPPORTED, None
    index = as_int(link)
    if not 0 <= index < len(gpu.links):
        return INVALID_ARGUMENT, None
    return SUCCESS, gpu.links[index]


def _link_state(st: DriverState, gpu: GpuState, link: object, ref: object) -> int:
    code, end = _end(gpu, link)
    if code != SUCCESS:
        return code
    out(ref).value = pynvml.NVML_FEATURE_DISABLED if end is None else pynvml.NVML_FEATURE_ENABLED
    return SUCCESS


def _fill_switch_pci(info: Any, switch: int) -> None:
    bus_id = switch_bus_id(switch)
    bus = int(bus_id.split(":")[1], 16)
    info.busIdLegacy = f"0000:{bus:02X}:00.0".encode()
    info.domain = 0
    info.bus = bus
    info.device = 0
    info.pciDeviceId = NVSWITCH_PCI_DEVICE_ID
    info.pciSubSystemId = NVSWITCH_PCI_DEVICE_ID
    info.busId = bus_id.encode()


def _remote_pci(st: DriverState, gpu: GpuState, link: object, ref: object) -> int:
    code, end = _end(gpu, link)
    if code != SUCCESS:
        return code
    if end is None:
        return NOT_SUPPORTED
    if end.is_gpu:
        fill_pci(out(ref), st.gpus[end.index])
    else:
        _fill_switch_pci(out(ref), end.index)
    return SUCCESS


def _remote_type(st: DriverState, gpu: GpuState, link: object, ref: object) -> int:
    code, end = _end(gpu, link)
    if code != SUCCESS:
        return code
    if end is None:
        return NOT_SUPPORTED
    out(ref).value = end.kind
    return SUCCESS


SYMBOLS: dict[str, Symbol] = {
    "nvmlDeviceGetTopologyCommonAncestor": device(_common_ancestor, handles=2),
    "nvmlDeviceGetNvLinkState": device(_link_state),
    "nvmlDeviceGetNvLinkRemotePciInfo_v2": device(_remote_pci),
    "nvmlDeviceGetNvLinkRemoteDeviceType": device(_remote_type),
}
