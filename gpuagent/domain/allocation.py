"""What a container receives, why a request is refused, and the original single-resource policy.

The allocation core is split by concern:

* :mod:`gpuagent.domain.resources` — which resources the node advertises, and their devices;
* :mod:`gpuagent.domain.containers` — validating ``Allocate`` and shaping the container's view for
  each device-list strategy;
* :mod:`gpuagent.domain.preferred` — ``GetPreferredAllocation``: topology search, replica and MIG
  placement policies.

This module holds what they share (the wire-independent :class:`ContainerAllocation` and the
:class:`AllocationError` family) and :class:`AllocationPolicy`, the full-GPU-only policy the
DevicePlugin service used before those modules existed; it stays until the service is rewired.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from gpuagent.domain.devices import Gpu, IdStrategy, Snapshot
from gpuagent.domain.preferred import PairScores, best_gpu_set

VISIBLE_DEVICES = "NVIDIA_VISIBLE_DEVICES"
# nvidia-container-runtime reads device IDs from mounts under this directory in volume-mounts mode.
VOLUME_MOUNT_ROOT = "/var/run/nvidia-container-devices"
VOLUME_MOUNT_HOST_PATH = "/dev/null"
SUPPORTED_STRATEGIES = frozenset({"envvar", "volume-mounts"})


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


@dataclass(frozen=True, slots=True)
class AllocationPolicy:
    """Full GPUs only, one resource: the policy the service used before resources existed.

    Kept working (validation, ``envvar``/``volume-mounts``, topology-aware :meth:`preferred`)
    until the service is wired to :mod:`~gpuagent.domain.resources`,
    :mod:`~gpuagent.domain.containers` and :mod:`~gpuagent.domain.preferred`.
    """

    id_strategy: IdStrategy = IdStrategy.UUID
    list_strategies: tuple[str, ...] = ("envvar",)

    def resolve(self, snapshot: Snapshot, ids: Sequence[str]) -> list[Gpu]:
        """The GPUs named by ``ids``, or an :class:`AllocationError` naming every bad ID."""
        if not ids:
            raise EmptyRequestError("the request names no device IDs")
        duplicates = sorted(i for i, n in Counter(ids).items() if n > 1)
        if duplicates:
            raise DuplicateDevicesError(duplicates)
        known = snapshot.by_device_id(self.id_strategy)
        unknown = [i for i in ids if i not in known]
        if unknown:
            raise UnknownDevicesError(unknown)
        gpus = [known[i] for i in ids]
        sick = [g for g in gpus if not g.health.healthy]
        if sick:
            raise UnhealthyDevicesError(
                [g.device_id(self.id_strategy) for g in sick], [g.health.reason for g in sick]
            )
        return gpus

    def container_allocation(self, gpus: Sequence[Gpu]) -> ContainerAllocation:
        """The environment and mounts that hand ``gpus`` to a container."""
        ids = [g.device_id(self.id_strategy) for g in gpus]
        envs: dict[str, str] = {}
        mounts: list[MountSpec] = []
        if "envvar" in self.list_strategies:
            envs[VISIBLE_DEVICES] = ",".join(ids)
        if "volume-mounts" in self.list_strategies:
            # The runtime takes the device list from the mounts; the variable points at them.
            envs[VISIBLE_DEVICES] = VOLUME_MOUNT_ROOT
            mounts.extend(
                MountSpec(f"{VOLUME_MOUNT_ROOT}/{i}", VOLUME_MOUNT_HOST_PATH) for i in ids
            )
        return ContainerAllocation(envs=envs, mounts=tuple(mounts))

    def preferred(
        self,
        snapshot: Snapshot,
        available: Sequence[str],
        must_include: Sequence[str],
        size: int,
    ) -> list[str]:
        """Advice for the kubelet: ``size`` IDs from ``available`` that include ``must_include``.

        Chosen by :func:`gpuagent.domain.preferred.best_gpu_set` from the cached topology (NVLink,
        PCIe level, NUMA node). Best effort, never an error: possibly shorter than ``size`` when
        too few devices are available; IDs this agent does not know are skipped.
        """
        known = snapshot.by_device_id(self.id_strategy)
        chosen = list(dict.fromkeys(must_include))
        if size <= len(chosen):
            return chosen
        candidates = [i for i in dict.fromkeys(available) if i in known and i not in chosen]
        need = size - len(chosen)
        if len(candidates) <= need:
            return chosen + sorted(candidates, key=lambda i: known[i].index)
        fixed = [known[i].index for i in chosen if i in known]
        by_index = {known[i].index: i for i in candidates}
        picked = best_gpu_set(PairScores.of(snapshot), sorted(by_index), fixed, need)
        return chosen + [by_index[g] for g in picked]
