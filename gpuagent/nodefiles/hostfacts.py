"""What the host says about itself that GPU feature discovery puts into node labels.

* the machine type (DMI ``/sys/class/dmi/id/product_name``, GFD's ``--machine-type-file``) for
  ``nvidia.com/gpu.machine``; ``unknown`` when it cannot be read, as GFD writes;
* each GPU's PCI class (``<sysfs>/bus/pci/devices/<address>/class``) for ``nvidia.com/gpu.mode``;
* the vGPUs of a virtual machine: NVIDIA PCI functions whose vendor-specific capability carries
  the ``VF`` signature, with the host driver's version and branch from its first record
  (``nvidia.com/vgpu.*``). Walking the capability list needs the whole 256-byte configuration
  space, which sysfs gives only to a privileged reader: with less, or without a readable list of
  PCI devices, vGPUs cannot be told and :attr:`HostFacts.vgpus` is ``None`` (GFD, run
  unprivileged, fails outright).

Blocking reads; nothing here raises for a missing or unreadable file.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from gpuagent.nodefiles.driverfiles import sysfs_address

__all__ = [
    "DEFAULT_MACHINE_TYPE_FILE",
    "HostFacts",
    "Vgpu",
    "read_host_facts",
    "vgpu_from_config",
]

DEFAULT_MACHINE_TYPE_FILE = Path("/sys/class/dmi/id/product_name")
UNKNOWN = "unknown"
NVIDIA_VENDOR = "0x10de"
CONFIG_SPACE = 256
_STATUS = 0x06
_STATUS_CAPABILITIES = 0x10
_CAPABILITIES_POINTER = 0x34
_VENDOR_SPECIFIC = 0x09
_RECORDS_START = 5
_VERSION_LENGTH = 10
_BRANCH_LENGTH = 10


@dataclass(frozen=True, slots=True)
class Vgpu:
    """A vGPU seen from inside a virtual machine, and the host's vGPU manager driver."""

    address: str
    host_driver_version: str = ""
    host_driver_branch: str = ""


@dataclass(frozen=True, slots=True)
class HostFacts:
    """The machine type, GPUs' PCI classes (by NVML bus ID) and vGPUs (None: cannot tell)."""

    machine: str = UNKNOWN
    pci_classes: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    vgpus: tuple[Vgpu, ...] | None = ()


def read_host_facts(
    bus_ids: Iterable[str],
    *,
    machine_type_file: Path = DEFAULT_MACHINE_TYPE_FILE,
    sysfs_root: Path = Path("/sys"),
) -> HostFacts:
    """Read the facts for the GPUs at NVML ``bus_ids``."""
    devices = sysfs_root / "bus" / "pci" / "devices"
    classes = {}
    for bus_id in bus_ids:
        text = _read_text(devices / sysfs_address(bus_id) / "class")
        if text:
            classes[bus_id] = text
    return HostFacts(
        machine=_machine(machine_type_file),
        pci_classes=MappingProxyType(classes),
        vgpus=_vgpus(devices),
    )


def vgpu_from_config(address: str, config: bytes) -> Vgpu | None:
    """The vGPU a PCI function's configuration space describes, or None if it is not one.

    Raises :class:`ValueError` when ``config`` is shorter than the 256-byte configuration space.
    """
    if len(config) < CONFIG_SPACE:
        raise ValueError(f"{address}: only {len(config)} bytes of PCI configuration space")
    capability = _vendor_capability(config)
    if capability is None or capability[3:5] != b"VF":
        return None
    version, branch = _host_driver(capability)
    return Vgpu(address, version, branch)


def _machine(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        return UNKNOWN


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="ascii", errors="replace").strip()
    except OSError:
        return ""


def _vgpus(devices: Path) -> tuple[Vgpu, ...] | None:
    try:
        entries = sorted(p for p in devices.iterdir())
    except OSError:
        return None  # cannot tell (GFD's vGPU labeler gives up too)
    found = []
    for entry in entries:
        if _read_text(entry / "vendor") != NVIDIA_VENDOR:
            continue
        try:
            config = (entry / "config").read_bytes()
        except OSError:
            return None
        try:
            vgpu = vgpu_from_config(entry.name, config)
        except ValueError:
            return None
        if vgpu is not None:
            found.append(vgpu)
    return tuple(found)


def _vendor_capability(config: bytes) -> bytes | None:
    """The first vendor-specific capability of the configuration space's capability list."""
    if not config[_STATUS] & _STATUS_CAPABILITIES:
        return None
    seen: set[int] = set()
    position = config[_CAPABILITIES_POINTER]
    while position and position not in seen and position + 2 < len(config):
        seen.add(position)
        ident, following, length = config[position], config[position + 1], config[position + 2]
        if ident == 0xFF:
            return None
        if ident == _VENDOR_SPECIFIC:
            return config[position : position + length]
        position = following
    return None


def _host_driver(capability: bytes) -> tuple[str, str]:
    """The host driver's version and branch from the capability's records (record type 0)."""
    position = _RECORDS_START
    record = capability[position] if position < len(capability) else 0
    while record != 0 and position + 1 < len(capability):
        step = capability[position + 1]
        if step == 0:
            return "", ""
        position += step
        record = capability[position] if position < len(capability) else 0
    start = position + 2
    end = start + _VERSION_LENGTH + _BRANCH_LENGTH
    if record != 0 or end > len(capability):
        return "", ""
    version = capability[start : start + _VERSION_LENGTH]
    branch = capability[start + _VERSION_LENGTH : end]
    return _c_string(version), _c_string(branch)


def _c_string(raw: bytes) -> str:
    return raw.strip(b"\0").decode("ascii", errors="replace")
