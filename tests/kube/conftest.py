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
from support.kubehealth import Writers
from support.noderig import NODE, Rig, new_writer
from support.synthetic import synthetic_snapshot

from gpuagent.state.store import DeviceStore


@pytest.fixture
def node_name() -> str:
    return NODE


@pytest.fixture
async def writers() -> AsyncIterator[Writers]:
    running = Writers()
    try:
        yield running
    finally:
        for task in running.tasks:
            task.cancel()
        await asyncio.gather(*running.tasks, return_exceptions=True)
        for api in running.apis:
            await api.close()


@pytest.fixture
def make_rig(apiserver: FakeApiServer, tmp_path: Path, writers: Writers) -> Callable[..., Any]:
    """Start a writer on an 8-GPU node (each GPU held by one pod) against ``apiserver``."""
    server = apiserver

    async def make(*, gpus: int = 8, **options: Any) -> Rig:
        store = DeviceStore(synthetic_snapshot(gpus, replicas=1))
        clock = ManualClock()
        draws = itertools.cycle([0.5, 0.25, 0.75, 0.1, 0.9])
        writer, api = new_writer(
            server, store, clock, lambda: next(draws), tmp_path / "kubeconfig", **options
        )
        writers.start(api, writer.run(), "node-health-under-test")
        rig = Rig(server, store, clock, writer, draws)
        await rig.settle()
        return rig

    return make
