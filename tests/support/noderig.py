"""A node-health writer on a synthetic 8-GPU node (each GPU held by one pod), timed by a clock the
test moves: the rig of tests/kube, and how a test changes the node's GPUs."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from gpuagent.domain.devices import Condition, GpuHealth
from gpuagent.domain.snapshot import Snapshot
from gpuagent.kube.client import KubeApi, load_config
from gpuagent.kube.nodehealth import NodeHealthWriter
from gpuagent.state.store import DeviceStore
from support.clock import ManualClock
from support.fake_apiserver import FakeApiServer
from support.kubehealth import ApiRig

__all__ = [
    "NODE", "WALL0", "Rig", "last_xid", "new_writer", "storm_xid", "with_health", "writing", "xid",
]  # fmt: skip

NODE = "gpu-node-7"
WALL0 = 1_767_225_600.0  # 2026-01-01T00:00:00Z at clock 0


@dataclass
class Rig(ApiRig[NodeHealthWriter]):
    draws: Iterator[float]

    @property
    def writer(self) -> NodeHealthWriter:
        return self.follower

    async def fail(self, index: int, *conditions: Condition) -> None:
        await self.change(lambda s: with_health(s, index, GpuHealth(conditions)))

    async def heal(self, index: int) -> None:
        await self.change(lambda s: with_health(s, index, GpuHealth()))


def with_health(snapshot: Snapshot, index: int, state: GpuHealth) -> Snapshot:
    gpus = tuple(replace(g, health=state) if g.index == index else g for g in snapshot.gpus)
    return replace(snapshot, gpus=gpus)


def xid(snapshot: Snapshot, index: int, code: int) -> Snapshot:
    """An XID event on GPU ``index`` as the health policy records it (counted; a checked XID
    replaces the GPU's XID condition)."""
    gpus = []
    for gpu in snapshot.gpus:
        if gpu.index == index:
            counts = dict(gpu.xid_counts)
            counts[code] = counts.get(code, 0) + 1
            kept = tuple(c for c in gpu.health.conditions if c.kind != "xid")
            health = GpuHealth((*kept, Condition("xid", str(code)))) if code != 13 else gpu.health
            gpus.append(replace(gpu, xid_counts=counts, last_xid=code, health=health))
        else:
            gpus.append(gpu)
    return replace(snapshot, gpus=tuple(gpus))


def storm_xid(index: int, code: int) -> Callable[[Snapshot], Snapshot]:
    return lambda s: xid(s, index, code)


def last_xid(minute: int) -> Callable[[Snapshot], Snapshot]:
    """A poll that changes a reading only (the writer wakes, its view stays)."""
    return lambda s: replace(s, gpus=tuple(replace(g, last_xid=minute) for g in s.gpus))


def new_writer(
    server: FakeApiServer,
    store: DeviceStore,
    clock: ManualClock,
    draw: Callable[[], float],
    kubeconfig: Path,
    **options: Any,
) -> tuple[NodeHealthWriter, KubeApi]:
    """A writer for ``store``'s node against ``server``, timed by ``clock`` (wall time is
    :data:`WALL0` at its zero), and its API connection (the caller closes it)."""
    api = KubeApi(load_config(server.kubeconfig(kubeconfig)), timeout=2.0)
    writer = NodeHealthWriter(
        store, api, node=server.node, clock=clock,
        wall=lambda: WALL0 + clock.now(), draw=draw, **options,
    )  # fmt: skip
    return writer, api


@contextlib.asynccontextmanager
async def writing(
    server: FakeApiServer, api: KubeApi, run: Coroutine[Any, Any, None]
) -> AsyncIterator[None]:
    """``run`` (an API writer's loop) as a task while inside; on leaving, the task cancelled,
    ``api`` closed and ``server`` stopped (the benches' rigs: each makes its own server)."""
    task = asyncio.create_task(run)
    try:
        yield
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await api.close()
        await server.stop()
