"""The event thread (`gpuagent.gpu.eventthread`) and closing the monitor: event waits on a
driver that misbehaves, and a release of the driver that never happens under a call."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from pathlib import Path

import pynvml
import pytest
import structlog.testing
from support.backends import Delegating
from support.tasks import awaiting
from support.waiting import eventually

from gpu.monitoring import (
    EVENT_WAIT_MS,
    GPUS,
    POLL,
    WAIT_S,
    gpu,
    monitor_for,
    probed,
    running,
    until,
)
from gpuagent.domain.devices import Condition, Topology
from gpuagent.gpu.backend import DriverEvent, DriverUnavailable
from gpuagent.gpu.monitor import GpuMonitor
from gpuagent.gpu.nvml import Nvml
from gpuagent.gpu.sim import SimDriver
from gpuagent.state.store import DeviceStore


# ----- close -------------------------------------------------------------------------------------
def nvml_threads() -> dict[str, threading.Thread]:
    return {t.name: t for t in threading.enumerate() if t.name.startswith("nvml-")}


async def test_close_is_prompt_and_stops_threads(
    store: DeviceStore, driver: SimDriver, tmp_path: Path
) -> None:
    """close() returns at once; every thread of the monitor ends, and the driver is released
    (by the event thread, once its wait has returned) without a release under a wait."""
    before = set(nvml_threads().values())
    monitor = monitor_for(store, Nvml(tmp_path))
    threads: dict[str, threading.Thread] = {}
    task = asyncio.create_task(monitor.run())
    try:
        await until(store, probed)
        threads = {name: t for name, t in nvml_threads().items() if t not in before}
        assert {"nvml-events", "nvml-control", "nvml-poll"} <= set(threads)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await asyncio.wait_for(monitor.close(), WAIT_S)
    await asyncio.wait_for(monitor.wait_closed(), WAIT_S)
    for thread in threads.values():
        thread.join(WAIT_S)
        assert not thread.is_alive(), thread.name
    assert driver.calls["nvmlEventSetFree"] == 1
    assert driver.calls["nvmlShutdown"] == 1
    assert driver.misuse == []


async def test_close_leaves_a_wait_to_finish(
    store: DeviceStore, driver: SimDriver, tmp_path: Path
) -> None:
    """With the production wait (5 s), close() neither waits for the event wait nor frees the
    set or shuts NVML down under it (nvml.h allows neither); the event thread releases both
    when its wait returns."""
    nvml = Nvml(tmp_path)
    monitor = GpuMonitor(store, nvml, poll_interval=POLL, call_timeout=2.0)
    task = asyncio.create_task(monitor.run())
    try:
        await until(store, probed)
        await eventually(
            lambda: [c for c in nvml.calls.in_flight() if c.name == "nvmlEventSetWait_v2"],
            within=WAIT_S,
            what="an event wait in progress",
        )
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await asyncio.wait_for(monitor.close(), WAIT_S)
    # close() has returned with the wait still blocked, and nothing released under it.
    assert [c.name for c in nvml.calls.in_flight()] == ["nvmlEventSetWait_v2"]
    assert driver.calls["nvmlEventSetFree"] == 0
    assert driver.calls["nvmlShutdown"] == 0
    driver.interrupt_waits()  # as an interrupt ends a real wait early (nvml.h)
    await asyncio.wait_for(monitor.wait_closed(), WAIT_S)
    assert driver.calls["nvmlEventSetFree"] == 1
    assert driver.calls["nvmlShutdown"] == 1
    assert driver.misuse == []


async def test_event_wait_is_long_and_failures_back_off_from_half_a_second(
    store: DeviceStore, driver: SimDriver, tmp_path: Path
) -> None:
    """The production event wait blocks 5 s (a timed-out wait costs an NVML call each time, so
    it should be rare); failing waits are still retried after 0.5 s at first."""
    nvml = WaitRecorder(tmp_path)
    monitor = GpuMonitor(store, nvml, poll_interval=30.0, call_timeout=2.0)
    with structlog.testing.capture_logs() as logs:
        async with running(monitor):
            await until(store, probed)
            await eventually(lambda: nvml.timeouts, within=WAIT_S, what="an event wait")
            driver.inject(1, "call_error", symbol="nvmlEventSetWait_v2", error="unknown")
            driver.interrupt_waits()
            await eventually(
                lambda: [e for e in logs if e["event"] == "event wait failed; probing all gpus"],
                within=WAIT_S,
                what="a failed event wait",
            )
            driver.inject(1, "recover")
    assert set(nvml.timeouts) == {5000}
    pauses = [e["retry_in_s"] for e in logs if e["event"] == "event wait failed; probing all gpus"]
    assert pauses[0] == 0.5


class WaitRecorder(Delegating):
    """Records the timeout of every event wait."""

    def __init__(self, sysfs_root: Path) -> None:
        super().__init__(Nvml(sysfs_root))
        self.timeouts: list[int] = []

    def wait_event(self, timeout_ms: int) -> DriverEvent | None:
        self.timeouts.append(timeout_ms)
        return self.inner.wait_event(timeout_ms)


async def test_cancel_as_a_poll_is_asked_for_stops_the_monitor(
    store: DeviceStore, driver: SimDriver, tmp_path: Path
) -> None:
    """A cancellation that arrives as the event thread asks for a poll (a failed wait) ends
    run(); it is not swallowed with the wake-up (asyncio.wait_for before Python 3.12 does)."""
    monitor = monitor_for(store, Nvml(tmp_path), poll_interval=60.0)
    task = asyncio.create_task(monitor.run())
    try:
        await until(store, probed)
        await eventually(lambda: awaiting(task) == ["run", "wait"], what="run() in its poll wait")
        monitor._poll_now.set()
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=WAIT_S)
        assert task in done, "run() went on after it was cancelled"
        assert task.cancelled()
    finally:
        task.cancel()
        await asyncio.wait({task})
        await asyncio.wait_for(monitor.close(), WAIT_S)


class SlowTopology(Delegating):
    """A topology refresh that blocks until released; records it and NVML's shutdown in order."""

    def __init__(self, sysfs_root: Path) -> None:
        super().__init__(Nvml(sysfs_root))
        self.started = threading.Event()
        self.release = threading.Event()
        self.order: list[str] = []

    def refresh_topology(self) -> Topology:
        self.started.set()
        self.release.wait(WAIT_S)
        topology = self.inner.refresh_topology()
        self.order.append("topology read")
        return topology

    def shutdown(self) -> None:
        self.order.append("shutdown")
        self.inner.shutdown()


