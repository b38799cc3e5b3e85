"""The NVML poller (`GpuMonitor`) feeding the device store, on the simulated driver."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import re
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path

import pynvml
import pytest
import structlog.testing
from support.backends import Delegating
from support.clock import FakeClock, Sleeps, blocked_in
from support.tasks import running as running_task
from support.waiting import eventually

from gpuagent.domain.devices import Condition, DriverState, Gpu, Snapshot, Telemetry, Topology
from gpuagent.domain.health import (
    HealthPolicy,
)
from gpuagent.domain.plan import Plan
from gpuagent.gpu.backend import Backend, DriverEvent, DriverUnavailable, Probe
from gpuagent.gpu.monitor import GpuMonitor
from gpuagent.gpu.nvml import Nvml
from gpuagent.gpu.sim import SimDriver, installed, node_from_count
from gpuagent.state.store import DeviceStore
from gpuagent.web.metrics import MetricsRenderer

GPUS = 4
POLL = 0.02
EVENT_WAIT_MS = 50
# A deadline for what must happen, never a wait: generous, for a machine shared by parallel suites.
WAIT_S = 15.0
GPU_IS_LOST = int(pynvml.NVML_ERROR_GPU_IS_LOST)


@pytest.fixture
def driver() -> Iterator[SimDriver]:
    """A 4-GPU simulated node installed below pynvml; uninstalled afterwards. No test may use
    NVML as nvml.h forbids (a set freed, or NVML shut down, under a blocked wait)."""
    with installed(SimDriver(node_from_count(GPUS))) as drv:
        yield drv
        assert drv.misuse == []


@pytest.fixture
def store() -> DeviceStore:
    return DeviceStore()


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


async def until(store: DeviceStore, predicate: Callable[[Snapshot], bool]) -> Snapshot:
    """The first snapshot (current or newer) satisfying ``predicate``; fails after ``WAIT_S``."""
    snapshot = store.snapshot
    try:
        async with asyncio.timeout(WAIT_S):
            while not predicate(snapshot):
                snapshot = await store.wait_newer(snapshot.version)
    except TimeoutError:
        pytest.fail(f"not reached within {WAIT_S}s; last snapshot: {snapshot}")
    return snapshot


def gpu(snapshot: Snapshot, index: int) -> Gpu:
    found = snapshot.gpu(index)
    assert found is not None, f"no GPU {index} in {snapshot}"
    return found


def probed(snapshot: Snapshot) -> bool:
    """Every GPU has been probed at least once (telemetry present)."""
    return len(snapshot.gpus) == GPUS and all(g.telemetry != Telemetry() for g in snapshot.gpus)


def healthy_except(snapshot: Snapshot, index: int) -> bool:
    return all(g.health.healthy for g in snapshot.gpus if g.index != index)


# ----- start and run -----------------------------------------------------------------------------
async def test_start_publishes_gpus(store: DeviceStore, driver: SimDriver, tmp_path: Path) -> None:
    """start() publishes every discovered GPU, the driver as up and its version."""
    monitor = monitor_for(store, Nvml(tmp_path))
    try:
        await monitor.start()
        snapshot = store.snapshot
        assert snapshot.discovered
        assert snapshot.driver == DriverState(
            up=True, version=driver.node.driver_version, cuda_version=(13, 0)
        )
        assert [(g.index, g.uuid) for g in snapshot.gpus] == [
            (d["index"], d["uuid"]) for d in driver.describe()
        ]
        assert all(g.health.healthy for g in snapshot.gpus)
        assert tuple(monitor.gpu_indexes) == tuple(range(GPUS))
    finally:
        await asyncio.wait_for(monitor.close(), WAIT_S)


@pytest.mark.parametrize(
    ("code", "error"),
    [
        (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, "Driver Not Loaded (NVML 9)"),
        (
            pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH,
            "RM has detected an NVML/RM version mismatch. (NVML 18)",
        ),
    ],
)
async def test_start_with_driver_down(
    store: DeviceStore, driver: SimDriver, tmp_path: Path, code: int, error: str
) -> None:
    """start() raises DriverUnavailable and the store shows the driver down, with NVML's text."""
    driver.fail("nvmlInitWithFlags", code)
    monitor = monitor_for(store, Nvml(tmp_path))
    try:
        with pytest.raises(DriverUnavailable, match=error.replace("(", r"\(").replace(")", r"\)")):
            await monitor.start()
        snapshot = store.snapshot
        assert snapshot.driver == DriverState(up=False, error=error)
        assert snapshot.gpus == ()
        assert not snapshot.discovered
    finally:
        await asyncio.wait_for(monitor.close(), WAIT_S)


