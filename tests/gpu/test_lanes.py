"""Hung-call isolation (`gpuagent.gpu.lanes`): a GPU whose call does not return stalls only
itself; probes share one thread, a hung GPU keeps its own until its call returns."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from collections import Counter
from pathlib import Path

import structlog.testing
from support.backends import Delegating
from support.clock import FakeClock, blocked_in
from support.waiting import eventually

from gpu.monitoring import (
    EVENT_WAIT_MS,
    GPUS,
    WAIT_S,
    gpu,
    healthy_except,
    monitor_for,
    running,
    until,
)
from gpuagent.domain.devices import Telemetry
from gpuagent.gpu.backend import Probe
from gpuagent.gpu.monitor import GpuMonitor
from gpuagent.gpu.nvml import Nvml
from gpuagent.gpu.sim import SimDriver
from gpuagent.state.store import DeviceStore
from gpuagent.web.metrics import MetricsRenderer


# ----- isolation ---------------------------------------------------------------------------------
class HangingProbe(Delegating):
    """Probing GPU ``hang`` blocks in the "driver" until ``release`` is set."""

    def __init__(self, sysfs_root: Path, hang: int) -> None:
        super().__init__(Nvml(sysfs_root))
        self.hang = hang
        self.release = threading.Event()
        self.probes: Counter[int] = Counter()
        self.threads: set[int] = set()  # the threads that probed
        self._lock = threading.Lock()

    def probe(self, index: int) -> Probe:
        with self._lock:
            self.probes[index] += 1
            self.threads.add(threading.get_ident())
        if index == self.hang:
            self.release.wait(WAIT_S * 2)
        return self.inner.probe(index)


async def test_hung_probe_stalls_only_its_gpu(
    store: DeviceStore, driver: SimDriver, tmp_path: Path
) -> None:
    """A GPU whose probe hangs gets ``nvml_error``; the others and the event loop carry on."""
    nvml = HangingProbe(tmp_path, hang=1)
    monitor = monitor_for(store, nvml, call_timeout=0.5)
    try:
        async with running(monitor):
            snapshot = await until(
                store,
                lambda s: (
                    len(s.gpus) == GPUS
                    and [c.kind for c in gpu(s, 1).health.conditions] == ["unresponsive"]
                ),
            )
            # GPU 0 keeps getting fresh readings and stays healthy while GPU 1 is stuck.
            energies: list[float] = []
            reasons: set[str] = set()
            newer = store.watch(lambda s: s)
            await anext(newer)  # the current one: seen above
            async with asyncio.timeout(WAIT_S):
                while len(energies) < 4:
                    snapshot = await anext(newer)
                    assert gpu(snapshot, 0).health.healthy
                    assert healthy_except(snapshot, 1)
                    (condition,) = gpu(snapshot, 1).health.conditions
                    assert condition.kind == "unresponsive"
                    reasons.add(condition.detail)
                    assert gpu(snapshot, 1).telemetry == Telemetry()
                    energy = gpu(snapshot, 0).telemetry.energy_mj
                    if energy is not None and (not energies or energy != energies[-1]):
                        energies.append(energy)
            assert energies == sorted(energies)
            # The hung call is not piled on: later polls skip GPU 1 and say why.
            assert reasons == {"an earlier nvml call has not returned"}
            assert nvml.probes[1] == 1
            assert nvml.probes[0] >= 4

            # Once the driver answers again, so does GPU 1's health.
            nvml.release.set()
            snapshot = await until(store, lambda s: gpu(s, 1).health.healthy)
            assert all(g.health.healthy for g in snapshot.gpus)
    finally:
        nvml.release.set()
    # The loop carried on: the hang is released from the loop itself (above), and no probe ran
    # on the loop's thread.
    assert nvml.threads
    assert threading.get_ident() not in nvml.threads


async def test_a_long_hang_is_one_series_and_two_log_lines(
    store: DeviceStore, driver: SimDriver, tmp_path: Path
) -> None:
    """A GPU hung for a minute at 1 s polls leaves one ``gpuagent_gpu_condition`` series for the
    whole hang (its detail names the call, never how long it has run), and two log lines: one
    when the GPU turns unresponsive, one when it answers again."""
    clock = FakeClock(time.monotonic())  # the NVML calls' own clock reads the same, at first
    monitor = GpuMonitor(
        store, Nvml(tmp_path), poll_interval=1.0, call_timeout=0.05, event_wait_ms=EVENT_WAIT_MS,
        clock=clock,
    )  # fmt: skip
    renderer = MetricsRenderer("node-1", "1")
    series: set[str] = set()

    def scrape() -> None:
        text = renderer.devices(store.snapshot).text.decode()
        series.update(
            line.rsplit(" ", 1)[0]
            for line in text.splitlines()
            if line.startswith('gpuagent_gpu_condition{gpu="1"')
        )

    await monitor.start()
    try:
        with structlog.testing.capture_logs() as logs:
            driver.inject(1, "hang", seconds=600)
            first = asyncio.create_task(monitor.poll_once())
            (poller,) = await eventually(
                lambda: [
                    t.ident for t in threading.enumerate() if t.name == "nvml-poll" and t.ident
                ]
            )
            assert await asyncio.to_thread(
                blocked_in, poller, "hang_if_needed", ("wait", "wait")
            ), "GPU 1's probe never blocked in the hang"
            clock.now += 1.0  # past the per-call limit: GPU 1 keeps the thread, the rest go on
            await first
            scrape()
            for _ in range(59):
                clock.now += 1.0
                await monitor.poll_once()
                scrape()
            (condition,) = gpu(store.snapshot, 1).health.conditions
            assert condition.kind == "unresponsive"
            assert "nvmlDeviceGetPerformanceState" in condition.detail
            driver.inject(1, "recover")
            async with asyncio.timeout(WAIT_S):
                while not gpu(store.snapshot, 1).health.healthy:
                    clock.now += 1.0
                    await monitor.poll_once()  # the hung call returns on its own thread
            scrape()
    finally:
        driver.inject(1, "recover")
        await asyncio.wait_for(monitor.close(), WAIT_S)
    assert len(series) == 1, sorted(series)
    # The lines naming GPU 1 (a thread an earlier test left behind may log about its own GPU 1,
    # by index, on the same simulated driver while this one runs).
    uuid = gpu(store.snapshot, 1).uuid
    lines = [e for e in logs if e["log_level"] != "debug" and e.get("uuid") == uuid]
    assert [(e["event"], e.get("health")) for e in lines] == [
        ("gpu health changed", "Unhealthy"),
        ("gpu health changed", "Healthy"),
    ], lines
    assert lines[0]["call"] == "nvmlDeviceGetPerformanceState"


class ProbeThreads(Delegating):
    """Records the thread each GPU's probe ran on; GPU ``hang`` can be made to hang."""

    def __init__(self, sysfs_root: Path, hang: int = -1) -> None:
        super().__init__(Nvml(sysfs_root))
        self.hang = hang
        self.release = threading.Event()
        self.threads: list[tuple[int, threading.Thread]] = []
        self._lock = threading.Lock()

    def probe(self, index: int) -> Probe:
        with self._lock:
            self.threads.append((index, threading.current_thread()))
        if index == self.hang and not self.release.is_set():
            self.release.wait(WAIT_S * 2)
        return self.inner.probe(index)


