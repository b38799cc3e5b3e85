"""The plan: the configuration as the domain uses it, kept in the store with a generation.

Everything a reload may change lives here, and every consumer derives from the store's current
plan when it needs it — the resources offered to the kubelet and what a container receives
(:class:`~gpuagent.domain.serving.ResourceView`), the node labels and the CDI spec, the resource
names pods are attributed by, the health policy. A reload is one publication
(:meth:`~gpuagent.state.store.DeviceStore.publish`): no consumer can be left behind.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpuagent.domain.dra import DraPlan
from gpuagent.domain.health import HealthPolicy
from gpuagent.domain.serving import ServingPolicy

__all__ = ["Plan"]


@dataclass(frozen=True, slots=True)
class Plan:
    """What to serve and how to judge health; ``generation`` counts the reloads that changed it."""

    serving: ServingPolicy = field(default_factory=ServingPolicy)
    health: HealthPolicy = field(default_factory=HealthPolicy)
    dra: DraPlan = field(default_factory=DraPlan)
    generation: int = 0

    @property
    def served_resources(self) -> frozenset[str]:
        """The resource names this agent may advertise (sharing targets included), by
        which pods are attributed; MIG resources (``<domain>/mig-…``) are recognised anyway."""
        resources = self.serving.resources
        return frozenset(
            {resources.resource_name, *resources.replication.names()}
            | {f"{resources.resource_name}.shared"}
        )

    @property
    def writes_cdi_spec(self) -> bool:
        """Whether containers are given CDI names, so the node needs the CDI spec."""
        return self.serving.containers.uses_cdi
