"""The snapshot: what the store holds and every consumer reads — the node's state and the plan it
is served under, as one value stamped with one version.

A consumer projects the snapshot it is given (:meth:`~gpuagent.state.store.DeviceStore.watch`)
and reads the plan from it, never from elsewhere: what it serves and the plan it serves it under
are of the same version. Below the plan, the domain reads the state alone
(:class:`~gpuagent.domain.devices.NodeState`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpuagent.domain.devices import NodeState
from gpuagent.domain.dra import unpublished_gpus
from gpuagent.domain.plan import Plan

__all__ = ["Snapshot"]


@dataclass(frozen=True, slots=True, eq=False)
class Snapshot(NodeState):
    """The node's state under ``plan``; every change of either is a new snapshot with a higher
    ``version`` (readers never see a partial update)."""

    version: int = 0
    plan: Plan = field(default_factory=Plan)

    def __eq__(self, other: object) -> bool:
        # The plan is compared on every store update and rarely changes: by identity first (a
        # dataclass's own __eq__ on Python 3.13 compares field by field, with no such short-cut).
        if not isinstance(other, Snapshot):
            return NotImplemented
        return (
            self.version == other.version
            and (self.plan is other.plan or self.plan == other.plan)
            and NodeState.__eq__(self, other)
        )

    __hash__ = NodeState.__hash__  # equal snapshots have equal states

    def unpublished_dra_gpus(self) -> tuple[int, ...]:
        """The GPUs given to DRA whose devices are in no ResourceSlice published: the device
        plugin leaves them out, so no pod can have them through either API (none while DRA is
        off)."""
        if self.dra_registration is None:
            return ()
        return unpublished_gpus(self.plan.dra.devices(self), self.dra_published)
