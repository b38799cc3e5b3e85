"""The NVML poller: start-up, driver events and periodic probes feeding the device store.

Start-up survives a slow driver: each GPU is described (and registered for events, and its part
of the topology read) on a worker thread of its own, all GPUs at once; every NVML call has a time
limit (``call_timeout``) and the whole start-up a budget (``--nvml-timeout``, by default scaled
with the GPU count). A GPU whose call does not return in time is advertised unhealthy
(``unresponsive``) and taken in once the call returns; no job is ever queued behind one that has
not returned. Meanwhile the store says what the agent is waiting for (``/readyz`` shows it).

Then two loops share the backend: a daemon thread blocks in the driver's event wait and hands
each event to the event loop, and at the poll interval a probe round checks every GPU's liveness
and reads its telemetry, one GPU after the other on one worker thread (``nvml-poll``), and hands
the results to the loop at once. A GPU whose probe runs past the per-call limit keeps that thread
to itself until its call returns (so it stalls only itself); the GPUs after it move to a fresh
thread. Each GPU's state changes only through its own events and probes.

The event wait blocks up to ``event_wait_ms`` (5 s, as NVIDIA's plugin). nvml.h promises nothing
for an event set freed, or NVML shut down, while another thread waits on it, so neither is done
under a wait: :meth:`GpuMonitor.close` returns at once, and the event thread releases the driver
when its wait returns (a process that exits first leaves that to the kernel).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, TypeVar

import structlog

from gpuagent.domain import xids
from gpuagent.domain.devices import (
    Condition,
    DriverState,
    Gpu,
    GpuHealth,
    P2PLevel,
    Snapshot,
    Telemetry,
)
from gpuagent.domain.health import (
    DISCOVERY,
    LOST,
    UNRESPONSIVE,
    GpuLost,
    GpuReset,
    HealthEvent,
    LivenessFailed,
    RecoveryActionChanged,
    Responding,
    RowRemapState,
    XidError,
    record_event,
)
from gpuagent.gpu.backend import Backend, DriverEvent, DriverUnavailable, EventWaitError, Probe
from gpuagent.gpu.calls import CallStats, InFlight
from gpuagent.gpu.topology import GpuLinks
from gpuagent.gpu.workers import Worker
from gpuagent.state.store import DeviceStore

log = structlog.get_logger("gpuagent.monitor")
T = TypeVar("T")

#: Start-up budget without ``--nvml-timeout``: this much, plus :data:`STARTUP_PER_GPU_S` per GPU.
STARTUP_BASE_S = 10.0
STARTUP_PER_GPU_S = 5.0
#: How often start-up looks at the calls in flight (and republishes what it waits for).
STARTUP_TICK_S = 0.1
#: How often start-up logs what it is still waiting for.
STARTUP_LOG_EVERY_S = 5.0
#: NVLink counters count KiB; DCGM's bandwidth is in MB (1024 KiB) per second.
KIB_PER_MB = 1024.0
#: How long one event wait blocks (a wait that times out raises NVML_ERROR_TIMEOUT).
EVENT_WAIT_MS = 5000
#: Shortest and longest pause between event waits while they keep failing.
EVENT_BACKOFF_MIN_S = 0.5
EVENT_BACKOFF_MAX_S = 30.0

__all__ = ["CallStats", "GpuMonitor", "startup_budget"]


def startup_budget(gpus: int, nvml_timeout: float | None = None) -> float:
    """The start-up time budget for ``gpus`` GPUs: ``--nvml-timeout``, or scaled with the count."""
    if nvml_timeout is not None:
        return nvml_timeout
    return STARTUP_BASE_S + STARTUP_PER_GPU_S * gpus


class Stalled(Exception):
    """A start-up job did not finish in time; ``detail`` says what it was waiting for."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


@dataclass
class _Pending:
    """A start-up job on a worker: the future, and what it is for."""

    worker: Worker
    future: asyncio.Future[Any]
    what: str


#: A job's outcome: its value, or the exception it raised.
_Outcome = tuple[Any, Exception | None]


