"""Moving an API writer's clock (the node-health writer's, the slice publisher's) and waiting
until it has acted (no wall-clock sleeps); the writers under test, ended with their test; the
rig both writers' tests build on."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from gpuagent.domain.snapshot import Snapshot
from gpuagent.kube.client import KubeApi
from gpuagent.state.store import DeviceStore
from support.clock import ManualClock
from support.fake_apiserver import FakeApiServer
from support.waiting import eventually

__all__ = ["ApiRig", "Follower", "Writers", "settle"]


class Follower(Protocol):
    """A writer following the store: the last store version it looked at."""

    @property
    def seen_version(self) -> int: ...


async def settle(
    clock: ManualClock, writer: Follower, store: DeviceStore, seconds: float = 0.0
) -> None:
    """Once the writer has seen the store as it is, let ``seconds`` of its time pass; return
    once it waits again (whatever was due in that time has been written, or tried)."""

    def caught_up() -> bool:
        return writer.seen_version == store.snapshot.version and clock.waiting >= 1

    await eventually(caught_up, what="the writer waiting")
    await clock.advance(seconds)
    await eventually(caught_up, what="the writer waiting")


F = TypeVar("F", bound=Follower)


@dataclass
class ApiRig(Generic[F]):
    """An API writer under test (``follower``) against the API-server stand-in, following
    ``store``, timed by ``clock``: the requests it made; the store changed, the writer settled."""

    server: FakeApiServer
    store: DeviceStore
    clock: ManualClock
    follower: F

    def requests(self, since: int = 0) -> list[tuple[str, str]]:
        return self.server.requests[since:]

    async def change(self, change: Callable[[Snapshot], Snapshot]) -> None:
        """Change the store; return once the writer has seen it and waits again."""
        self.store.update(change)
        await self.settle()

    async def settle(self, seconds: float = 0.0) -> None:
        await settle(self.clock, self.follower, self.store, seconds)


class Writers:
    """API writers under test, each a task with its own API connection; ended with the test."""

    def __init__(self) -> None:
        self.tasks: list[asyncio.Task[None]] = []
        self.apis: list[KubeApi] = []

    def start(self, api: KubeApi, run: Coroutine[Any, Any, None], name: str) -> None:
        self.apis.append(api)
        self.tasks.append(asyncio.create_task(run, name=name))