async def test_a_driver_that_stays_down_is_logged_once(
    store: DeviceStore, driver: SimDriver, tmp_path: Path
) -> None:
    """Initialisation is retried for ever while the driver is down, with one line for it (and
    one more when the error changes), not one per retry."""
    driver.fail("nvmlInitWithFlags", pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
    monitor = monitor_for(store, Nvml(tmp_path), init_retry_interval=0.001)
    with structlog.testing.capture_logs() as logs:
        async with running(monitor):
            await eventually(lambda: driver.calls["nvmlInitWithFlags"] >= 4, what="four tries")
            driver.fail("nvmlInitWithFlags", pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH)
            await eventually(
                lambda: (
                    "mismatch" in store.snapshot.driver.error
                    and driver.calls["nvmlInitWithFlags"] >= 8
                ),
                what="four tries more",
            )
    warned = [
        e["error"]
        for e in logs
        if e["event"] == "driver unavailable; retrying" and e["log_level"] == "warning"
    ]
    assert warned == [
        "Driver Not Loaded (NVML 9)",
        "RM has detected an NVML/RM version mismatch. (NVML 18)",
    ]


HUNG_INIT = r"nvml did not answer: nvmlInit did not return within 0\.1s"


async def test_start_with_hung_init(store: DeviceStore, tmp_path: Path) -> None:
    """An init call that does not return within the per-call limit: the driver is unavailable.

    The retry does not queue a second init behind the first: it waits for the same one.
    """
    node = node_from_count(GPUS)
    slow = replace(node, latency=replace(node.latency, calls={"nvmlInitWithFlags": 0.6}))
    sleeps = Sleeps(hold=0.6)  # the init takes until the test releases it
    with installed(SimDriver(slow, sleep=sleeps)) as driver:
        monitor = monitor_for(store, Nvml(tmp_path), call_timeout=0.1)
        try:
            with pytest.raises(DriverUnavailable, match=HUNG_INIT):
                await monitor.start()
            assert re.fullmatch(HUNG_INIT, store.snapshot.driver.error)
            assert not store.snapshot.driver.up
            # Retried while the first init still runs: no second init behind it, and once it has
            # returned, its result.
            with pytest.raises(DriverUnavailable, match=HUNG_INIT):
                await monitor.start()
            assert sleeps.seconds.count(0.6) == 1
            sleeps.release()
            async with asyncio.timeout(WAIT_S):
                while True:
                    try:
                        await monitor.start()
                        break
                    except DriverUnavailable:
                        await asyncio.sleep(0.05)
            assert driver.calls["nvmlInitWithFlags"] == 1
            assert store.snapshot.discovered
        finally:
            sleeps.release()
            await asyncio.wait_for(monitor.close(), WAIT_S)


@pytest.mark.parametrize(
    "code",
    [
        pynvml.NVML_ERROR_DRIVER_NOT_LOADED,
        pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH,
        pynvml.NVML_ERROR_UNKNOWN,
    ],
)
async def test_run_retries_init(
    store: DeviceStore, driver: SimDriver, tmp_path: Path, code: int
) -> None:
    """run() keeps retrying init until the driver answers, then publishes the GPUs."""
    driver.fail("nvmlInitWithFlags", code, count=2)
    monitor = monitor_for(store, Nvml(tmp_path), init_retry_interval=0.01)
    async with running(monitor):
        snapshot = await until(store, lambda s: s.driver.up and len(s.gpus) == GPUS)
        assert snapshot.driver == DriverState(
            up=True, version=driver.node.driver_version, cuda_version=(13, 0)
        )
        assert snapshot.discovered
        assert driver.calls["nvmlInitWithFlags"] == 3
        await until(store, probed)


# ----- health through events and probes ----------------------------------------------------------
@pytest.mark.parametrize("poll_interval", [POLL, 30.0], ids=["polling", "events-only"])
async def test_xid_79_then_recover(
    store: DeviceStore, driver: SimDriver, tmp_path: Path, poll_interval: float
) -> None:
    """XID 79 (from the event thread) turns only that GPU unhealthy; recovery clears it."""
    monitor = monitor_for(store, Nvml(tmp_path), poll_interval=poll_interval)
    async with running(monitor):
        await until(store, probed)
        driver.inject(1, "xid", 79)
        snapshot = await until(
            store,
            lambda s: (
                Condition("xid", "79") in gpu(s, 1).health.conditions
                and Condition("recovery_action", "gpu_reset") in gpu(s, 1).health.conditions
            ),
        )
        assert healthy_except(snapshot, 1)
        assert dict(gpu(snapshot, 1).xid_counts) == {79: 1}
        assert gpu(snapshot, 1).last_xid == 79

        driver.inject(1, "recover")
        snapshot = await until(store, lambda s: gpu(s, 1).health.healthy)
        assert all(g.health.healthy for g in snapshot.gpus)
        assert dict(gpu(snapshot, 1).xid_counts) == {79: 1}  # history is kept for metrics


async def test_ecc_dbe(store: DeviceStore, driver: SimDriver, tmp_path: Path) -> None:
    """A double-bit ECC error turns only that GPU unhealthy."""
    monitor = monitor_for(store, Nvml(tmp_path))
    async with running(monitor):
        await until(store, probed)
        driver.inject(3, "ecc_dbe")
        snapshot = await until(store, lambda s: Condition("ecc_dbe") in gpu(s, 3).health.conditions)
        assert healthy_except(snapshot, 3)


async def test_lost_gpu(store: DeviceStore, driver: SimDriver, tmp_path: Path) -> None:
    """A lost GPU gets the ``lost`` condition from the probe; the others stay healthy."""
    monitor = monitor_for(store, Nvml(tmp_path))
    async with running(monitor):
        await until(store, probed)
        driver.inject(2, "lost")
        snapshot = await until(store, lambda s: Condition("lost") in gpu(s, 2).health.conditions)
        assert healthy_except(snapshot, 2)
        assert gpu(snapshot, 2).telemetry == Telemetry()
        # The others keep answering: their telemetry still moves on.
        before = gpu(snapshot, 0).telemetry
        snapshot = await until(store, lambda s: gpu(s, 0).telemetry != before)
        assert healthy_except(snapshot, 2)

        driver.inject(2, "recover")
        snapshot = await until(store, lambda s: gpu(s, 2).health.healthy)
        assert gpu(snapshot, 2).telemetry != Telemetry()


@pytest.mark.parametrize(
    ("enable", "healthy"),
    [("", True), ("13", False)],
    ids=["default-policy", "DP_ENABLE_HEALTHCHECKS=13"],
)
async def test_application_xid(
    store: DeviceStore, driver: SimDriver, tmp_path: Path, enable: str, healthy: bool
) -> None:
    """An application XID (13) is counted; it makes the GPU unhealthy only if enabled."""
    policy = HealthPolicy.from_env_values("", enable)
    monitor = monitor_for(store, Nvml(tmp_path), policy)
    async with running(monitor):
        await until(store, probed)
        driver.inject(0, "xid", 13)
        snapshot = await until(store, lambda s: 13 in gpu(s, 0).xid_counts)
        gpu0 = gpu(snapshot, 0)
        assert dict(gpu0.xid_counts) == {13: 1}
        assert gpu0.last_xid == 13
        assert gpu0.health.healthy is healthy
        assert healthy_except(snapshot, 0)
        # Later probes do not change that verdict.
        before = gpu0.telemetry
        snapshot = await until(store, lambda s: gpu(s, 0).telemetry != before)
        assert gpu(snapshot, 0).health.healthy is healthy


async def test_event_wait_failure_probes_at_once(
    store: DeviceStore, driver: SimDriver, tmp_path: Path
) -> None:
    """A failed event wait (GPU lost) makes the monitor probe every GPU without waiting a poll."""
    monitor = monitor_for(store, Nvml(tmp_path), poll_interval=30.0)
    async with running(monitor):
        await until(store, probed)
        driver.inject(2, "lost")
        driver.fail("nvmlEventSetWait_v2", GPU_IS_LOST, count=1)
        # Only a probe reports ``lost``; the next scheduled one is 30 s away.
        snapshot = await until(store, lambda s: Condition("lost") in gpu(s, 2).health.conditions)
        assert healthy_except(snapshot, 2)


# ----- isolation ---------------------------------------------------------------------------------
class HangingProbe(Delegating):
    """Probing GPU ``hang`` blocks in the "driver" until ``release`` is set."""

    def __init__(self, sysfs_root: Path, hang: int) -> None:
        super().__init__(Nvml(sysfs_root))
        self.hang = hang
        self.release = threading.Event()
        self.probes: Counter[int] = Counter()
        self._lock = threading.Lock()

    def probe(self, index: int) -> Probe:
        with self._lock:
            self.probes[index] += 1
        if index == self.hang:
            self.release.wait(WAIT_S * 2)
        return self.inner.probe(index)


async def test_hung_probe_stalls_only_its_gpu(
    store: DeviceStore, driver: SimDriver, tmp_path: Path
) -> None:
    """A GPU whose probe hangs gets ``nvml_error``; the others and the event loop carry on."""
    nvml = HangingProbe(tmp_path, hang=1)
    monitor = monitor_for(store, nvml, call_timeout=0.1)
    gaps: list[float] = []
    ticking = True

    async def ticker() -> None:
        last = time.monotonic()
        while ticking:
            await asyncio.sleep(0.005)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    tick_task = asyncio.create_task(ticker())
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
            async with asyncio.timeout(WAIT_S):
                while len(energies) < 4:
                    snapshot = await store.wait_newer(snapshot.version)
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
        ticking = False
        await tick_task
    assert gaps
    assert max(gaps) < 1.0, f"event loop stalled for {max(gaps):.3f}s"


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
    """The production event wait blocks 5 s (a timed-out wait costs an NVML error each time,
    so it should be rare); failing waits are still retried after 0.5 s at first."""
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
        for _ in range(3):
            await asyncio.sleep(0)  # run() is back in its wait for the next poll
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
    for _ in range(5):
        await asyncio.sleep(0)
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
        for _ in range(3):
            await asyncio.sleep(0)  # the refresh waits for its read
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


# ----- ordering of probe readings and driver events ----------------------------------------------
class StaleProbe(Delegating):
    """Probing GPU 1 can be held after it has read the GPU, so its reading arrives late."""

    def __init__(self, sysfs_root: Path) -> None:
        super().__init__(Nvml(sysfs_root))
        self.armed = threading.Event()
        self.read = threading.Event()
        self.release = threading.Event()
        self.probes: Counter[int] = Counter()
        self._lock = threading.Lock()

    def probe(self, index: int) -> Probe:
        result = self.inner.probe(index)
        with self._lock:
            self.probes[index] += 1
        if index == 1 and self.armed.is_set():
            self.armed.clear()
            self.read.set()
            self.release.wait(WAIT_S)
        return result


async def test_stale_probe_does_not_clear_xid(
    store: DeviceStore, driver: SimDriver, tmp_path: Path
) -> None:
    """A probe that read "no recovery action" before XID 79 must not clear the XID after it."""
    nvml = StaleProbe(tmp_path)
    monitor = monitor_for(store, nvml)
    try:
        async with running(monitor):
            await until(store, probed)
            nvml.armed.set()
            assert await asyncio.to_thread(nvml.read.wait, WAIT_S)
            # GPU 1 has been read (recovery action: none); now the XID happens.
            driver.inject(1, "xid", 79)
            # Both driver events (XID, then recovery action GPU_RESET) have been applied.
            await until(
                store,
                lambda s: (
                    gpu(s, 1).health.conditions
                    == (Condition("xid", "79"), Condition("recovery_action", "gpu_reset"))
                ),
            )
            stale = nvml.probes[1]
            nvml.release.set()
            # Two more probes of GPU 1 started: the stale one and the next have been applied.
            snapshot = await until(store, lambda s: nvml.probes[1] >= stale + 2)
            assert Condition("xid", "79") in gpu(snapshot, 1).health.conditions
    finally:
        nvml.release.set()


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
    monitor = monitor_for(store, nvml, poll_interval=60.0, call_timeout=0.1)
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
