"""The NVML poller: start-up, driver events and periodic probes feeding the device store.

The monitor orchestrates; its parts each own one concern. Start-up (:mod:`~gpuagent.gpu.startup`)
describes every GPU on a thread of its own, all at once, within a per-call limit
(``call_timeout``) and a budget (``--nvml-timeout``); a GPU whose call does not return in time
is advertised ``unresponsive`` and taken in once it returns. Then a daemon thread waits for
driver events (:mod:`~gpuagent.gpu.eventthread`) and, at the poll interval, a probe round checks
every GPU's liveness and reads its telemetry on one shared thread; a GPU whose call runs past
the limit keeps that thread to itself, so it stalls only itself (:mod:`~gpuagent.gpu.lanes`).
Each GPU's state changes only through its own events and probes, judged by
:mod:`~gpuagent.gpu.readings`. Nothing is released under a call still in the driver (nvml.h
allows it nowhere): :meth:`GpuMonitor.close` returns at once, and the event thread releases the
driver when its wait returns (a process that exits first leaves that to the kernel).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import replace
from functools import partial
from typing import Any

import structlog

from gpuagent.domain.devices import Gpu, Topology
from gpuagent.domain.health import DISCOVERY, LOST, GpuLost, HealthEvent, LivenessFailed, Responding
from gpuagent.domain.readiness import freshness_limit
from gpuagent.gpu.backend import Backend, DriverEvent, DriverUnavailable, Probe
from gpuagent.gpu.calls import CallStats
from gpuagent.gpu.eventthread import EVENT_BACKOFF_MAX_S, EVENT_WAIT_MS, EventThread
from gpuagent.gpu.freshness import Freshness
from gpuagent.gpu.lanes import Lanes, Outcome, timed
from gpuagent.gpu.readings import (
    Previous,
    after_event,
    has,
    health_line,
    is_described,
    judge_probe,
    map_gpu,
    merge_description,
    recorded,
    with_readings,
)
from gpuagent.gpu.startup import Stalled, Startup, describe_and_register, startup_budget
from gpuagent.gpu.workers import Worker
from gpuagent.state.store import DeviceStore

log = structlog.get_logger("gpuagent.monitor")

__all__ = ["CallStats", "GpuMonitor"]


class GpuMonitor:
    """Owns the driver connection's lifetime and keeps the store's GPUs current.

    Events are judged by the health policy of the store's current plan; NVML calls are counted
    in the store's counters (each NVML function, and each piece of work: init, discover, probe).
    """

    def __init__(
        self,
        store: DeviceStore,
        backend: Backend,
        *,
        poll_interval: float,
        init_retry_interval: float = 10.0,
        call_timeout: float = 10.0,
        nvml_timeout: float | None = None,
        event_wait_ms: int = EVENT_WAIT_MS,
        event_backoff_max: float = EVENT_BACKOFF_MAX_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self._backend = backend
        backend.calls.forward(store.counters.nvml_call)
        self._poll_interval = poll_interval
        self._init_retry_interval = init_retry_interval
        self._call_timeout = call_timeout
        self._nvml_timeout = nvml_timeout
        self._clock = clock
        self._lanes = Lanes(backend.calls, clock)
        self._startup = Startup(store, backend, self._lanes, call_timeout=call_timeout, clock=clock)
        self._freshness = Freshness(store, freshness_limit(poll_interval, call_timeout), clock)
        self._indexes: tuple[int, ...] = ()
        # GPUs that still need describing (a description failed, stalled or never finished).
        self._undescribed: set[int] = set()
        # What each GPU's last readings said (recovery action, DBE count, NVLink counter).
        self._previous: dict[int, Previous] = {}
        self._background: set[asyncio.Task[None]] = set()
        # Driver events applied per GPU; a probe that started before the latest event is stale.
        self._event_counts: dict[int, int] = {}
        self._poll_now = asyncio.Event()
        self._events = EventThread(
            backend,
            wait_ms=event_wait_ms,
            backoff_max=event_backoff_max,
            on_event=self._on_event,
            probe_all=self._poll_now.set,
            release=self._release,
        )
        self._released = False
        self._started = False
        self._attempted = False  # start() has run at least once
        self._initialised = False
        self._closed = False  # close() was called: no new work is started

    # ----- start-up ----------------------------------------------------------------------------
    async def start(self) -> None:
        """Initialise the driver and discover GPUs; raises :class:`DriverUnavailable` on failure.

        Never waits longer than the per-call limit for one call, nor longer than the start-up
        budget overall; what did not finish in time is taken in when it does.
        """
        started = self._clock()
        control = self._lanes.control
        self._attempted = True
        self._startup.publish("nvmlInit")
        try:
            driver = await self._startup.job(control, "init", self._backend.init)
            self._initialised = True
            count = await self._startup.job(control, "count", self._backend.count)
        except (DriverUnavailable, Stalled) as exc:
            raise self._startup.unavailable(exc) from exc
        budget = startup_budget(count, self._nvml_timeout)
        deadline = started + budget
        self._store.update(lambda s: replace(s, driver=replace(driver, waiting="gpu discovery")))
        try:
            events_error = await self._startup.job(
                control, "events", self._backend.create_event_set
            )
        except Stalled as exc:
            events_error = exc.detail
        if events_error is not None:
            log.error("no health events; relying on probes", error=events_error)
        self._indexes = tuple(range(count))
        self._lanes.open(self._indexes)
        found = await self._startup.discover(count, deadline, budget, events=events_error is None)
        self._undescribed |= found.undescribed
        for index, future in found.late.items():
            future.add_done_callback(partial(self._late_description, index))
        gpus = found.gpus
        described = tuple(g for g in gpus if g.index not in self._undescribed)
        topology, stalled = await self._startup.read_topology(described, deadline, budget)
        if stalled:
            self._spawn_refresh_after(stalled)
        self._lanes.reclaim()  # from now on the GPUs share one thread, except those still in a call
        self._store.update(
            lambda s: replace(
                s,
                gpus=tuple(sorted(gpus, key=lambda g: g.index)),
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
            seconds=round(self._clock() - started, 3),
        )
        self._started = True
        self._freshness.polled()

    def _late_description(self, index: int, future: asyncio.Future[Any]) -> None:
        """A stalled discovery finished after all: take the GPU in (or keep it unresponsive)."""
        if future.cancelled() or future.exception() is not None:
            return
        gpu = future.result()
        if isinstance(gpu, Gpu) and gpu.uuid:
            log.info("gpu discovery finished late", gpu=index, uuid=gpu.uuid)
            self._take_description(gpu)

    def _take_description(self, gpu: Gpu) -> None:
        """Put a (re-)described GPU in the store, keeping what events recorded meanwhile."""
        described = is_described(gpu)
        if described:
            self._undescribed.discard(gpu.index)
        self._store.update(lambda s: merge_description(s, gpu))
        if described:
            self._spawn_refresh()

    # ----- running -----------------------------------------------------------------------------
    async def run(self) -> None:
        """Keep the store current until cancelled; retries driver initialisation until it works."""
        while not self._started:
            before = self._store.snapshot.driver.error  # as the last failed start said it
            if self._attempted:
                # The last start failed (the agent's first one included): not again at once.
                await asyncio.sleep(self._init_retry_interval)
            try:
                await self.start()
            except DriverUnavailable as exc:
                # Once per error, not every retry (a node without its driver retries for ever).
                (log.warning if str(exc) != before else log.debug)(
                    "driver unavailable; retrying",
                    error=str(exc),
                    retry_in_s=self._init_retry_interval,
                )
        self._events.start(asyncio.get_running_loop())
        try:
            while True:
                await self.poll_once()
                self._freshness.polled()
                # (Not asyncio.wait_for: before Python 3.12 it swallows a cancellation that
                # arrives as the event is set, and this loop would then never end.)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self._poll_interval):
                        await self._poll_now.wait()
                self._poll_now.clear()
        finally:
            self._events.stop()

    async def close(self, wait: float | None = None) -> None:
        """Stop the threads and release the driver, within ``wait`` seconds (a shutdown's share
        of its budget; by default the per-call limit), whatever NVML is doing.

        nvml.h promises nothing for an event set freed, or NVML shut down, under a call still
        running on another thread. So a release never happens under one: when the event thread
        is inside its wait, it releases the driver itself as the wait returns (within
        ``event_wait_ms``); when another call has not returned (a hung GPU), the release is left
        to the process's exit, where the kernel closes the driver's files.
        """
        self._closed = True
        limit = self._call_timeout if wait is None else min(wait, self._call_timeout)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limit
        for task in list(self._background):
            task.cancel()
        # A poll cut short finishes the probe it is in, a topology read the read it is in; both
        # are waited for, up to the limit (a hung call is not waited out).
        await self._lanes.finish_running(limit)
        if self._events.stop(hand_over_release=True):
            log.debug("nvml event wait in progress; the event thread releases the driver after it")
        else:
            await self._release_on(self._lanes.control, max(0.0, deadline - loop.time()))
        self._lanes.close()

    async def wait_closed(self) -> None:
        """After :meth:`close`: until the event thread has left (and released the driver, if
        that was left to it). Callers bound it; the process need not wait for it."""
        await self._events.wait_closed()

    async def _release_on(self, worker: Worker, limit: float) -> None:
        """Release the driver on ``worker``, within ``limit`` seconds."""
        if worker.busy:  # never queued behind a call that has not returned
            log.info("nvml left to the process's exit: a call has not returned")
            return
        try:  # (not wait_for, which may swallow a cancellation of close() as the call returns)
            async with asyncio.timeout(limit):
                await worker.submit(self._release)
        except TimeoutError:
            log.warning("nvml shutdown did not return in time")

    def _release(self) -> None:
        """Free the event set and shut NVML down, once, unless a call on another thread has not
        returned: then that is left to the process's exit."""
        if not self._initialised or self._released:
            return
        others = [f"{c.name} (gpu {c.gpu})" for c in self._backend.calls.in_flight()]
        others += self._lanes.busy_work()
        if others:
            log.info("nvml left to the process's exit: a call has not returned", calls=others)
            return
        self._released = True
        self._backend.shutdown()

    async def poll_once(self) -> None:
        """Probe every GPU whose last call has returned, in one round, and apply the results.

        A GPU that still needs describing is described instead; one whose own thread has not
        returned from an earlier call counts a failed liveness check (no job is queued behind it).
        """
        self._lanes.reclaim()
        calls = self._backend.calls
        jobs: list[tuple[int, Callable[[], Any]]] = []
        probing: dict[int, int] = {}  # GPU -> driver events applied when its probe was queued
        for index in self._indexes:
            if self._lanes.busy(index):
                # The call, not how long it has run: the text may become the detail of the GPU's
                # condition, a label value that must stay put while the GPU hangs (the elapsed
                # time is logged with the verdict).
                inside = "".join(f" ({c.name})" for c in self._lanes.in_flight(index))
                self.apply(index, LivenessFailed(f"an earlier nvml call has not returned{inside}"))
                continue
            if index in self._undescribed:
                describe = partial(describe_and_register, self._backend, index, True)
                jobs.append((index, timed(calls, "discover", describe)))
                continue
            probing[index] = self._event_counts.get(index, 0)
            jobs.append((index, timed(calls, "probe", partial(self._backend.probe, index))))
        if not jobs:
            return
        outcomes = await self._lanes.run_round(jobs, self._call_timeout, self._log_hang)
        for index, _ in jobs:
            outcome: Outcome | None = outcomes.get(index)
            if outcome is None:
                self.apply(index, LivenessFailed(f"no answer within {self._call_timeout:g}s"))
                continue
            value, exc = outcome
            if exc is not None:
                what = "probe" if index in probing else "gpu discovery"
                log.error(f"{what} failed unexpectedly", gpu=index, error=repr(exc))
            elif index in probing:
                stale = self._event_counts.get(index, 0) != probing[index]
                self._apply_probe(index, value, stale=stale)
            else:
                self._redescribed(index, value)

    def _log_hang(self, index: int) -> None:
        # Where liveness is judged, the verdict's line says it (after the strikes it takes):
        # one line for the hang, not one more for its first poll.
        checked = self._store.plan.health.checks_device
        (log.debug if checked else log.warning)(
            "nvml call did not return within its limit; the gpu keeps its thread",
            gpu=index,
            limit_s=self._call_timeout,
        )

    def _redescribed(self, index: int, gpu: Gpu) -> None:
        """A GPU described again by a poll: take it in when it now answers."""
        if not gpu.uuid:
            return
        if has(gpu, LOST):
            self.apply(index, GpuLost())
            return
        if has(gpu, DISCOVERY):
            return  # still not describable; the next poll asks again
        self._take_description(gpu)
        self.apply(index, Responding())
        self._reregister_events()

    def apply(self, index: int, event: HealthEvent) -> None:
        """Apply one health event to one GPU, logging a change of health (see
        :func:`~gpuagent.gpu.readings.health_line`); a GPU back on the bus has its topology
        read again, and the event set follows the GPUs that answer."""
        before = self._store.snapshot.gpu(index)
        # A reloaded policy judges events from then on; past verdicts stand.
        policy = self._store.plan.health
        snapshot = self._store.update(
            lambda s: map_gpu(s, index, lambda gpu: recorded(gpu, event, policy))
        )
        after = snapshot.gpu(index)
        if before is None or after is None:
            return
        line = health_line(index, before, after, event, policy)
        if line is not None:
            emit = log.warning if line.warning else log.info
            emit(line.event, **line.fields, **self._hang_evidence(index, event))
        was_lost, is_lost = has(before, LOST), has(after, LOST)
        if was_lost and not is_lost:
            # A GPU that fell off the bus and answers again may sit elsewhere: re-read topology,
            # and register its events again.
            self._spawn_refresh()
            self._reregister_events()
        elif is_lost and not was_lost:
            self._reregister_events()  # a set holding a lost GPU fails every wait

    def _hang_evidence(self, index: int, event: HealthEvent) -> dict[str, object]:
        """For a failed liveness check: the call the GPU hangs in, and for how long."""
        if isinstance(event, LivenessFailed):
            calls = self._lanes.in_flight(index)
            if calls:
                now = self._backend.calls.now()
                return {"call": calls[0].name, "call_running_s": round(now - calls[0].started, 1)}
        return {}

    def _reregister_events(self) -> None:
        """Have the event thread rebuild its registrations: every GPU that answers."""
        snapshot = self._store.snapshot
        answering = tuple(
            g.index
            for g in snapshot.gpus
            if not has(g, LOST)
            and g.index not in self._undescribed
            and g.index in self._indexes
            and not self._lanes.busy(g.index)
        )
        self._events.register(answering)

    def _spawn_refresh(self) -> None:
        self._spawn(self._refresh_topology)

    def _spawn_refresh_after(self, futures: list[asyncio.Future[Any]]) -> None:
        """Read the topology again once the stalled GPUs' parts have returned."""

        async def later() -> None:
            await asyncio.wait(futures)
            await self._refresh_topology()

        self._spawn(later)

    def _spawn(self, work: Callable[[], Coroutine[Any, Any, None]]) -> None:
        if self._closed:
            return
        task = asyncio.get_running_loop().create_task(work())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _refresh_topology(self) -> None:
        control = self._lanes.control
        if control.busy:
            return  # an earlier refresh has not returned: it will do
        # Not wait_for: before Python 3.12 it swallows a cancellation (close()) that arrives as
        # the read returns, and the refresh would then write the store after the monitor closed.
        try:
            async with asyncio.timeout(self._call_timeout):
                topology: Topology = await control.submit(self._backend.refresh_topology)
        except Exception as exc:
            log.warning("topology refresh failed", error=repr(exc))
            return
        self._store.update(lambda s: replace(s, topology=topology))
        log.info("topology refreshed", nvlink_pairs=sum(1 for x in topology.links if x.nvlinks))

    def _on_event(self, received: DriverEvent) -> None:
        index = received.index
        self._event_counts[index] = self._event_counts.get(index, 0) + 1
        self._previous[index] = after_event(self._previous.get(index, Previous()), received.event)
        self.apply(index, received.event)

    def _apply_probe(self, index: int, probe: Probe, *, stale: bool = False) -> None:
        judged = judge_probe(probe, self._previous.get(index, Previous()), stale=stale)
        self._previous[index] = judged.previous
        for event in judged.events:
            self.apply(index, event)
        if judged.keep_readings:
            telemetry = judged.telemetry
            self._store.update(
                lambda s: map_gpu(s, index, lambda g: with_readings(g, probe, telemetry))
            )
            self._freshness.read(index)

    # ----- bookkeeping -------------------------------------------------------------------------
    def call_totals(self) -> list[tuple[str, CallStats]]:
        """NVML calls by name (each pynvml function, and ``init``/``discover``/``probe``)."""
        return self._backend.calls.stats()

    @property
    def gpu_indexes(self) -> Sequence[int]:
        return self._indexes
