"""Start-up within a budget: every NVML call has a time limit, the whole start-up a budget.

The budget is ``--nvml-timeout``, by default scaled with the GPU count
(:func:`startup_budget`). Start-up jobs are awaited a tick at a time: a job whose current call
has run past the per-call limit, or that the budget runs out on, *stalls* — start-up goes on
without it and takes it in when it returns. Meanwhile the store says what start-up waits for
(``/readyz`` shows it), with the call each job is in and for how long, and a line is logged
every :data:`STARTUP_LOG_EVERY_S`. A retried job awaits the same job again, never a new one
queued behind it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, TypeVar

import structlog

from gpuagent.domain.devices import Condition, DriverState, Gpu, P2PLevel, Topology
from gpuagent.domain.health import LOST, UNRESPONSIVE
from gpuagent.gpu.backend import Backend, DriverUnavailable
from gpuagent.gpu.calls import InFlight
from gpuagent.gpu.lanes import Lanes, timed
from gpuagent.gpu.readings import has
from gpuagent.gpu.topology import GpuLinks
from gpuagent.gpu.workers import Worker
from gpuagent.state.store import DeviceStore

log = structlog.get_logger("gpuagent.monitor")
T = TypeVar("T")

__all__ = [
    "Discovered",
    "Pending",
    "Stalled",
    "Startup",
    "describe_and_register",
    "startup_budget",
]

#: Start-up budget without ``--nvml-timeout``: this much, plus :data:`STARTUP_PER_GPU_S` per GPU.
STARTUP_BASE_S = 10.0
STARTUP_PER_GPU_S = 5.0
#: How often start-up looks at the calls in flight (and republishes what it waits for).
STARTUP_TICK_S = 0.1
#: How often start-up logs what it is still waiting for.
STARTUP_LOG_EVERY_S = 5.0


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
class Pending:
    """A start-up job on a worker: the future, and what it is for."""

    worker: Worker
    future: asyncio.Future[Any]
    what: str


@dataclass
class Discovered:
    """What discovery found: the GPUs to advertise (stalled ones as placeholders), those that
    still need describing, and the discoveries that stalled, to take in when they return."""

    gpus: list[Gpu] = field(default_factory=list)
    undescribed: set[int] = field(default_factory=set)
    late: dict[int, asyncio.Future[Any]] = field(default_factory=dict)


def describe_and_register(backend: Backend, index: int, events: bool) -> Gpu:
    """On GPU ``index``'s worker: describe it, then register it for health events."""
    gpu = backend.describe(index)
    if events and gpu.uuid and not has(gpu, LOST):
        problem = backend.register_events(index)
        if problem is not None:
            log.error("no health events for this gpu; relying on probes", gpu=index,
                      error=problem)  # fmt: skip
    return gpu


