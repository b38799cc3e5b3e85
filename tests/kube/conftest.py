"""Fixtures of the node-health writer's tests: the API-server stand-in and writer rigs."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from support.clock import ManualClock
from support.fake_apiserver import FakeApiServer
from support.noderig import NODE, WALL0, Rig
from support.synthetic import synthetic_snapshot

from gpuagent.domain.plan import Plan
from gpuagent.kube.client import KubeApi, load_config
from gpuagent.kube.nodehealth import NodeHealthWriter
from gpuagent.state.store import DeviceStore


@pytest.fixture
async def server() -> AsyncIterator[FakeApiServer]:
    fake = FakeApiServer(node=NODE)
    await fake.start()
    try:
        yield fake
    finally:
        await fake.stop()


@pytest.fixture
async def make_rig(server: FakeApiServer, tmp_path: Path) -> AsyncIterator[Callable[..., Any]]:
    """Start a writer on an 8-GPU node (each GPU held by one pod) against ``server``."""
    tasks: list[asyncio.Task[None]] = []
    apis: list[KubeApi] = []

    async def make(*, gpus: int = 8, **options: Any) -> Rig:
        store = DeviceStore(synthetic_snapshot(gpus, replicas=1))
        clock = ManualClock()
        draws = itertools.cycle([0.5, 0.25, 0.75, 0.1, 0.9])
        api = KubeApi(load_config(server.kubeconfig(tmp_path / "kubeconfig")), timeout=2.0)
        apis.append(api)
        writer = NodeHealthWriter(
            store, api, node=NODE, served=lambda: Plan().served_resources,
            clock=clock, wall=lambda: WALL0 + clock.now(), draw=lambda: next(draws),
            **options,
        )  # fmt: skip
        tasks.append(asyncio.create_task(writer.run(), name="node-health-under-test"))
        rig = Rig(server, store, clock, writer, draws)
        await rig.settle()
        return rig

    try:
        yield make
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for api in apis:
            await api.close()