async def test_probes_run_in_turn_on_one_thread(
    store: DeviceStore, driver: SimDriver, tmp_path: Path
) -> None:
    """After start-up every GPU is probed on the one poll thread, one after the other (no GIL
    convoy of a thread per GPU); the start-up threads of the GPUs have ended."""
    before = set(threading.enumerate())  # (other tests' hung threads may still be around)
    nvml = ProbeThreads(tmp_path)
    monitor = monitor_for(store, nvml, poll_interval=60.0)
    try:
        await monitor.start()
        await monitor.poll_once()
        await monitor.poll_once()
        assert [i for i, _ in nvml.threads] == [*range(GPUS), *range(GPUS)]
        assert {t.name for _, t in nvml.threads} == {"nvml-poll"}
        assert len({t for _, t in nvml.threads}) == 1
        started = [t for t in threading.enumerate() if t not in before]
        for thread in started:
            if thread.name.startswith("nvml-gpu"):
                thread.join(WAIT_S)
                assert not thread.is_alive(), thread.name
    finally:
        await asyncio.wait_for(monitor.close(), WAIT_S)


async def test_a_hung_gpu_keeps_its_thread_and_gives_it_back(
    store: DeviceStore, driver: SimDriver, tmp_path: Path
) -> None:
    """A probe past the per-call limit keeps its thread: the GPUs after it are probed on a new
    poll thread in the same poll, the hung GPU is skipped (never queued behind its call), and
    once the call returns the GPU shares the poll thread again and its own thread ends."""
    nvml = ProbeThreads(tmp_path, hang=1)
    monitor = monitor_for(store, nvml, poll_interval=60.0, call_timeout=0.5)
    try:
        await monitor.start()
        await monitor.poll_once()
        # GPUs 2 and 3 were probed in the same poll, on another thread than GPU 1's.
        assert [i for i, _ in nvml.threads] == [0, 1, 2, 3]
        threads = [t for _, t in nvml.threads]
        assert threads[0] is threads[1]
        assert threads[2] is threads[3] is not threads[1]
        assert gpu(store.snapshot, 2).telemetry != Telemetry()
        assert [c.kind for c in gpu(store.snapshot, 1).health.conditions] == []  # hysteresis
        await monitor.poll_once()
        assert [i for i, _ in nvml.threads[4:]] == [0, 2, 3]  # GPU 1 is still in its call
        nvml.release.set()
        async with asyncio.timeout(WAIT_S):
            while monitor._lanes.busy(1):  # noqa: ASYNC110 (the hung call returns on its thread)
                await asyncio.sleep(0.01)
        await monitor.poll_once()
        assert [i for i, _ in nvml.threads[7:]] == [0, 1, 2, 3]
        assert {t for _, t in nvml.threads[7:]} == {threads[2]}
        threads[1].join(WAIT_S)
        assert not threads[1].is_alive()  # the hung GPU's thread ended once it gave it back
    finally:
        nvml.release.set()
        await asyncio.wait_for(monitor.close(), WAIT_S)


