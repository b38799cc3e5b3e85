"""Start-up that survives a slow driver: per-call limits, a budget, nothing queued behind a hang.

Each case runs the monitor's start-up against the strict simulator with per-call latency, a
cold-start cost, or a GPU whose discovery call does not return.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType

import pytest
import structlog.testing
from support.backends import Delegating
from support.clock import Sleeps
from support.waiting import eventually

from gpu.monitoring import until
from gpuagent.domain.devices import Gpu
from gpuagent.domain.snapshot import Snapshot
from gpuagent.gpu.calls import NO_GPU, NvmlCalls
from gpuagent.gpu.monitor import GpuMonitor
from gpuagent.gpu.nvml import Nvml
from gpuagent.gpu.sim import SimDriver, installed, node_from_count
from gpuagent.gpu.sim.spec import SimLatency, SimNode
from gpuagent.gpu.startup import startup_budget
from gpuagent.state.store import DeviceStore

WAIT_S = 30.0


def slow(gpus: int, per_call_s: float, cold_s: float = 0.0) -> SimNode:
    """``gpus`` simulated GPUs where every call takes ``per_call_s`` (event waits excepted)."""
    latency = SimLatency(
        default_s=per_call_s,
        calls=MappingProxyType({"nvmlEventSetWait_v2": 0.0, "nvmlErrorString": 0.0}),
        cold_start_s=cold_s,
    )
    return replace(node_from_count(gpus), latency=latency)


def monitor(
    store: DeviceStore, backend: Nvml | Delegating, *, call_timeout: float = 10.0, **kw: float
) -> GpuMonitor:
    return GpuMonitor(
        store,
        backend,
        poll_interval=60.0,
        call_timeout=call_timeout,
        event_wait_ms=50,
        **kw,  # type: ignore[arg-type]
    )


@contextlib.asynccontextmanager
async def held_start(mon: GpuMonitor, sleeps: Sleeps) -> AsyncIterator[asyncio.Task[None]]:
    """``mon.start()`` as a task, against a driver whose held sleeps the test releases; on the
    way out the sleeps are released, the start is over and the monitor closed."""
    starting = asyncio.create_task(mon.start())
    try:
        yield starting
    finally:
        sleeps.release()
        await asyncio.gather(starting, return_exceptions=True)
        await asyncio.wait_for(mon.close(), WAIT_S)


def test_budget_scales_with_the_gpu_count() -> None:
    assert startup_budget(1) == 15.0
    assert startup_budget(8) == 50.0
    assert startup_budget(8, nvml_timeout=12.0) == 12.0


@pytest.mark.asyncio(loop_factories=["uvloop"])
async def test_eight_gpus_are_discovered_at_once(store: DeviceStore, tmp_path: Path) -> None:
    """A slow driver: all 8 GPUs are discovered GPU by GPU at once, and while that runs the store
    says what start-up waits for.

    Each GPU's discovery is held in one call until all eight are in it together; in turn, a
    driver answering every call in 100 ms would take about 18 s for the ~180 calls.
    """
    named = replace(node_from_count(8), latency=SimLatency(0.0, {"nvmlDeviceGetName": 0.1}))
    sleeps = Sleeps(hold=0.1)
    with installed(SimDriver(named, sleep=sleeps)) as driver:
        mon = monitor(store, Nvml(tmp_path))
        async with held_start(mon, sleeps) as starting:
            await eventually(lambda: len(sleeps.asked) == 8, what="eight discoveries at once")
            assert len({thread for _, thread in sleeps.asked}) == 8

            def waiting_in_a_call() -> str:
                waiting = store.snapshot.driver.waiting
                return waiting if "nvmlDeviceGetName" in waiting else ""

            waiting = await eventually(waiting_in_a_call, what="the call start-up waits in")
            assert waiting.startswith("discovering gpus: gpu")
            assert not starting.done()
            sleeps.release()
            await asyncio.wait_for(starting, WAIT_S)
        snapshot = store.snapshot
        assert snapshot.discovered
        assert len(snapshot.gpus) == 8
        assert all(g.health.healthy and g.name for g in snapshot.gpus)
        assert sum(1 for link in snapshot.topology.links if link.nvlinks) == 28
        assert snapshot.driver.waiting == ""
        assert sum(driver.calls.values()) > 150  # the work was there
        assert sleeps.seconds == [0.1] * 8  # one name per GPU


class HangsInDiscovery(Delegating):
    """GPU ``gpu``'s discovery names the GPU, then blocks in a driver call until released."""

    def __init__(self, inner: Nvml, gpu: int) -> None:
        super().__init__(inner)
        self.gpu = gpu
        self.release = threading.Event()
        self.described: list[int] = []

    def describe(self, index: int) -> Gpu:
        self.described.append(index)
        gpu = self.inner.describe(index)
        if index == self.gpu:
            self.calls.call(index, self.release.wait, WAIT_S, name="nvmlDeviceGetName")
        return gpu


