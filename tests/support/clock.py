"""Clocks that only move when a test moves them: the simulated driver's, and the waits'."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import Callable

from support.waiting import eventually

#: How long a held sleep waits for its release at most (a deadline for a broken test).
WAIT_S = 30.0


class FakeClock:
    """Seconds, as ``time.monotonic`` would give them; set :attr:`now` to move time."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class ManualClock:
    """Time for code that waits through a clock seam (``now()``, ``wait(event, seconds)``,
    ``call_at(when, callback)``): it moves only when the test calls :meth:`advance`, so a test
    says "ten seconds pass" without spending them, and "nothing else happened" is exact rather
    than a guess about a window.
    """

    def __init__(self, now: float = 0.0) -> None:
        self._now = now
        self._timers: list[tuple[float, asyncio.Future[None], asyncio.Event]] = []
        self._never = asyncio.Event()  # what a timer of call_at waits for besides its time

    def now(self) -> float:
        return self._now

    @property
    def waiting(self) -> int:
        """Waits in progress that nothing is about to end: their time has not come and their
        event is not set (the code is idle until a test moves time or sets the event)."""
        return sum(1 for _, timer, event in self._timers if not timer.done() and not event.is_set())

    async def wait(self, event: asyncio.Event, seconds: float) -> bool:
        timer: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (self._now + seconds, timer, event)
        self._timers.append(entry)
        waiter: asyncio.Future[object] = asyncio.ensure_future(event.wait())
        pending: set[asyncio.Future[object]] = {waiter, timer}  # type: ignore[arg-type]
        try:
            await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            return waiter.done() and not waiter.cancelled()
        finally:
            waiter.cancel()
            timer.cancel()
            self._timers.remove(entry)

    def call_at(self, when: float, callback: Callable[[], None]) -> asyncio.Future[None]:
        """Call ``callback`` once time reaches ``when`` (:meth:`advance` moves it there); the
        timer counts as a wait until then, unless cancelled."""
        timer: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (when, timer, self._never)
        self._timers.append(entry)

        def ended(_: asyncio.Future[None]) -> None:
            self._timers.remove(entry)
            if not timer.cancelled():
                callback()

        timer.add_done_callback(ended)
        return timer

    async def advance(self, seconds: float, *, within: float = 10.0) -> None:
        """Move time ``seconds`` on, ending each wait that falls due in order; after each, give
        the waiting code (real) time to act until it waits again."""
        target = self._now + seconds
        while True:
            due = sorted(
                ((at, timer) for at, timer, _ in self._timers if not timer.done()),
                key=lambda entry: entry[0],
            )
            if not due or due[0][0] > target:
                self._now = target
                return
            at, timer = due[0]
            self._now = max(self._now, at)
            timer.set_result(None)
            await eventually(self._back_to(self.waiting + 1), within=within, what="the next wait")

    def _back_to(self, count: int) -> Callable[[], bool]:
        return lambda: self.waiting >= count


class Sleeps:
    """A ``sleep`` for the simulated driver that records what it was asked instead of sleeping.

    ``asked`` holds the seconds of each call, in order, with the thread that asked. With
    ``hold`` given, a sleep of exactly that many seconds blocks until :meth:`release` (so a test
    can look at the other threads while one is inside it); every other sleep returns at once.
    """

    def __init__(self, hold: float | None = None) -> None:
        self.asked: list[tuple[float, int]] = []
        self._hold = hold
        self._lock = threading.Lock()
        self._released = threading.Event()
        self.holding = threading.Event()

    def __call__(self, seconds: float) -> None:
        with self._lock:
            self.asked.append((seconds, threading.get_ident()))
        if seconds == self._hold:
            self.holding.set()
            self._released.wait(WAIT_S)

    @property
    def seconds(self) -> list[float]:
        """The seconds asked for, in order."""
        with self._lock:
            return [seconds for seconds, _ in self.asked]

    def release(self) -> None:
        self._released.set()


def blocked_in(thread: int, function: str, via: tuple[str, ...] = ()) -> bool:
    """Whether ``thread`` comes to be blocked in ``function`` (looked at until a deadline).

    Blocked on a lock, ``function`` is the innermost Python frame (the lock is C); blocked on a
    ``threading.Event``, the innermost frames are ``via`` = ``("wait", "wait")`` above it.
    """
    wanted = [*via, function]
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        names: list[str] = []
        frame = sys._current_frames().get(thread)
        while frame is not None and len(names) < len(wanted):
            names.append(frame.f_code.co_name)
            frame = frame.f_back
        if names == wanted:
            return True
        time.sleep(0.001)
    return False
