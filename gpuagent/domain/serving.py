"""What the device-plugin service serves: resources, allocation and preferences, per snapshot.

:class:`ResourceView` computes the node's resources once per snapshot under its plan's serving
policy, and the pair scores once per topology, so an RPC does a dictionary lookup, never a
rebuild and never an NVML call. A new plan is a new snapshot: the view follows it by itself.

Nothing is advertised before a container given it can start: where containers are given CDI
names and the agent writes the CDI spec, a device is in the resources only once the spec on disk
defines it (:attr:`NodeState.cdi <gpuagent.domain.devices.NodeState.cdi>`), and the first device
list waits for the first spec (:func:`awaits_cdi_spec`) — as NVIDIA's plugin writes its spec
before it registers. Nor is a replica shared through MPS while its control daemon is down
(:mod:`gpuagent.domain.mpsplan`): it is advertised unhealthy.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from gpuagent.domain.containers import CDI_KIND, ContainerSettings
from gpuagent.domain.devices import CdiSpec, NodeState, Topology
from gpuagent.domain.dra import DraGpus
from gpuagent.domain.errors import ResourceError
from gpuagent.domain.mps import MpsDaemon
from gpuagent.domain.mpsplan import gate_mps, mps_daemons
from gpuagent.domain.naming import mig_index
from gpuagent.domain.preferred import PairScores, SharedAllocationPolicy
from gpuagent.domain.resources import NodeResources, ResourceSettings, build_resources

__all__ = [
    "ResourceView",
    "ServingPolicy",
    "awaits_cdi_spec",
    "cdi_gated",
    "spec_devices",
]


@dataclass(frozen=True, slots=True)
class ServingPolicy:
    """Everything that shapes what the kubelet is offered and what a container receives."""

    resources: ResourceSettings = field(default_factory=ResourceSettings)
    containers: ContainerSettings = field(default_factory=ContainerSettings)
    shared_allocation: SharedAllocationPolicy = SharedAllocationPolicy.DISTRIBUTED
    # GPUs served through DRA: they leave the device plugin's resources (never in both).
    dra_gpus: DraGpus = field(default_factory=DraGpus)


class ResourceView:
    """The node's resources for the latest state under a serving policy (the snapshot's plan's),
    cached for that state and policy."""

    def __init__(self) -> None:
        self._state: NodeState | None = None
        self._policy: ServingPolicy | None = None
        self._resources = NodeResources()
        self._daemons: tuple[MpsDaemon, ...] = ()
        self._error = ""
        self._topology: Topology | None = None
        self._scores = PairScores()

    def resources(self, snapshot: NodeState, policy: ServingPolicy) -> NodeResources:
        """The resources of ``snapshot`` under ``policy``; empty (with :attr:`error` set) when
        they are invalid."""
        if snapshot is not self._state or policy is not self._policy:
            try:
                built = build_resources(
                    _device_plugin_gpus(snapshot, policy.dra_gpus), policy.resources
                )
                self._daemons = mps_daemons(built)
                self._resources = gate_mps(built, snapshot.mps, self._daemons)
                if snapshot.cdi is not None and cdi_gated(snapshot, policy.containers):
                    self._resources = _in_spec(self._resources, snapshot.cdi)
                self._error = ""
            except ResourceError as exc:
                self._resources = NodeResources()
                self._daemons = ()
                self._error = str(exc)
            self._state, self._policy = snapshot, policy
        return self._resources

    def mps_daemons(self, snapshot: NodeState, policy: ServingPolicy) -> tuple[MpsDaemon, ...]:
        """The MPS control daemons the resources of ``snapshot`` under ``policy`` need (from
        every device, whatever its health or the CDI spec's)."""
        self.resources(snapshot, policy)
        return self._daemons

    @property
    def error(self) -> str:
        """Why the last snapshot's resources could not be built, or empty."""
        return self._error

    def scores(self, snapshot: NodeState) -> PairScores:
        if snapshot.topology is not self._topology:
            self._scores = PairScores.of(snapshot)
            self._topology = snapshot.topology
        return self._scores


def cdi_gated(snapshot: NodeState, containers: ContainerSettings) -> bool:
    """Whether devices wait for the CDI spec: containers get CDI names of the spec this agent
    writes (not the container toolkit's)."""
    return snapshot.cdi is not None and containers.uses_cdi and containers.cdi_kind == CDI_KIND


def awaits_cdi_spec(snapshot: NodeState, containers: ContainerSettings) -> bool:
    """Whether the first device list must still wait: gated, and no spec written yet."""
    return cdi_gated(snapshot, containers) and not (snapshot.cdi and snapshot.cdi.written)


def spec_devices(snapshot: NodeState) -> frozenset[tuple[str, str]]:
    """The ``(UUID, index name)`` of every GPU and MIG device of ``snapshot``: what its CDI spec
    defines (:func:`gpuagent.nodefiles.cdi.build_spec`)."""
    pairs = set()
    for gpu in snapshot.gpus:
        pairs.add((gpu.uuid, str(gpu.index)))
        for position, mig in enumerate(gpu.mig_devices):
            pairs.add((mig.uuid, mig_index(gpu.index, position)))
    return frozenset(pairs)


def _in_spec(resources: NodeResources, spec: CdiSpec) -> NodeResources:
    """``resources`` with only the devices ``spec`` defines under both names (a resource left
    without devices stays, so its registration does too)."""
    kept = tuple(
        replace(r, devices=tuple(d for d in r.devices if (d.uuid, d.index) in spec.devices))
        for r in resources.resources
    )
    return replace(resources, resources=kept)


def _device_plugin_gpus(snapshot: NodeState, dra: DraGpus) -> NodeState:
    """``snapshot`` without the GPUs DRA serves."""
    if not dra.enabled:
        return snapshot
    return replace(snapshot, gpus=tuple(g for g in snapshot.gpus if not dra.owns(g)))
