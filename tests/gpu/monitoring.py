"""Running the NVML poller on the simulated driver in tests: a monitor, its run, its store."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import pytest
from support.tasks import running as running_task

from gpuagent.domain.devices import Gpu, Telemetry
from gpuagent.domain.health import HealthPolicy
from gpuagent.domain.plan import Plan
from gpuagent.domain.snapshot import Snapshot
from gpuagent.gpu.backend import Backend
from gpuagent.gpu.monitor import GpuMonitor
from gpuagent.state.store import DeviceStore

__all__ = [
    "EVENT_WAIT_MS",
    "GPUS",
    "POLL",
    "WAIT_S",
    "gpu",
    "healthy_except",
    "monitor_for",
    "probed",
    "running",
    "until",
]

#: The simulated node of the ``driver`` fixture (tests/gpu/conftest.py).
GPUS = 4
POLL = 0.02
EVENT_WAIT_MS = 50
# A deadline for what must happen, never a wait: generous, for a machine shared by parallel suites.
WAIT_S = 15.0


def monitor_for(
    store: DeviceStore,
    nvml: Backend,
    policy: HealthPolicy | None = None,
    *,
    poll_interval: float = POLL,
    call_timeout: float = 2.0,
    init_retry_interval: float = 10.0,
) -> GpuMonitor:
    if policy is not None:
        store.publish(Plan(health=policy))
    return GpuMonitor(
        store,
        nvml,
        poll_interval=poll_interval,
        init_retry_interval=init_retry_interval,
        call_timeout=call_timeout,
        event_wait_ms=EVENT_WAIT_MS,
    )


@asynccontextmanager
async def running(monitor: GpuMonitor) -> AsyncIterator[asyncio.Task[None]]:
    """``monitor.run()`` as a task; cancelled and the monitor closed on the way out."""
    try:
        async with running_task(monitor.run()) as task:
            yield task
    finally:
        await asyncio.wait_for(monitor.close(), WAIT_S)


async def until(
    store: DeviceStore, predicate: Callable[[Snapshot], bool], *, within: float = WAIT_S
) -> Snapshot:
    """The first snapshot (current or newer) satisfying ``predicate``; fails after ``within``."""
    snapshot = store.snapshot
    try:
        async with asyncio.timeout(within):
            async for snapshot in store.watch(lambda s: s):
                if predicate(snapshot):
                    return snapshot
    except TimeoutError:
        pass
    pytest.fail(f"not reached within {within}s; last snapshot: {snapshot}")


def gpu(snapshot: Snapshot, index: int) -> Gpu:
    found = snapshot.gpu(index)
    assert found is not None, f"no GPU {index} in {snapshot}"
    return found


def probed(snapshot: Snapshot) -> bool:
    """Every GPU has been probed at least once (telemetry present)."""
    return len(snapshot.gpus) == GPUS and all(g.telemetry != Telemetry() for g in snapshot.gpus)


def healthy_except(snapshot: Snapshot, index: int) -> bool:
    return all(g.health.healthy for g in snapshot.gpus if g.index != index)