class _Round:
    """One poll's jobs (a probe or a description per GPU), run one after the other on one thread.

    The loop awaits the whole round (one wake-up per poll); meanwhile it can see which GPU's job
    is running, and since when, and take back the jobs that have not started (:meth:`detach`),
    so that a GPU whose call hangs keeps the thread while the others move on.
    """

    def __init__(self, jobs: Sequence[tuple[int, Callable[[], Any]]], clock: Callable[[], float]):
        self._jobs = list(reversed(jobs))
        self._clock = clock
        self._lock = threading.Lock()
        self._results: dict[int, _Outcome] = {}
        self.current: tuple[int, float] | None = None  # (GPU index, when its job started)

    def run(self) -> None:
        """On the worker thread: each job in turn until none is left (or they were taken)."""
        while True:
            with self._lock:
                if not self._jobs:
                    self.current = None
                    return
                index, fn = self._jobs.pop()
                self.current = (index, self._clock())
            try:
                outcome: _Outcome = (fn(), None)
            except Exception as exc:  # delivered to the loop with the GPU it belongs to
                outcome = (None, exc)
            with self._lock:
                self._results[index] = outcome
                self.current = None

    def left(self, limit: float) -> float:
        """Seconds until the running job reaches ``limit`` (``limit`` when none is running)."""
        current = self.current
        return limit if current is None else current[1] + limit - self._clock()

    def stop_if_past(self, limit: float) -> tuple[int, dict[int, _Outcome], list[int]] | None:
        """If the running job has run ``limit`` seconds or more: take back the jobs not started,
        and return ``(its GPU, outcomes so far, GPUs whose job never started)``; the thread stops
        after that job. ``None`` (nothing taken) otherwise."""
        with self._lock:
            current = self.current
            if current is None or self._clock() - current[1] < limit:
                return None
            rest = [index for index, _ in reversed(self._jobs)]
            self._jobs.clear()
            return current[0], dict(self._results), rest

    def detach(self) -> None:
        """Drop the jobs not started: the thread stops after the job it is in (if any)."""
        with self._lock:
            self._jobs.clear()

    def outcomes(self) -> dict[int, _Outcome]:
        with self._lock:
            return dict(self._results)


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
        self._event_wait_ms = event_wait_ms
        self._event_backoff_max = event_backoff_max
        self._clock = clock
        self._control = Worker("nvml-control")
        self._indexes: tuple[int, ...] = ()
        # GPUs with a worker thread of their own: every GPU while start-up describes them all at
        # once, later only a GPU whose call has not returned. The others share ``_shared``.
        self._lanes: dict[int, Worker] = {}
        self._shared: Worker | None = None
        # Start-up jobs by name ("init", "count", …): a retry awaits the same job, never a new one.
        self._jobs: dict[str, _Pending] = {}
        # GPUs that still need describing (a description failed, stalled or never finished).
        self._undescribed: set[int] = set()
        # The recovery action each GPU's probes last read; events are transitions on their own.
        self._probed_actions: dict[int, int] = {}
        # Each GPU's volatile double-bit ECC count as last read (a drop is evidence of a reset).
        self._dbe_counts: dict[int, float] = {}
        # Each GPU's NVLink data counter as last read: (KiB, when), for the bandwidth rate.
        self._nvlink: dict[int, tuple[float, float]] = {}
        self._background: set[asyncio.Task[None]] = set()
        # Driver events applied per GPU; a probe that started before the latest event is stale.
        self._event_counts: dict[int, int] = {}
        self._poll_now = asyncio.Event()
        self._stop_events = threading.Event()
        # The GPUs the event thread should (re-)register before its next wait; None: no change.
        self._event_gpus: tuple[int, ...] | None = None
        self._event_lock = threading.Lock()
        self._event_thread: threading.Thread | None = None
        # Whether the event thread is inside NVML (a wait, a re-registration); under _event_lock.
        self._events_in_nvml = False
        # Whether the event thread releases the driver as it leaves (close() found it in a wait).
        self._release_on_exit = False
        self._released = False
        self._events_done = asyncio.Event()  # set once the event thread has left
        self._started = False
        self._initialised = False
        self._closed = False  # close() was called: no new work is started

    # ----- start-up ----------------------------------------------------------------------------
    async def start(self) -> None:
        """Initialise the driver and discover GPUs; raises :class:`DriverUnavailable` on failure.

        Never waits longer than the per-call limit for one call, nor longer than the start-up
        budget overall; what did not finish in time is taken in when it does.
        """
        started = self._clock()
        self._publish_waiting("nvmlInit")
        try:
            driver = await self._job(self._control, "init", self._backend.init, started)
            self._initialised = True
            count = await self._job(self._control, "count", self._backend.count, started)
        except (DriverUnavailable, Stalled) as exc:
            raise self._unavailable(exc) from exc
        budget = startup_budget(count, self._nvml_timeout)
        deadline = started + budget
        self._store.update(lambda s: replace(s, driver=replace(driver, waiting="gpu discovery")))
        try:
            events_error = await self._job(
                self._control, "events", self._backend.create_event_set, started
            )
        except Stalled as exc:
            events_error = exc.detail
        if events_error is not None:
            log.error("no health events; relying on probes", error=events_error)
        self._indexes = tuple(range(count))
        for index in self._indexes:
            self._lanes.setdefault(index, Worker(f"nvml-gpu{index}"))
        gpus = await self._discover(count, deadline, budget, events=events_error is None)
        topology = await self._read_topology(gpus, deadline, budget)
        self._reclaim()  # from now on the GPUs share one thread, except those still in a call
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

    async def _discover(
        self, count: int, deadline: float, budget: float, *, events: bool
    ) -> list[Gpu]:
        """Describe every GPU on its own worker at once; stalled ones become placeholders."""
        jobs = {
            index: _Pending(
                self._lanes[index],
                self._lanes[index].submit(
                    self._timed("discover", partial(self._describe_and_register, index, events))
                ),
                f"gpu{index} discovery",
            )
            for index in range(count)
        }
        done, stalled = await self._gather(jobs, deadline, budget, "discovering gpus")
        gpus: list[Gpu] = []
        for index in range(count):
            gpu = done.get(index)
            if isinstance(gpu, Gpu) and gpu.uuid:
                gpus.append(gpu)
                if gpu.health.conditions:
                    self._undescribed.add(index)
                continue
            self._undescribed.add(index)
            uuid = self._backend.uuid_of(index)
            if index in stalled:
                jobs[index].future.add_done_callback(partial(self._late_description, index))
                if uuid:
                    detail = f"discovery did not finish: {stalled[index]}"
                    gpus.append(Gpu.undescribed(index, uuid, Condition(UNRESPONSIVE, detail)))
        return gpus

    def _describe_and_register(self, index: int, events: bool) -> Gpu:
        """On GPU ``index``'s worker: describe it, then register it for health events."""
        gpu = self._backend.describe(index)
        if events and gpu.uuid and not _has(gpu, LOST):
            problem = self._backend.register_events(index)
            if problem is not None:
                log.error("no health events for this gpu; relying on probes", gpu=index,
                          error=problem)  # fmt: skip
        return gpu

    async def _read_topology(self, gpus: Sequence[Gpu], deadline: float, budget: float) -> Any:
        """Each described GPU walks its links and reads its pairs on its own worker, at once."""
        described = tuple(g for g in gpus if g.index not in self._undescribed)
        await self._job(
            self._control,
            "topology",
            partial(self._backend.begin_topology, described),
            self._clock(),
        )
        jobs = {
            g.index: _Pending(
                self._lanes[g.index],
                self._lanes[g.index].submit(partial(self._topology_part, g.index)),
                f"gpu{g.index} topology",
            )
            for g in described
            if not self._lanes[g.index].busy
        }
        done, stalled = await self._gather(jobs, deadline, budget, "reading topology")
        walks: dict[int, GpuLinks | None] = {}
        levels: dict[tuple[int, int], P2PLevel | None] = {}
        for index, (walk, pairs) in done.items():
            walks[index] = walk
            levels.update(pairs)
        if stalled:
            self._spawn_refresh_after(stalled, jobs)
        return self._backend.end_topology(walks, levels)

    def _topology_part(
        self, index: int
    ) -> tuple[GpuLinks | None, list[tuple[tuple[int, int], P2PLevel | None]]]:
        return self._backend.walk_links(index), self._backend.ancestors(index)

    async def _job(self, worker: Worker, key: str, fn: Callable[[], T], started: float) -> T:
        """``fn`` on ``worker``, or the same job again if an earlier one has not returned.

        Raises :class:`Stalled` when one of its NVML calls runs past the per-call limit.
        """
        pending = self._jobs.get(key)
        if pending is None or pending.future.done():
            pending = _Pending(worker, worker.submit(self._timed(key, fn)), key)
            self._jobs[key] = pending
        done, stalled = await self._gather({0: pending}, None, None, key)
        if 0 in stalled:
            raise Stalled(stalled[0])
        self._jobs.pop(key, None)
        result: T = done[0]
        return result

    async def _gather(
        self,
        jobs: Mapping[int, _Pending],
        deadline: float | None,
        budget: float | None,
        phase: str,
    ) -> tuple[dict[int, Any], dict[int, str]]:
        """Wait for ``jobs``: ``(results, {key: what it stalled in})``.

        A job stalls when its current NVML call has run past the per-call limit, or when the
        start-up budget (``deadline``) runs out. Exceptions from a job are raised, except for
        per-GPU jobs (keys >= 0 with a deadline), whose failure is logged and left out.
        """
        results: dict[int, Any] = {}
        stalled: dict[int, str] = {}
        waiting = dict(jobs)
        last_log = self._clock()
        while waiting:
            await asyncio.wait(
                [p.future for p in waiting.values()],
                timeout=STARTUP_TICK_S,
                return_when=asyncio.FIRST_COMPLETED,
            )
            now = self._clock()
            for key, pending in list(waiting.items()):
                if pending.future.done():
                    del waiting[key]
                    exc = pending.future.exception()
                    if exc is None:
                        results[key] = pending.future.result()
                    elif deadline is None:
                        raise exc
                    else:
                        log.error("start-up job failed", job=pending.what, error=repr(exc))
                    continue
                stuck = self._stuck(pending.worker, now)
                if stuck is not None:
                    log.error(
                        "nvml call did not return within its limit; moving on without it",
                        job=pending.what,
                        call=stuck.name,
                        running_s=round(now - stuck.started, 1),
                        limit_s=self._call_timeout,
                    )
                    # No elapsed time: this text becomes a condition's detail, a label value.
                    stalled[key] = f"{stuck.name} did not return within {self._call_timeout:g}s"
                    del waiting[key]
            if waiting and deadline is not None and now >= deadline:
                detail = self._waiting_text(waiting, now)
                log.error(
                    "nvml start-up exceeded --nvml-timeout; going on without what is missing",
                    nvml_timeout_s=budget,
                    still_waiting_for=detail,
                )
                for key, pending in waiting.items():
                    stalled[key] = f"{pending.what} past --nvml-timeout ({budget:g}s)"
                break
            if waiting:
                text = self._waiting_text(waiting, now)
                self._publish_waiting(f"{phase}: {text}")
                if now - last_log >= STARTUP_LOG_EVERY_S:
                    last_log = now
                    log.info("nvml start-up in progress", phase=phase, waiting_for=text)
        return results, stalled

    def _stuck(self, worker: Worker, now: float) -> InFlight | None:
        """The call ``worker`` has been in for longer than the per-call limit, if any."""
        for call in self._backend.calls.in_flight(worker.ident):
            if now - call.started > self._call_timeout:
                return call
        return None

    def _waiting_text(self, waiting: Mapping[int, _Pending], now: float) -> str:
        parts = []
        for pending in waiting.values():
            calls = self._backend.calls.in_flight(pending.worker.ident)
            inside = "".join(f" in {c.name} for {now - c.started:.1f}s" for c in calls)
            parts.append(pending.what + inside)
        return "; ".join(parts)

    def _publish_waiting(self, text: str) -> None:
        self._store.update(
            lambda s: (
                s
                if s.driver.waiting == text
                else replace(s, driver=replace(s.driver, waiting=text))
            )
        )

    def _unavailable(self, exc: Exception) -> DriverUnavailable:
        error = str(exc) or "nvml did not answer"
        if isinstance(exc, Stalled):
            error = f"nvml did not answer: {exc.detail}"
        self._store.update(lambda s: replace(s, driver=DriverState(up=False, error=error)))
        return DriverUnavailable(error)

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
        index = gpu.index
        described = not _has(gpu, DISCOVERY) and not _has(gpu, LOST)
        if described:
            self._undescribed.discard(index)

        def change(snapshot: Snapshot) -> Snapshot:
            before = snapshot.gpu(index)
            if before is None:
                gpus = tuple(sorted((*snapshot.gpus, gpu), key=lambda g: g.index))
                return replace(snapshot, gpus=gpus)
            kept = tuple(
                c for c in before.health.conditions if c.kind not in (DISCOVERY, UNRESPONSIVE)
            )
            merged = replace(
                gpu,
                health=GpuHealth(_union(kept, gpu.health.conditions)),
                xid_counts=before.xid_counts,
                last_xid=before.last_xid,
                telemetry=before.telemetry,
            )
            return _map_gpu(snapshot, index, lambda _: merged)

        self._store.update(change)
        if described:
            self._spawn_refresh()

    # ----- running -----------------------------------------------------------------------------
    async def run(self) -> None:
        """Keep the store current until cancelled; retries driver initialisation until it works."""
        while not self._started:
            before = self._store.snapshot.driver.error  # as the last failed start said it
            try:
                await self.start()
            except DriverUnavailable as exc:
                # Once per error, not every retry (a node without its driver retries for ever).
                (log.warning if str(exc) != before else log.debug)(
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
                # (Not asyncio.wait_for: before Python 3.12 it swallows a cancellation that
                # arrives as the event is set, and this loop would then never end.)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self._poll_interval):
                        await self._poll_now.wait()
                self._poll_now.clear()
        finally:
            self._stop_events.set()

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
        running = [w.submit(_nothing) for w in (self._shared, self._control) if w and w.busy]
        if running:
            await asyncio.wait(running, timeout=limit)
        with self._event_lock:
            self._stop_events.set()
            in_wait = self._events_in_nvml
            self._release_on_exit = in_wait
        if in_wait:
            log.debug("nvml event wait in progress; the event thread releases the driver after it")
        else:
            await self._release_on(self._control, max(0.0, deadline - loop.time()))
        self._control.close()
        for worker in {*self._lanes.values(), *([self._shared] if self._shared else [])}:
            worker.close()

    async def wait_closed(self) -> None:
        """After :meth:`close`: until the event thread has left (and released the driver, if
        that was left to it). Callers bound it; the process need not wait for it."""
        if self._event_thread is not None:
            await self._events_done.wait()

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
        others += [f"gpu{i}'s probe" for i, lane in list(self._lanes.items()) if lane.busy]
        if self._shared is not None and self._shared.busy:
            others.append("a poll")
        if self._control.busy and threading.get_ident() != self._control.ident:
            others.append("a topology read")  # (the event thread releasing as it leaves)
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
        self._reclaim()
        jobs: list[tuple[int, Callable[[], Any]]] = []
        probing: dict[int, int] = {}  # GPU -> driver events applied when its probe was queued
        for index in self._indexes:
            lane = self._lanes.get(index)
            if lane is not None and lane.busy:
                # The call, not how long it has run: the text may become the detail of the GPU's
                # condition, a label value that must stay put while the GPU hangs (the elapsed
                # time is logged with the verdict).
                calls = self._backend.calls.in_flight(lane.ident)
                inside = "".join(f" ({c.name})" for c in calls)
                self.apply(index, LivenessFailed(f"an earlier nvml call has not returned{inside}"))
                continue
            if index in self._undescribed:
                describe = partial(self._describe_and_register, index, True)
                jobs.append((index, self._timed("discover", describe)))
                continue
            probing[index] = self._event_counts.get(index, 0)
            jobs.append((index, self._timed("probe", partial(self._backend.probe, index))))
        if not jobs:
            return
        outcomes = await self._run_round(jobs)
        for index, _ in jobs:
            outcome = outcomes.get(index)
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

    async def _run_round(self, jobs: list[tuple[int, Callable[[], Any]]]) -> dict[int, _Outcome]:
        """Run ``jobs`` in turn on the shared thread; the outcome of each that finished in time.

        A job that runs past the per-call limit keeps its thread (its GPU's own from now on,
        until the call returns); the jobs after it go on on a fresh shared thread.
        """
        outcomes: dict[int, _Outcome] = {}
        while jobs:
            round_ = _Round(jobs, self._clock)
            worker = self._shared = self._shared or Worker("nvml-poll")
            future = worker.submit(round_.run)
            try:
                stuck = await self._await_round(round_, future)
            except BaseException:  # cancelled: the thread stops after the job it is in
                round_.detach()
                raise
            if stuck is None:
                outcomes.update(round_.outcomes())
                return outcomes
            hung, finished, rest = stuck
            outcomes.update(finished)
            # Where liveness is judged, the verdict's line says it (after the strikes it takes):
            # one line for the hang, not one more for its first poll.
            checked = self._store.plan.health.checks_device
            (log.debug if checked else log.warning)(
                "nvml call did not return within its limit; the gpu keeps its thread",
                gpu=hung,
                limit_s=self._call_timeout,
            )
            self._lanes[hung] = worker
            self._shared = None
            jobs = [job for job in jobs if job[0] in rest]
        return outcomes

    async def _await_round(
        self, round_: _Round, future: asyncio.Future[None]
    ) -> tuple[int, dict[int, _Outcome], list[int]] | None:
        """Wait for ``round_``: ``None`` once it is done, or, when a job has run past the per-call
        limit, ``(its GPU, outcomes so far, GPUs not started)`` (the round stops after it)."""
        while not future.done():
            left = round_.left(self._call_timeout)
            if left <= 0:
                stuck = round_.stop_if_past(self._call_timeout)
                if stuck is not None:
                    return stuck
                continue
            await asyncio.wait([future], timeout=left)
        return None

    def _reclaim(self) -> None:
        """GPUs whose own thread has returned share the poll thread again; their threads end."""
        for index, lane in list(self._lanes.items()):
            if not lane.busy:
                del self._lanes[index]
                lane.close()

    def _redescribed(self, index: int, gpu: Gpu) -> None:
        """A GPU described again by a poll: take it in when it now answers."""
        if not gpu.uuid:
            return
        if _has(gpu, LOST):
            self.apply(index, GpuLost())
            return
        if _has(gpu, DISCOVERY):
            return  # still not describable; the next poll asks again
        self._take_description(gpu)
        self.apply(index, Responding())
        self._reregister_events()

    def apply(self, index: int, event: HealthEvent) -> None:
        """Apply one health event to one GPU, logging a change of health.

        One line per change of the GPU's set of conditions (their order, or the liveness
        strikes counted meanwhile, are no change); an XID that changes nothing gets a line of its
        own. A GPU found lost keeps no readings: they are from before it fell off the bus.
        """
        before = self._store.snapshot.gpu(index)
        record = self._record(event)

        def change(gpu: Gpu) -> Gpu:
            after = record(gpu)
            if _has(after, LOST) and (after.telemetry != Telemetry() or after.processes):
                migs = tuple(replace(m, telemetry=Telemetry()) for m in after.mig_devices)
                return replace(after, telemetry=Telemetry(), processes=None, mig_devices=migs)
            return after

        snapshot = self._store.update(lambda s: _map_gpu(s, index, change))
        after = snapshot.gpu(index)
        if before is None or after is None:
            return
        old, new = before.overall_health, after.overall_health
        if set(old.conditions) != set(new.conditions):
            emit = log.info if new.healthy else log.warning
            emit(
                "gpu health changed",
                gpu=index,
                uuid=after.uuid,
                health=new.kubelet_health,
                reason=new.reason,
                cause=type(event).__name__,
                **self._evidence(index, event),
            )
        elif isinstance(event, XidError):
            checked = self._store.plan.health.checks_xid(event.xid)
            (log.warning if checked else log.info)(
                "xid reported",
                gpu=index,
                uuid=after.uuid,
                health=new.kubelet_health,
                **self._evidence(index, event),
            )
        was_lost, is_lost = _has(before, LOST), _has(after, LOST)
        if was_lost and not is_lost:
            # A GPU that fell off the bus and answers again may sit elsewhere: re-read topology,
            # and register its events again.
            self._spawn_refresh()
            self._reregister_events()
        elif is_lost and not was_lost:
            self._reregister_events()  # a set holding a lost GPU fails every wait

    def _evidence(self, index: int, event: HealthEvent) -> dict[str, object]:
        """What a log line about ``event`` says beyond the conditions: an XID's catalog meaning
        and immediate action (as ``gpuagent_xid_errors_total`` labels it), or the call a GPU
        hangs in and for how long."""
        if isinstance(event, XidError):
            entry = xids.lookup(event.xid)
            fields: dict[str, object] = {
                "xid": event.xid,
                "xid_meaning": entry.text,
                "xid_action": entry.action.value,
            }
            if event.gpu_instance is not None:
                fields["gpu_instance"] = event.gpu_instance
            if event.compute_instance is not None:
                fields["compute_instance"] = event.compute_instance
            return fields
        if isinstance(event, LivenessFailed):
            lane = self._lanes.get(index)
            calls = self._backend.calls.in_flight(lane.ident) if lane is not None else []
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
            if not _has(g, LOST)
            and g.index not in self._undescribed
            and g.index in self._indexes
            and not self._busy(g.index)
        )
        with self._event_lock:
            self._event_gpus = answering

    def _spawn_refresh(self) -> None:
        if self._closed:
            return
        task = asyncio.get_running_loop().create_task(self._refresh_topology())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _spawn_refresh_after(
        self, stalled: Mapping[int, str], jobs: Mapping[int, _Pending]
    ) -> None:
        """Read the topology again once the stalled GPUs' parts have returned."""
        if self._closed:
            return
        futures = [jobs[k].future for k in stalled]

        async def later() -> None:
            await asyncio.wait(futures)
            await self._refresh_topology()

        task = asyncio.get_running_loop().create_task(later())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _refresh_topology(self) -> None:
        if self._control.busy:
            return  # an earlier refresh has not returned: it will do
        # Not wait_for: before Python 3.12 it swallows a cancellation (close()) that arrives as
        # the read returns, and the refresh would then write the store after the monitor closed.
        try:
            async with asyncio.timeout(self._call_timeout):
                topology = await self._control.submit(self._backend.refresh_topology)
        except Exception as exc:
            log.warning("topology refresh failed", error=repr(exc))
            return
        self._store.update(lambda s: replace(s, topology=topology))
        log.info("topology refreshed", nvlink_pairs=sum(1 for x in topology.links if x.nvlinks))

    def _record(self, event: HealthEvent) -> Callable[[Gpu], Gpu]:
        # A reloaded policy judges events from then on; past verdicts stand.
        policy = self._store.plan.health
        return lambda gpu: record_event(gpu, event, policy)

    def _on_event(self, received: DriverEvent) -> None:
        index = received.index
        self._event_counts[index] = self._event_counts.get(index, 0) + 1
        if isinstance(received.event, RecoveryActionChanged):
            self._probed_actions[index] = received.event.action
        self.apply(index, received.event)

    def _apply_probe(self, index: int, probe: Probe, *, stale: bool = False) -> None:
        telemetry = replace(probe.telemetry, nvlink_bandwidth_total=self._nvlink_rate(index, probe))
        processes, instances = probe.processes, probe.mig_telemetry

        def readings(gpu: Gpu) -> Gpu:
            migs = gpu.mig_devices
            if instances:
                migs = tuple(
                    replace(m, telemetry=instances[m.uuid]) if m.uuid in instances else m
                    for m in migs
                )
            return replace(gpu, telemetry=telemetry, processes=processes, mig_devices=migs)

        if stale:
            # A driver event arrived while this probe ran: its health readings may predate the
            # event and must not overtake it. Keep the readings; the next probe decides.
            if probe.events == (Responding(),):
                self._store.update(lambda s: _map_gpu(s, index, readings))
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
        dbe = telemetry.ecc_dbe_volatile
        if dbe is not None:
            if dbe < self._dbe_counts.get(index, 0):
                self.apply(index, GpuReset())  # volatile counts restart at a reset
            self._dbe_counts[index] = dbe
        if telemetry.row_remap_pending is not None or telemetry.row_remap_failure is not None:
            self.apply(
                index,
                RowRemapState(
                    pending=bool(telemetry.row_remap_pending),
                    failed=bool(telemetry.row_remap_failure),
                ),
            )
        self._store.update(lambda s: _map_gpu(s, index, readings))

    def _nvlink_rate(self, index: int, probe: Probe) -> float | None:
        """NVLink bandwidth as DCGM reports it: MB/s over all links since the GPU's last reading.

        From the NVLink data counter (KiB, TX + RX) of two readings: its growth over the time
        between them, in units of 1024 KiB. Absent for the first reading, after a counter that
        went back (a driver reload), or without the counter.
        """
        kib = probe.nvlink_kib
        if kib is None:
            self._nvlink.pop(index, None)
            return None
        previous = self._nvlink.get(index)
        self._nvlink[index] = (kib, probe.taken_at)
        if previous is None:
            return None
        seconds = probe.taken_at - previous[1]
        if seconds <= 0 or kib < previous[0]:
            return None
        return (kib - previous[0]) / KIB_PER_MB / seconds

    # ----- driver events -----------------------------------------------------------------------
    def _event_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """Runs on the ``nvml-events`` thread: blocks in the driver, posts events to the loop.

        A failed wait (a lost GPU, an unknown error) makes the monitor probe every GPU to find
        what happened, and the thread waits longer after each failure in a row (from
        ``EVENT_BACKOFF_MIN_S`` up to ``event_backoff_max``) instead of spinning on a driver that
        answers every wait at once. It never enters NVML once stopped; if :meth:`close` found it
        inside, it releases the driver as it leaves.
        """
        try:
            self._wait_for_events(loop)
        finally:
            with self._event_lock:
                self._events_in_nvml = False
                release = self._release_on_exit
            if release:
                self._release()
            _post(loop, self._events_done.set)

    def _wait_for_events(self, loop: asyncio.AbstractEventLoop) -> None:
        backoff = 0.0
        first_pause = min(self._event_wait_ms / 1000, EVENT_BACKOFF_MIN_S)
        while True:
            with self._event_lock:
                if self._stop_events.is_set():
                    return
                self._events_in_nvml = True
            try:
                self._maybe_reregister()
                received = self._backend.wait_event(self._event_wait_ms)
            except EventWaitError as exc:
                with self._event_lock:
                    self._events_in_nvml = False
                first = backoff == 0.0
                backoff = min(max(backoff * 2, first_pause), self._event_backoff_max)
                (log.warning if first else log.debug)(
                    "event wait failed; probing all gpus",
                    error=str(exc),
                    lost=exc.lost,
                    retry_in_s=backoff,
                )
                if not _post(loop, self._poll_now.set):
                    return
                self._stop_events.wait(backoff)
                continue
            with self._event_lock:
                self._events_in_nvml = False
            if backoff:
                log.info("event waits work again")
                backoff = 0.0
            if received is not None and not _post(loop, self._on_event, received):
                return

    def _maybe_reregister(self) -> None:
        with self._event_lock:
            gpus, self._event_gpus = self._event_gpus, None
        if gpus is None:
            return
        failed = self._backend.rebuild_events(gpus)
        for index, error in failed.items():
            log.error("gpu event registration failed", gpu=index, error=error)

    # ----- bookkeeping -------------------------------------------------------------------------
    def _timed(self, name: str, fn: Callable[[], T]) -> Callable[[], T]:
        """``fn`` counted under ``name`` (``probe``, ``discover``, ``init``, …) when it runs."""

        def run() -> T:
            began = time.monotonic()
            failed = True
            try:
                result = fn()
                failed = _failed(result)
                return result
            finally:
                self._backend.calls.record(name, time.monotonic() - began, failed=failed)

        return run

    def call_totals(self) -> list[tuple[str, CallStats]]:
        """NVML calls by name (each pynvml function, and ``init``/``discover``/``probe``)."""
        return self._backend.calls.stats()

    @property
    def gpu_indexes(self) -> Sequence[int]:
        return self._indexes

    def _busy(self, index: int) -> bool:
        """Whether GPU ``index`` is in a call that has not returned, on a thread of its own."""
        lane = self._lanes.get(index)
        return lane is not None and lane.busy


def _nothing() -> None:
    """A job that does nothing: done once the jobs before it on its worker are."""


def _failed(result: object) -> bool:
    if isinstance(result, Probe):
        return result.events != (Responding(),)
    if isinstance(result, Gpu):
        return bool(result.health.conditions) or not result.uuid
    return False


def _has(gpu: Gpu, kind: str) -> bool:
    return any(c.kind == kind for c in gpu.health.conditions)


def _union(first: tuple[Condition, ...], second: tuple[Condition, ...]) -> tuple[Condition, ...]:
    return first + tuple(c for c in second if c not in first)


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
