"""Allocation policy: validating the kubelet's requests and shaping what a container receives."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from gpuagent.domain.devices import Gpu, IdStrategy, Snapshot

VISIBLE_DEVICES = "NVIDIA_VISIBLE_DEVICES"
# nvidia-container-runtime reads device IDs from mounts under this directory in volume-mounts mode.
VOLUME_MOUNT_ROOT = "/var/run/nvidia-container-devices"
SUPPORTED_STRATEGIES = frozenset({"envvar", "volume-mounts"})


class AllocationError(Exception):
    """A request the agent refuses; the message names the offending device IDs."""


class EmptyRequestError(AllocationError):
    """The request names no devices."""


class UnknownDevicesError(AllocationError):
    """The request names IDs this agent does not advertise."""

    def __init__(self, ids: Sequence[str]) -> None:
        self.ids = tuple(ids)
        super().__init__(f"unknown device IDs: {', '.join(self.ids)}")


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


@dataclass(frozen=True, slots=True)
class MountSpec:
    container_path: str
    host_path: str
    read_only: bool = True


@dataclass(frozen=True, slots=True)
class ContainerAllocation:
    """What one container receives, independent of the wire format."""

    envs: Mapping[str, str] = field(default_factory=dict)
    mounts: tuple[MountSpec, ...] = ()


@dataclass(frozen=True, slots=True)
class AllocationPolicy:
    """How requests are validated and answered (device-ID and device-list strategies)."""

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
            mounts.extend(MountSpec(f"{VOLUME_MOUNT_ROOT}/{i}", "/dev/null") for i in ids)
        return ContainerAllocation(envs=envs, mounts=tuple(mounts))

    def preferred(
        self,
        snapshot: Snapshot,
        available: Sequence[str],
        must_include: Sequence[str],
        size: int,
    ) -> list[str]:
        """Advice for the kubelet: ``size`` IDs from ``available`` that include ``must_include``.

        Devices sharing a NUMA node with those already chosen come first, then lower indexes. The
        kubelet treats the answer as a hint, so it is best effort: never an error, possibly shorter
        than ``size`` when too few devices are available.
        """
        known = snapshot.by_device_id(self.id_strategy)
        chosen = list(dict.fromkeys(must_include))
        if size <= len(chosen):
            return chosen
        candidates = [i for i in dict.fromkeys(available) if i in known and i not in chosen]
        nodes = Counter(known[i].numa_node for i in chosen if i in known)

        def rank(device_id: str) -> tuple[int, int]:
            gpu = known[device_id]
            return (-nodes.get(gpu.numa_node, 0), gpu.index)

        while len(chosen) < size and candidates:
            best = min(candidates, key=rank)
            candidates.remove(best)
            chosen.append(best)
            nodes[known[best].numa_node] += 1
        return chosen
