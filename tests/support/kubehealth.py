"""Moving an API writer's clock (the node-health writer's, the slice publisher's) and waiting
until it has acted (no wall-clock sleeps); the writers under test, ended with their test."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, Protocol

from gpuagent.kube.client import KubeApi
from gpuagent.state.store import DeviceStore
from support.clock import ManualClock
from support.waiting import eventually

__all__ = ["Follower", "Writers", "settle"]


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


class Writers:
    """API writers under test, each a task with its own API connection; ended with the test."""

    def __init__(self) -> None:
        self.tasks: list[asyncio.Task[None]] = []
        self.apis: list[KubeApi] = []

    def start(self, api: KubeApi, run: Coroutine[Any, Any, None], name: str) -> None:
        self.apis.append(api)
        self.tasks.append(asyncio.create_task(run, name=name))