async def test_close_lets_a_topology_read_finish_then_releases_the_driver(
    store: DeviceStore, driver: SimDriver, tmp_path: Path
) -> None:
    """close() during a topology refresh waits for it (up to the per-call limit) and then shuts
    NVML down: no NVML call runs after nvmlShutdown, and the driver is not left unreleased."""
    nvml = SlowTopology(tmp_path)
    monitor = monitor_for(store, nvml)
    await monitor.start()
    monitor._spawn_refresh()  # as a GPU taken in late, or back on the bus, does
    assert await asyncio.to_thread(nvml.started.wait, WAIT_S)
    closing = asyncio.create_task(monitor.close())
    await eventually(
        lambda: awaiting(closing)[:2] == ["close", "finish_running"], what="close() in its wait"
    )
    assert not closing.done()  # waiting for the read
    nvml.release.set()
    await asyncio.wait_for(closing, WAIT_S)
    assert nvml.order == ["topology read", "shutdown"]
    assert driver.calls["nvmlShutdown"] == 1


async def test_cancel_as_a_topology_refresh_returns_drops_it(
    store: DeviceStore, driver: SimDriver, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A refresh cancelled (by close()) in the turn its read returns ends without writing the
    topology into the store; asyncio.wait_for before Python 3.12 swallowed the cancellation."""
    monitor = monitor_for(store, Nvml(tmp_path))
    await monitor.start()
    try:
        before = store.snapshot.topology
        assert before != Topology()
        answer: asyncio.Future[Topology] = asyncio.get_running_loop().create_future()
        monkeypatch.setattr(monitor._lanes.control, "submit", lambda _fn: answer)
        monitor._spawn_refresh()
        (task,) = monitor._background
        # The refresh waits for its read.
        await eventually(lambda: awaiting(task) == ["_refresh_topology"], what="the refresh's wait")
        answer.set_result(Topology())  # the read returns in the same turn as the cancel
        task.cancel()
        await asyncio.wait({task}, timeout=WAIT_S)
        assert task.cancelled()
        assert store.snapshot.topology == before
    finally:
        monkeypatch.undo()
        await asyncio.wait_for(monitor.close(), WAIT_S)


async def test_close_after_failed_start(
    store: DeviceStore, driver: SimDriver, tmp_path: Path
) -> None:
    """close() after a start that never reached the driver does not shut NVML down."""
    driver.fail("nvmlInitWithFlags", pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
    monitor = monitor_for(store, Nvml(tmp_path))
    with pytest.raises(DriverUnavailable):
        await monitor.start()
    await asyncio.wait_for(monitor.close(), WAIT_S)
    assert driver.calls["nvmlShutdown"] == 0


# ----- the event loop on a driver that misbehaves ------------------------------------------------
async def test_lost_gpu_leaves_the_event_set_and_comes_back(
    store: DeviceStore, driver: SimDriver, tmp_path: Path
) -> None:
    """A set holding a lost GPU fails every wait: it is rebuilt without it, and with it again
    once it answers, so XIDs keep arriving for every GPU that can have them."""
    nvml = Nvml(tmp_path)
    monitor = monitor_for(store, nvml)
    async with running(monitor):
        await until(store, probed)
        driver.inject(2, "lost")
        await until(store, lambda s: Condition("lost") in gpu(s, 2).health.conditions)
        # Registered: 4 at start, then 3 on a fresh set without the lost GPU.
        await until(store, lambda s: driver.calls["nvmlDeviceRegisterEvents"] >= 4 + 3)
        failed = dict(nvml.calls.stats())["nvmlEventSetWait_v2"].errors
        driver.inject(0, "xid", 48)  # only events carry XIDs
        await until(store, lambda s: Condition("xid", "48") in gpu(s, 0).health.conditions)
        assert dict(nvml.calls.stats())["nvmlEventSetWait_v2"].errors == failed
        driver.inject(2, "recover")
        await until(store, lambda s: Condition("lost") not in gpu(s, 2).health.conditions)
        # Registered: 4 at start, 3 without the lost GPU, 4 again once it answers.
        await until(store, lambda s: driver.calls["nvmlDeviceRegisterEvents"] >= 4 + 3 + 4)
        driver.inject(2, "xid", 48)
        await until(store, lambda s: Condition("xid", "48") in gpu(s, 2).health.conditions)


async def test_failing_waits_back_off(
    store: DeviceStore, driver: SimDriver, tmp_path: Path
) -> None:
    """Waits that keep failing are retried after 50 ms, 100 ms, 200 ms …, up to the cap; all
    GPUs are probed each time; once a wait works the pause is over."""
    monitor = GpuMonitor(
        store,
        Nvml(tmp_path),
        poll_interval=30.0,
        call_timeout=2.0,
        event_wait_ms=EVENT_WAIT_MS,
        event_backoff_max=0.2,
    )
    with structlog.testing.capture_logs() as logs:
        async with running(monitor):
            await until(store, probed)
            driver.inject(1, "call_error", symbol="nvmlEventSetWait_v2", error="unknown")
            probes = dict(monitor.call_totals())["probe"].count
            for _ in range(5 * 100):
                if sum(e["event"] == "event wait failed; probing all gpus" for e in logs) >= 5:
                    break
                await asyncio.sleep(0.01)
            assert dict(monitor.call_totals())["probe"].count >= probes + 4 * GPUS
            driver.inject(1, "recover")
            for _ in range(5 * 100):
                if any(e["event"] == "event waits work again" for e in logs):
                    break
                await asyncio.sleep(0.01)
    pauses = [e["retry_in_s"] for e in logs if e["event"] == "event wait failed; probing all gpus"]
    assert pauses[:5] == [0.05, 0.1, 0.2, 0.2, 0.2]
    assert any(e["event"] == "event waits work again" for e in logs)
