"""The NVML poller (`GpuMonitor`) feeding the device store, on the simulated driver: start-up
and its retries, health through driver events and probes, and their order."""

from __future__ import annotations

import asyncio
import re
import threading
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pynvml
import pytest
import structlog.testing
from support.backends import Delegating
from support.clock import Sleeps
from support.tasks import awaiting
from support.waiting import eventually

from gpu.monitoring import (
    GPUS,
    POLL,
    WAIT_S,
    gpu,
    healthy_except,
    monitor_for,
    probed,
    running,
    until,
)
from gpuagent.domain.devices import Condition, DriverState, Telemetry
from gpuagent.domain.health import (
    HealthPolicy,
)
from gpuagent.domain.snapshot import Snapshot
from gpuagent.gpu.backend import DriverUnavailable, Probe
from gpuagent.gpu.nvml import Nvml
from gpuagent.gpu.sim import SimDriver, installed, node_from_count
from gpuagent.state.store import DeviceStore

GPU_IS_LOST = int(pynvml.NVML_ERROR_GPU_IS_LOST)


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


async def test_a_failed_start_is_retried_after_the_interval_not_at_once(
    store: DeviceStore, driver: SimDriver, tmp_path: Path
) -> None:
    """The agent's first start failed: the poller's retry waits its interval first (it used to
    call nvmlInit again at once, and /readyz said "waiting for nvmlInit" beside the error)."""
    driver.fail("nvmlInitWithFlags", pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
    monitor = monitor_for(store, Nvml(tmp_path), init_retry_interval=3600)
    with pytest.raises(DriverUnavailable):
        await monitor.start()
    async with running(monitor) as task:
        await eventually(lambda: awaiting(task) == ["run", "sleep"], what="the retry's wait")
        assert driver.calls["nvmlInitWithFlags"] == 1
        assert store.snapshot.driver.waiting == ""
        assert "Library Not Found" in store.snapshot.driver.error


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


async def injected(store: DeviceStore, driver: SimDriver, index: int, fault: str) -> Snapshot:
    """``fault`` injected into GPU ``index`` once the GPUs are probed; the first snapshot that
    shows it as the GPU's condition."""
    await until(store, probed)
    driver.inject(index, fault)
    return await until(store, lambda s: Condition(fault) in gpu(s, index).health.conditions)


async def test_ecc_dbe(store: DeviceStore, driver: SimDriver, tmp_path: Path) -> None:
    """A double-bit ECC error turns only that GPU unhealthy."""
    monitor = monitor_for(store, Nvml(tmp_path))
    async with running(monitor):
        snapshot = await injected(store, driver, 3, "ecc_dbe")
        assert healthy_except(snapshot, 3)


async def test_lost_gpu(store: DeviceStore, driver: SimDriver, tmp_path: Path) -> None:
    """A lost GPU gets the ``lost`` condition from the probe; the others stay healthy."""
    monitor = monitor_for(store, Nvml(tmp_path))
    async with running(monitor):
        snapshot = await injected(store, driver, 2, "lost")
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
