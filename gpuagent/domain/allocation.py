"""What a container receives, and why a request is refused.

The allocation core is split by concern:

* :mod:`gpuagent.domain.resources` — which resources the node advertises, and their devices;
* :mod:`gpuagent.domain.containers` — validating ``Allocate`` and shaping the container's view for
  each device-list strategy;
* :mod:`gpuagent.domain.preferred` — ``GetPreferredAllocation``: topology search, replica and MIG
  placement policies.

This module holds what they share: the wire-independent :class:`ContainerAllocation` and the
:class:`AllocationError` family. :mod:`gpuagent.domain.serving` puts them together per snapshot.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

VISIBLE_DEVICES = "NVIDIA_VISIBLE_DEVICES"
# nvidia-container-runtime reads device IDs from mounts under this directory in volume-mounts mode.
VOLUME_MOUNT_ROOT = "/var/run/nvidia-container-devices"
VOLUME_MOUNT_HOST_PATH = "/dev/null"


class AllocationError(Exception):
    """A request the agent refuses; the message names the offending device IDs."""


class EmptyRequestError(AllocationError):
    """The request names no devices."""


class UnknownDevicesError(AllocationError):
    """The request names IDs this agent does not advertise (for this resource)."""

    def __init__(self, ids: Sequence[str], resource: str = "") -> None:
        self.ids = tuple(ids)
        where = f" for {resource}" if resource else ""
        super().__init__(f"unknown device IDs{where}: {', '.join(self.ids)}")


class UnhealthyDevicesError(AllocationError):
    """The request names devices that are currently unhealthy."""

    def __init__(self, ids: Sequence[str], reasons: Sequence[str]) -> None:
        self.ids = tuple(ids)
        detail = "; ".join(f"{i} ({r})" for i, r in zip(self.ids, reasons, strict=True))
        super().__init__(f"unhealthy device IDs: {detail}")


class DuplicateDevicesError(AllocationError):
    """The request names the same device more than once."""

    def __init__(self, ids: Sequence[str]) -> None:
        self.ids = tuple(ids)
        super().__init__(f"device IDs requested more than once: {', '.join(self.ids)}")


class SharedRequestTooLargeError(AllocationError):
    """More than one replica requested while ``failRequestsGreaterThanOne`` is set."""

    def __init__(self, ids: Sequence[str], resource: str) -> None:
        self.ids = tuple(ids)
        super().__init__(
            f"request for {resource} too large: maximum request size for shared resources "
            f"is 1; found {len(self.ids)}"
        )


@dataclass(frozen=True, slots=True)
class MountSpec:
    container_path: str
    host_path: str
    read_only: bool = True


@dataclass(frozen=True, slots=True)
class DeviceSpec:
    """A device node handed to the container (``--pass-device-specs``)."""

    container_path: str
    host_path: str
    permissions: str = "rw"


def _frozen_map() -> Mapping[str, str]:
    return MappingProxyType({})


@dataclass(frozen=True, slots=True)
class ContainerAllocation:
    """What one container receives, independent of the wire format.

    ``cdi_devices`` are fully-qualified CDI names (``vendor/class=name``); the gRPC adapter wraps
    each in a ``CDIDevice`` message.
    """

    envs: Mapping[str, str] = field(default_factory=_frozen_map)
    mounts: tuple[MountSpec, ...] = ()
    devices: tuple[DeviceSpec, ...] = ()
    annotations: Mapping[str, str] = field(default_factory=_frozen_map)
    cdi_devices: tuple[str, ...] = ()
