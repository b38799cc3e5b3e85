"""Moving the node-health writer's clock and waiting until it has acted (no wall-clock sleeps)."""

from __future__ import annotations

from gpuagent.kube.nodehealth import NodeHealthWriter
from gpuagent.state.store import DeviceStore
from support.clock import ManualClock
from support.waiting import eventually

__all__ = ["settle"]


async def settle(
    clock: ManualClock, writer: NodeHealthWriter, store: DeviceStore, seconds: float = 0.0
) -> None:
    """Once the writer has seen the store as it is, let ``seconds`` of its time pass; return
    once it waits again (whatever was due in that time has been written, or tried)."""

    def caught_up() -> bool:
        return writer.seen_version == store.snapshot.version and clock.waiting >= 1

    await eventually(caught_up, what="the node-health writer waiting")
    await clock.advance(seconds)
    await eventually(caught_up, what="the node-health writer waiting")