class Startup:
    """The jobs of start-up on the monitor's threads, awaited within the per-call limit
    (``call_timeout``) and a deadline; what start-up waits for, published in the store's
    driver state."""

    def __init__(
        self,
        store: DeviceStore,
        backend: Backend,
        lanes: Lanes,
        *,
        call_timeout: float,
        clock: Callable[[], float],
    ) -> None:
        self._store = store
        self._backend = backend
        self._calls = backend.calls
        self._lanes = lanes
        self._call_timeout = call_timeout
        self._clock = clock
        # Start-up jobs by name ("init", "count", …): a retry awaits the same job, never a new one.
        self._jobs: dict[str, Pending] = {}

    async def job(self, worker: Worker, key: str, fn: Callable[[], T]) -> T:
        """``fn`` on ``worker``, or the same job again if an earlier one has not returned.

        Raises :class:`Stalled` when one of its NVML calls runs past the per-call limit.
        """
        pending = self._jobs.get(key)
        if pending is None or pending.future.done():
            pending = Pending(worker, worker.submit(timed(self._calls, key, fn)), key)
            self._jobs[key] = pending
        done, stalled = await self.gather({0: pending}, None, None, key)
        if 0 in stalled:
            raise Stalled(stalled[0])
        self._jobs.pop(key, None)
        result: T = done[0]
        return result

    async def discover(
        self, count: int, deadline: float, budget: float, *, events: bool
    ) -> Discovered:
        """Describe every GPU on its own lane at once; stalled ones become placeholders."""
        jobs = {
            index: self._on_lane(
                index,
                timed(
                    self._calls,
                    "discover",
                    partial(describe_and_register, self._backend, index, events),
                ),
                f"gpu{index} discovery",
            )
            for index in range(count)
        }
        done, stalled = await self.gather(jobs, deadline, budget, "discovering gpus")
        found = Discovered()
        for index in range(count):
            gpu = done.get(index)
            if isinstance(gpu, Gpu) and gpu.uuid:
                found.gpus.append(gpu)
                if gpu.health.conditions:
                    found.undescribed.add(index)
                continue
            found.undescribed.add(index)
            uuid = self._backend.uuid_of(index)
            if index in stalled:
                found.late[index] = jobs[index].future
                if uuid:
                    detail = f"discovery did not finish: {stalled[index]}"
                    found.gpus.append(Gpu.undescribed(index, uuid, Condition(UNRESPONSIVE, detail)))
        return found

    async def read_topology(
        self, described: tuple[Gpu, ...], deadline: float, budget: float
    ) -> tuple[Topology, list[asyncio.Future[Any]]]:
        """Each described GPU walks its links and reads its pairs on its own lane, at once:
        the topology, and the parts that stalled (read again once they return)."""
        begin = partial(self._backend.begin_topology, described)
        await self.job(self._lanes.control, "topology", begin)
        jobs = {
            g.index: self._on_lane(
                g.index, partial(self._topology_part, g.index), f"gpu{g.index} topology"
            )
            for g in described
            if not self._lanes.busy(g.index)
        }
        done, stalled = await self.gather(jobs, deadline, budget, "reading topology")
        walks: dict[int, GpuLinks | None] = {}
        levels: dict[tuple[int, int], P2PLevel | None] = {}
        for index, (walk, pairs) in done.items():
            walks[index] = walk
            levels.update(pairs)
        return self._backend.end_topology(walks, levels), [jobs[k].future for k in stalled]

    def _topology_part(
        self, index: int
    ) -> tuple[GpuLinks | None, list[tuple[tuple[int, int], P2PLevel | None]]]:
        return self._backend.walk_links(index), self._backend.ancestors(index)

    def _on_lane(self, index: int, fn: Callable[[], Any], what: str) -> Pending:
        lane = self._lanes.lane(index)
        return Pending(lane, lane.submit(fn), what)

    async def gather(
        self,
        jobs: Mapping[int, Pending],
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
                    if self._finished(pending, per_gpu=deadline is not None):
                        results[key] = pending.future.result()
                elif (stuck := self._stuck(pending.worker, now)) is not None:
                    del waiting[key]
                    stalled[key] = self._stalled(pending, stuck, now)
            if waiting and deadline is not None and now >= deadline:
                stalled.update(self._past_budget(waiting, now, budget))
                break
            if waiting:
                last_log = self._report(phase, waiting, now, last_log)
        return results, stalled

    @staticmethod
    def _finished(pending: Pending, *, per_gpu: bool) -> bool:
        """Whether the finished job ``pending`` has a result; its failure raised, or logged when
        it is a per-GPU job (start-up goes on without that GPU)."""
        exc = pending.future.exception()
        if exc is None:
            return True
        if not per_gpu:
            raise exc
        log.error("start-up job failed", job=pending.what, error=repr(exc))
        return False

    def _stalled(self, pending: Pending, stuck: InFlight, now: float) -> str:
        """What ``pending`` stalled in: ``stuck``, a call past the per-call limit (logged)."""
        log.error(
            "nvml call did not return within its limit; moving on without it",
            job=pending.what,
            call=stuck.name,
            running_s=round(now - stuck.started, 1),
            limit_s=self._call_timeout,
        )
        # No elapsed time: this text becomes a condition's detail, a label value.
        return f"{stuck.name} did not return within {self._call_timeout:g}s"

    def _past_budget(
        self, waiting: Mapping[int, Pending], now: float, budget: float | None
    ) -> dict[int, str]:
        """What each job still ``waiting`` stalled in when the start-up budget ran out (logged)."""
        log.error(
            "nvml start-up exceeded --nvml-timeout; going on without what is missing",
            nvml_timeout_s=budget,
            still_waiting_for=self._waiting_text(waiting, now),
        )
        return {
            key: f"{pending.what} past --nvml-timeout ({budget:g}s)"
            for key, pending in waiting.items()
        }

    def _report(
        self, phase: str, waiting: Mapping[int, Pending], now: float, last_log: float
    ) -> float:
        """Say in the store what ``phase`` waits for, and log it every
        :data:`STARTUP_LOG_EVERY_S`; when it was last logged."""
        text = self._waiting_text(waiting, now)
        self.publish(f"{phase}: {text}")
        if now - last_log < STARTUP_LOG_EVERY_S:
            return last_log
        log.info("nvml start-up in progress", phase=phase, waiting_for=text)
        return now

    def _stuck(self, worker: Worker, now: float) -> InFlight | None:
        """The call ``worker`` has been in for longer than the per-call limit, if any."""
        for call in self._calls.in_flight(worker.ident):
            if now - call.started > self._call_timeout:
                return call
        return None

    def _waiting_text(self, waiting: Mapping[int, Pending], now: float) -> str:
        parts = []
        for pending in waiting.values():
            calls = self._calls.in_flight(pending.worker.ident)
            inside = "".join(f" in {c.name} for {now - c.started:.1f}s" for c in calls)
            parts.append(pending.what + inside)
        return "; ".join(parts)

    def publish(self, text: str) -> None:
        """Say in the store what start-up is waiting for (``""``: nothing)."""
        self._store.update(
            lambda s: (
                s
                if s.driver.waiting == text
                else replace(s, driver=replace(s.driver, waiting=text))
            )
        )

    def unavailable(self, exc: Exception) -> DriverUnavailable:
        """The driver as down in the store, for a failed or stalled start; the error to raise."""
        error = str(exc) or "nvml did not answer"
        if isinstance(exc, Stalled):
            error = f"nvml did not answer: {exc.detail}"
        self._store.update(lambda s: replace(s, driver=DriverState(up=False, error=error)))
        return DriverUnavailable(error)
