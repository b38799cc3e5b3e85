"""The NVML poller: driver events and periodic probes feeding the device store.

Two loops share one :class:`~gpuagent.gpu.nvml.Nvml`: a daemon thread blocks in the driver's event
wait and hands each event to the event loop, and a probe cycle reads every GPU's telemetry on its
own worker thread at the poll interval. Each GPU's state changes only through its own events.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial
from typing import TypeVar

import structlog

from gpuagent.domain.devices import DriverState, Gpu, Snapshot
from gpuagent.domain.health import (
    LOST,
    HealthEvent,
    ProbeFailed,
    RecoveryActionChanged,
    Responding,
    RowRemapState,
    record_event,
)
from gpuagent.domain.store import DeviceStore
from gpuagent.gpu.nvml import DriverUnavailable, EventWaitError, Nvml, Probe
from gpuagent.gpu.workers import Worker

log = structlog.get_logger("gpuagent.monitor")
T = TypeVar("T")


class GpuMonitor:
    """Owns the driver connection's lifetime and keeps the store's GPUs current.

    Events are judged by the health policy of the store's current plan; NVML calls are counted
    in the store's counters.
    """

    def __init__(
        self,
        store: DeviceStore,
        nvml: Nvml,
        *,
        poll_interval: float,
        init_retry_interval: float = 10.0,
        call_timeout: float = 10.0,
        event_wait_ms: int = 500,
    ) -> None:
        self._store = store
        self._nvml = nvml
        self._poll_interval = poll_interval
        self._init_retry_interval = init_retry_interval
        self._call_timeout = call_timeout
        self._event_wait_ms = event_wait_ms
        self._control = Worker("nvml-control")
        self._workers: dict[int, Worker] = {}
        # The recovery action each GPU's probes last read; events are transitions on their own.
        self._probed_actions: dict[int, int] = {}
        self._background: set[asyncio.Task[None]] = set()
        # Driver events applied per GPU; a probe that started before the latest event is stale.
        self._event_counts: dict[int, int] = {}
        self._poll_now = asyncio.Event()
        self._stop_events = threading.Event()
        self._event_thread: threading.Thread | None = None
        self._started = False

    async def start(self) -> None:
        """Initialise the driver and discover GPUs; raises :class:`DriverUnavailable` on failure."""
        try:
            driver = await self._call(self._control, self._nvml.init)
        except (DriverUnavailable, TimeoutError) as exc:
            raise self._unavailable(exc) from exc
        try:
            gpus = await self._call(self._control, self._nvml.discover)
            failed = await self._call(self._control, self._nvml.open_events)
        except (DriverUnavailable, TimeoutError) as exc:
            with contextlib.suppress(TimeoutError):
                await self._call(self._control, self._nvml.shutdown)
            raise self._unavailable(exc) from exc
        for index, error in failed.items():
            log.error("no health events for this gpu; relying on probes", gpu=index, error=error)
        for gpu in gpus:
            self._workers[gpu.index] = Worker(f"nvml-gpu{gpu.index}")
        topology = self._nvml.topology
        self._store.update(
            lambda s: replace(
                s,
                gpus=tuple(gpus),
                topology=topology,
                discovered=True,
                driver=driver,
            )
        )
        log.info(
            "gpus discovered",
            count=len(gpus),
            driver_version=driver.version,
            cuda_version=driver.cuda_version,
            gpus=[f"{g.index}:{g.uuid}" for g in gpus],
            mig_devices=sum(len(g.mig_devices) for g in gpus),
            nvlink_pairs=sum(1 for link in topology.links if link.nvlinks),
        )
        self._started = True

    def _unavailable(self, exc: Exception) -> DriverUnavailable:
        error = str(exc) or "nvml did not answer"
        self._store.update(lambda s: replace(s, driver=DriverState(up=False, error=error)))
        return DriverUnavailable(error)

    async def run(self) -> None:
        """Keep the store current until cancelled; retries driver initialisation until it works."""
        while not self._started:
            try:
                await self.start()
            except DriverUnavailable as exc:
                log.warning(
                    "driver unavailable; retrying",
                    error=str(exc),
                    retry_in_s=self._init_retry_interval,
                )
                await asyncio.sleep(self._init_retry_interval)
        loop = asyncio.get_running_loop()
        self._event_thread = threading.Thread(
            target=self._event_loop, args=(loop,), name="nvml-events", daemon=True
        )
        self._event_thread.start()
        try:
            while True:
                await self.poll_once()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._poll_now.wait(), self._poll_interval)
                self._poll_now.clear()
        finally:
            self._stop_events.set()

    async def close(self) -> None:
        """Stop the event thread and release the driver (bounded)."""
        for task in list(self._background):
            task.cancel()
        self._stop_events.set()
        thread = self._event_thread
        if thread is not None:
            # The event set must outlive the wait that uses it: let the wait time out first.
            await asyncio.to_thread(thread.join, self._event_wait_ms / 1000 + 1.0)
            if thread.is_alive():
                log.warning("nvml event wait did not return in time")
                return
        if self._started:
            try:
                await self._call(self._control, self._nvml.shutdown)
            except TimeoutError:
                log.warning("nvml shutdown did not return in time")
        self._control.close()
        for worker in self._workers.values():
            worker.close()

    async def poll_once(self) -> None:
        """Probe every GPU whose worker is free, concurrently, and apply the results."""
        pending: dict[int, asyncio.Future[Probe]] = {}
        started: dict[int, int] = {}
        for index, worker in self._workers.items():
            if worker.busy:
                self.apply(index, ProbeFailed("an earlier nvml call has not returned"))
                continue
            started[index] = self._event_counts.get(index, 0)
            probe = partial(self._nvml.probe, index)
            pending[index] = worker.submit(partial(self._timed, "probe", probe))
        if not pending:
            return
        done, _ = await asyncio.wait(pending.values(), timeout=self._call_timeout)
        for index, future in pending.items():
            if future not in done:
                self.apply(index, ProbeFailed(f"nvml call did not return in {self._call_timeout}s"))
                continue
            exc = future.exception()
            if exc is not None:
                log.error("probe failed unexpectedly", gpu=index, error=repr(exc))
                self.apply(index, ProbeFailed(repr(exc)))
                continue
            stale = self._event_counts.get(index, 0) != started[index]
            self._apply_probe(index, future.result(), stale=stale)

    def apply(self, index: int, event: HealthEvent) -> None:
        """Apply one health event to one GPU, logging a change of health."""
        before = self._store.snapshot.gpu(index)
        snapshot = self._store.update(lambda s: _map_gpu(s, index, self._record(event)))
        after = snapshot.gpu(index)
        if before is not None and after is not None and before.health != after.health:
            emit = log.info if after.health.healthy else log.warning
            emit(
                "gpu health changed",
                gpu=index,
                uuid=after.uuid,
                health=after.health.kubelet_health,
                reason=after.health.reason,
                cause=type(event).__name__,
            )
        if before is not None and after is not None and _lost(before) and not _lost(after):
            # A GPU that fell off the bus and answers again may sit elsewhere: re-read topology.
            self._spawn_refresh()

    def _spawn_refresh(self) -> None:
        task = asyncio.get_running_loop().create_task(self._refresh_topology())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _refresh_topology(self) -> None:
        try:
            topology = await self._call(self._control, self._nvml.refresh_topology)
        except Exception as exc:
            log.warning("topology refresh failed", error=repr(exc))
            return
        self._store.update(lambda s: replace(s, topology=topology))
        log.info("topology refreshed", nvlink_pairs=sum(1 for x in topology.links if x.nvlinks))

    def _record(self, event: HealthEvent) -> Callable[[Gpu], Gpu]:
        # A reloaded policy judges events from then on; past verdicts stand.
        policy = self._store.plan.health
        return lambda gpu: record_event(gpu, event, policy)

    def _on_event(self, index: int, event: HealthEvent) -> None:
        self._event_counts[index] = self._event_counts.get(index, 0) + 1
        self.apply(index, event)

    def _apply_probe(self, index: int, probe: Probe, *, stale: bool = False) -> None:
        telemetry, processes = probe.telemetry, probe.processes
        if stale:
            # A driver event arrived while this probe ran: its health readings may predate the
            # event and must not overtake it. Keep the telemetry; the next probe decides.
            if probe.events == (Responding(),):
                self._store.update(
                    lambda s: _map_gpu(
                        s, index, lambda g: replace(g, telemetry=telemetry, processes=processes)
                    )
                )
            return
        for event in probe.events:
            self.apply(index, event)
        if probe.recovery_action is not None:
            # Only a change between two readings is a signal: an unchanged "none" after an XID
            # must not clear it, nor may a reading taken before an event overtake the event.
            previous = self._probed_actions.get(index, 0)
            self._probed_actions[index] = probe.recovery_action
            if probe.recovery_action != previous:
                self.apply(index, RecoveryActionChanged(probe.recovery_action))
        if telemetry.row_remap_pending is not None or telemetry.row_remap_failure is not None:
            self.apply(
                index,
                RowRemapState(
                    pending=bool(telemetry.row_remap_pending),
                    failed=bool(telemetry.row_remap_failure),
                ),
            )
        self._store.update(
            lambda s: _map_gpu(
                s, index, lambda g: replace(g, telemetry=telemetry, processes=processes)
            )
        )

    def _event_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """Runs on the ``nvml-events`` thread: blocks in the driver, posts events to the loop."""
        while not self._stop_events.is_set():
            try:
                received = self._nvml.wait_event(self._event_wait_ms)
            except EventWaitError as exc:
                log.warning("event wait failed; probing all gpus", error=str(exc), lost=exc.lost)
                if not _post(loop, self._poll_now.set):
                    return
                self._stop_events.wait(self._event_wait_ms / 1000)
                continue
            if received is not None and not _post(loop, self._on_event, *received):
                return

    async def _call(self, worker: Worker, fn: Callable[[], T]) -> T:
        name = getattr(fn, "__name__", "call")
        return await asyncio.wait_for(
            worker.submit(partial(self._timed, name, fn)), self._call_timeout
        )

    def _timed(self, name: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` on a worker thread, counting its duration and failure under ``name``."""
        started = time.perf_counter()
        failed = True
        try:
            result = fn()
            failed = isinstance(result, Probe) and result.events != (Responding(),)
            return result
        finally:
            self._store.counters.nvml_call(name, time.perf_counter() - started, failed=failed)

    @property
    def gpu_indexes(self) -> Sequence[int]:
        return tuple(self._workers)


def _lost(gpu: Gpu) -> bool:
    return any(c.kind == LOST for c in gpu.health.conditions)


def _post(loop: asyncio.AbstractEventLoop, callback: Callable[..., None], *args: object) -> bool:
    """Hand ``callback`` to the loop from another thread; ``False`` once the loop has closed."""
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:
        return False
    return True


def _map_gpu(snapshot: Snapshot, index: int, change: Callable[[Gpu], Gpu]) -> Snapshot:
    gpus = tuple(change(g) if g.index == index else g for g in snapshot.gpus)
    return replace(snapshot, gpus=gpus)