class FailsAfterTheTimeout(Delegating):
    """GPU 1's probe outlives the poll's time limit, then raises."""

    def __init__(self, sysfs_root: Path) -> None:
        super().__init__(Nvml(sysfs_root))
        self.release = threading.Event()
        self.raised = threading.Event()

    def probe(self, index: int) -> Probe:
        if index == 1:
            self.release.wait(WAIT_S)
            self.raised.set()
            raise RuntimeError("driver blew up late")
        return self.inner.probe(index)


async def test_abandoned_probe_exception_is_retrieved(
    store: DeviceStore, driver: SimDriver, tmp_path: Path
) -> None:
    """A probe given up on at the time limit that later fails leaves no unretrieved exception."""
    loop = asyncio.get_running_loop()
    reported: list[str] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _, context: reported.append(str(context.get("message"))))
    backend = FailsAfterTheTimeout(tmp_path)
    monitor = monitor_for(store, backend, call_timeout=0.05)
    try:
        await monitor.start()
        await monitor.poll_once()  # GPU 1's probe is given up on
        backend.release.set()
        assert await asyncio.to_thread(backend.raised.wait, WAIT_S)
        async with asyncio.timeout(WAIT_S):
            while monitor._lanes.busy(1):  # noqa: ASYNC110 (the late exception reaches the future …
                await asyncio.sleep(0.01)
        for _ in range(3):
            await asyncio.sleep(0)  # … and its callbacks run on the loop)
        await monitor.poll_once()  # the worker's next job lets go of the abandoned future
        gc.collect()
        assert not [m for m in reported if "never retrieved" in m]
    finally:
        backend.release.set()
        loop.set_exception_handler(previous)
        await asyncio.wait_for(monitor.close(), WAIT_S)
