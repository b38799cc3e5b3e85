"""Hung-call isolation: the threads NVML work runs on, and what a call that does not return costs.

Driver-wide work (init, the event set, topology reads, the release) runs on the control thread
(``nvml-control``). During start-up every GPU has a thread of its own, a lane (``nvml-gpu<i>``),
so all GPUs are described at once. Then the GPUs share one poll thread (``nvml-poll``): a probe
round runs their jobs one after the other on it (one wake-up of the loop per poll, no GIL convoy).
A job that runs past the per-call limit keeps that thread as its GPU's lane until its call
returns, so it stalls only itself; the jobs after it move to a fresh poll thread. No job is ever
queued behind a call that has not returned; a GPU whose lane has returned shares the poll thread
again and its lane ends.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from gpuagent.gpu.calls import InFlight, NvmlCalls
from gpuagent.gpu.readings import work_failed
from gpuagent.gpu.workers import Worker

T = TypeVar("T")

__all__ = ["Lanes", "Outcome", "timed"]

#: A job's outcome: its value, or the exception it raised.
Outcome = tuple[Any, Exception | None]
#: GPU ``index``'s job in a probe round.
Job = tuple[int, Callable[[], Any]]


def timed(calls: NvmlCalls, name: str, fn: Callable[[], T]) -> Callable[[], T]:
    """``fn`` counted under ``name`` (``probe``, ``discover``, ``init``, …) when it runs."""

    def run() -> T:
        began = time.monotonic()
        failed = True
        try:
            result = fn()
            failed = work_failed(result)
            return result
        finally:
            calls.record(name, time.monotonic() - began, failed=failed)

    return run


class _Round:
    """One poll's jobs (a probe or a description per GPU), run one after the other on one thread.

    The loop awaits the whole round (one wake-up per poll); meanwhile it can see which GPU's job
    is running, and since when, and take back the jobs that have not started (:meth:`detach`),
    so that a GPU whose call hangs keeps the thread while the others move on.
    """

    def __init__(self, jobs: Sequence[Job], clock: Callable[[], float]):
        self._jobs = list(reversed(jobs))
        self._clock = clock
        self._lock = threading.Lock()
        self._results: dict[int, Outcome] = {}
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
                outcome: Outcome = (fn(), None)
            except Exception as exc:  # delivered to the loop with the GPU it belongs to
                outcome = (None, exc)
            with self._lock:
                self._results[index] = outcome
                self.current = None

    def left(self, limit: float) -> float:
        """Seconds until the running job reaches ``limit`` (``limit`` when none is running)."""
        current = self.current
        return limit if current is None else current[1] + limit - self._clock()

    def stop_if_past(self, limit: float) -> tuple[int, dict[int, Outcome], list[int]] | None:
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

    def outcomes(self) -> dict[int, Outcome]:
        with self._lock:
            return dict(self._results)


class Lanes:
    """The control thread, the GPUs' own lanes and the shared poll thread of one monitor.

    ``clock`` times probe rounds against the per-call limit; ``calls`` says which call each
    thread is in.
    """

    def __init__(self, calls: NvmlCalls, clock: Callable[[], float]) -> None:
        self._calls = calls
        self._clock = clock
        self.control = Worker("nvml-control")
        # GPUs with a worker thread of their own: every GPU while start-up describes them all at
        # once, later only a GPU whose call has not returned. The others share ``_shared``.
        self._own: dict[int, Worker] = {}
        self._shared: Worker | None = None

    def open(self, indexes: Iterable[int]) -> None:
        """A lane for each of these GPUs (start-up describes them all at once)."""
        for index in indexes:
            self._own.setdefault(index, Worker(f"nvml-gpu{index}"))

    def lane(self, index: int) -> Worker:
        """GPU ``index``'s own lane (while it has one)."""
        return self._own[index]

    def busy(self, index: int) -> bool:
        """Whether GPU ``index`` is in a call that has not returned, on a thread of its own."""
        lane = self._own.get(index)
        return lane is not None and lane.busy

    def in_flight(self, index: int) -> list[InFlight]:
        """The call GPU ``index``'s own lane is in (none without a lane)."""
        lane = self._own.get(index)
        return self._calls.in_flight(lane.ident) if lane is not None else []

    def reclaim(self) -> None:
        """GPUs whose own thread has returned share the poll thread again; their threads end."""
        for index, lane in list(self._own.items()):
            if not lane.busy:
                del self._own[index]
                lane.close()

    async def run_round(
        self, jobs: list[Job], limit: float, on_hang: Callable[[int], None]
    ) -> dict[int, Outcome]:
        """Run ``jobs`` in turn on the shared thread; the outcome of each that finished in time.

        A job that runs past ``limit`` keeps its thread (its GPU's own from now on, until the
        call returns; ``on_hang`` is told the GPU); the jobs after it go on on a fresh shared
        thread.
        """
        outcomes: dict[int, Outcome] = {}
        while jobs:
            round_ = _Round(jobs, self._clock)
            worker = self._shared = self._shared or Worker("nvml-poll")
            future = worker.submit(round_.run)
            try:
                stuck = await self._await_round(round_, future, limit)
            except BaseException:  # cancelled: the thread stops after the job it is in
                round_.detach()
                raise
            if stuck is None:
                outcomes.update(round_.outcomes())
                return outcomes
            hung, finished, rest = stuck
            outcomes.update(finished)
            on_hang(hung)
            self._own[hung] = worker
            self._shared = None
            jobs = [job for job in jobs if job[0] in rest]
        return outcomes

    async def _await_round(
        self, round_: _Round, future: asyncio.Future[None], limit: float
    ) -> tuple[int, dict[int, Outcome], list[int]] | None:
        """Wait for ``round_``: ``None`` once it is done, or, when a job has run past ``limit``,
        ``(its GPU, outcomes so far, GPUs not started)`` (the round stops after it)."""
        while not future.done():
            left = round_.left(limit)
            if left <= 0:
                stuck = round_.stop_if_past(limit)
                if stuck is not None:
                    return stuck
                continue
            await asyncio.wait([future], timeout=left)
        return None

    async def finish_running(self, limit: float) -> None:
        """Wait up to ``limit`` seconds for a poll cut short to finish the probe it is in, and a
        topology read the read it is in (a hung call is not waited out)."""
        running = [w.submit(_nothing) for w in (self._shared, self.control) if w and w.busy]
        if running:
            await asyncio.wait(running, timeout=limit)

    def busy_work(self) -> list[str]:
        """The work that has not returned on these threads (a topology read only when asked
        from another thread than the control thread)."""
        busy = [f"gpu{i}'s probe" for i, lane in list(self._own.items()) if lane.busy]
        if self._shared is not None and self._shared.busy:
            busy.append("a poll")
        if self.control.busy and threading.get_ident() != self.control.ident:
            busy.append("a topology read")  # (the event thread releasing as it leaves)
        return busy

    def close(self) -> None:
        """Let every thread end after the call it is in, if any."""
        self.control.close()
        for worker in {*self._own.values(), *([self._shared] if self._shared else [])}:
            worker.close()


def _nothing() -> None:
    """A job that does nothing: done once the jobs before it on its worker are."""