def described_and_healthy(snapshot: Snapshot, index: int) -> bool:
    gpu = snapshot.gpu(index)
    return gpu is not None and bool(gpu.name) and gpu.health.healthy


async def test_hung_gpu_is_advertised_unresponsive_then_taken_in(
    store: DeviceStore, tmp_path: Path
) -> None:
    """A GPU stuck past the per-call limit in discovery does not hold up the others.

    It is advertised unhealthy (``unresponsive``, naming the call), no job is queued behind the
    stuck one, and once the call returns the GPU is described and healthy.
    """
    with installed(SimDriver(node_from_count(4))):
        backend = HangsInDiscovery(Nvml(tmp_path), gpu=2)
        mon = monitor(store, backend, call_timeout=0.3)
        task = None
        try:
            with structlog.testing.capture_logs() as logs:
                await asyncio.wait_for(mon.start(), WAIT_S)
            snapshot = store.snapshot
            assert snapshot.discovered
            stuck = snapshot.gpu(2)
            assert stuck is not None
            assert [c.kind for c in stuck.health.conditions] == ["unresponsive"]
            assert "nvmlDeviceGetName" in stuck.health.reason
            assert all(g.health.healthy for g in snapshot.gpus if g.index != 2)
            assert any(e["event"].startswith("nvml call did not return") for e in logs)
            task = asyncio.create_task(mon.run())
            for _ in range(3):
                await mon.poll_once()
            assert backend.described.count(2) == 1  # nothing queued behind the stuck call
            backend.release.set()
            snapshot = await until(store, lambda s: described_and_healthy(s, 2), within=WAIT_S)
            late, first = snapshot.gpu(2), snapshot.gpu(0)
            assert late is not None
            assert first is not None
            assert (late.name, late.memory_mib) == (first.name, first.memory_mib)
        finally:
            backend.release.set()
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            await asyncio.wait_for(mon.close(), WAIT_S)


async def test_budget_exceeded_names_the_setting(store: DeviceStore, tmp_path: Path) -> None:
    """Past ``--nvml-timeout`` start-up goes on with what it has and says so, naming the option;
    what was missing is taken in when it arrives."""
    named = replace(node_from_count(4), latency=SimLatency(0.0, {"nvmlDeviceGetName": 0.05}))
    sleeps = Sleeps(hold=0.05)  # every GPU's discovery waits until the test releases it
    with installed(SimDriver(named, sleep=sleeps)):
        mon = monitor(store, Nvml(tmp_path), nvml_timeout=0.3)
        try:
            with structlog.testing.capture_logs() as logs:
                await asyncio.wait_for(mon.start(), WAIT_S)
            exceeded = [e for e in logs if "--nvml-timeout" in e["event"]]
            assert len(exceeded) == 1
            assert exceeded[0]["nvml_timeout_s"] == 0.3
            assert "gpu" in exceeded[0]["still_waiting_for"]
            assert store.snapshot.discovered
            assert not all(g.name for g in store.snapshot.gpus)
            sleeps.release()
            snapshot = await until(
                store, lambda s: len(s.gpus) == 4 and all(g.name for g in s.gpus), within=WAIT_S
            )
            assert all(g.health.healthy for g in snapshot.gpus)
        finally:
            sleeps.release()
            await asyncio.wait_for(mon.close(), WAIT_S)


@pytest.mark.asyncio(loop_factories=["uvloop"])
async def test_cold_node(store: DeviceStore, tmp_path: Path) -> None:
    """Cold GPUs (no persistence mode) are brought up at once, not one after another: all eight
    bring-ups are under way together (how long that takes on a real clock: scripts/bench)."""
    sleeps = Sleeps(hold=0.5)
    with installed(SimDriver(slow(8, 0.0, cold_s=0.5), sleep=sleeps)):
        mon = monitor(store, Nvml(tmp_path))
        async with held_start(mon, sleeps) as starting:
            await eventually(lambda: len(sleeps.asked) == 8, what="eight bring-ups at once")
            assert not starting.done()
            assert len({thread for _, thread in sleeps.asked}) == 8
            sleeps.release()
            await asyncio.wait_for(starting, WAIT_S)
    assert len(store.snapshot.gpus) == 8
    assert sleeps.seconds == [0.5] * 8  # one bring-up per GPU


def test_calls_in_flight_name_the_call() -> None:
    """The call helper says which call each thread is in, and since when."""
    calls = NvmlCalls()
    inside = threading.Event()
    release = threading.Event()

    def block() -> None:
        inside.set()
        release.wait(WAIT_S)

    thread = threading.Thread(target=calls.call, args=(NO_GPU, block), kwargs={"name": "nvmlX"})
    thread.start()
    try:
        assert inside.wait(WAIT_S)
        (flight,) = calls.in_flight(thread.ident)
        assert (flight.gpu, flight.name) == (NO_GPU, "nvmlX")
    finally:
        release.set()
        thread.join(WAIT_S)
    assert calls.in_flight() == []
    assert dict(calls.stats())["nvmlX"].count == 1
