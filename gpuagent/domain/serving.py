"""What the device-plugin service serves: resources, allocation and preferences, per snapshot.

:class:`ResourceView` computes the node's resources once per snapshot version under the store's
plan, and the pair scores once per topology, so an RPC does a dictionary lookup, never a rebuild
and never an NVML call. A new plan is a new snapshot version: the view follows it by itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from gpuagent.domain.containers import ContainerSettings
from gpuagent.domain.devices import Snapshot, Topology
from gpuagent.domain.dra import DraGpus
from gpuagent.domain.errors import ResourceError
from gpuagent.domain.preferred import PairScores, SharedAllocationPolicy
from gpuagent.domain.resources import NodeResources, ResourceSettings, build_resources

if TYPE_CHECKING:
    from gpuagent.domain.store import DeviceStore

__all__ = ["ResourceView", "ServingPolicy"]


@dataclass(frozen=True, slots=True)
class ServingPolicy:
    """Everything that shapes what the kubelet is offered and what a container receives."""

    resources: ResourceSettings = field(default_factory=ResourceSettings)
    containers: ContainerSettings = field(default_factory=ContainerSettings)
    shared_allocation: SharedAllocationPolicy = SharedAllocationPolicy.DISTRIBUTED
    # GPUs served through DRA: they leave the device plugin's resources (never in both).
    dra_gpus: DraGpus = field(default_factory=DraGpus)


class ResourceView:
    """The node's resources for the latest snapshot under the store's plan, cached by version."""

    def __init__(self, store: DeviceStore) -> None:
        self._store = store
        self._version = -1
        self._resources = NodeResources()
        self._error = ""
        self._topology: Topology | None = None
        self._scores = PairScores()

    @property
    def policy(self) -> ServingPolicy:
        """The serving policy of the store's current plan."""
        return self._store.plan.serving

    def resources(self, snapshot: Snapshot) -> NodeResources:
        """The resources of ``snapshot``; empty (with :attr:`error` set) when they are invalid."""
        if snapshot.version != self._version:
            try:
                self._resources = build_resources(
                    _device_plugin_gpus(snapshot, self.policy.dra_gpus), self.policy.resources
                )
                self._error = ""
            except ResourceError as exc:
                self._resources = NodeResources()
                self._error = str(exc)
            self._version = snapshot.version
        return self._resources

    @property
    def error(self) -> str:
        """Why the last snapshot's resources could not be built, or empty."""
        return self._error

    def scores(self, snapshot: Snapshot) -> PairScores:
        if snapshot.topology is not self._topology:
            self._scores = PairScores.of(snapshot)
            self._topology = snapshot.topology
        return self._scores


def _device_plugin_gpus(snapshot: Snapshot, dra: DraGpus) -> Snapshot:
    """``snapshot`` without the GPUs DRA serves."""
    if not dra.enabled:
        return snapshot
    return replace(snapshot, gpus=tuple(g for g in snapshot.gpus if not dra.owns(g)))
