"""The driver-event thread (``nvml-events``) and its release handshake with the monitor's close.

A daemon thread blocks in the driver's event wait (``event_wait_ms``, 5 s as NVIDIA's plugin)
and hands each event to the event loop. A failed wait (a lost GPU, an unknown error) asks the
loop to probe every GPU, and the thread waits longer after each failure in a row (from
:data:`EVENT_BACKOFF_MIN_S` up to ``backoff_max``) instead of spinning on a driver that answers
every wait at once. Between waits it rebuilds its registrations when asked to.

nvml.h promises nothing for an event set freed, or NVML shut down, while another thread waits on
it, so neither is done under a wait: the thread never enters NVML once stopped, and when the
monitor's close finds it inside a wait it hands the release over (:meth:`EventThread.stop`): the
thread releases the driver as it leaves (a process that exits first leaves that to the kernel).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import structlog

from gpuagent.domain.backoff import Backoff
from gpuagent.gpu.backend import Backend, DriverEvent, EventWaitError

log = structlog.get_logger("gpuagent.monitor")

__all__ = ["EVENT_BACKOFF_MAX_S", "EVENT_BACKOFF_MIN_S", "EVENT_WAIT_MS", "EventThread"]

#: How long one event wait blocks (a wait that times out raises NVML_ERROR_TIMEOUT).
EVENT_WAIT_MS = 5000
#: Shortest and longest pause between event waits while they keep failing.
EVENT_BACKOFF_MIN_S = 0.5
EVENT_BACKOFF_MAX_S = 30.0


class EventThread:
    """Waits for driver events on a thread of its own; posts them (and requests to probe every
    GPU) to the loop; releases the driver as it leaves when :meth:`stop` says so.

    ``on_event`` and ``probe_all`` run on the loop; ``release`` on this thread.
    """

    def __init__(
        self,
        backend: Backend,
        *,
        wait_ms: int,
        backoff_max: float,
        on_event: Callable[[DriverEvent], None],
        probe_all: Callable[[], None],
        release: Callable[[], None],
    ) -> None:
        self._backend = backend
        self._wait_ms = wait_ms
        self._backoff_max = backoff_max
        self._on_event = on_event
        self._probe_all = probe_all
        self._release = release
        self._stop = threading.Event()
        # The GPUs to (re-)register before the next wait; None: no change.
        self._gpus: tuple[int, ...] | None = None
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        # Whether the thread is inside NVML (a wait, a re-registration); under _lock.
        self._in_nvml = False
        # Whether the thread releases the driver as it leaves (stop() found it in a wait).
        self._release_on_exit = False
        self._done = asyncio.Event()  # set once the thread has left

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start waiting, posting to ``loop``."""
        self._thread = threading.Thread(
            target=self._run, args=(loop,), name="nvml-events", daemon=True
        )
        self._thread.start()

    def register(self, gpus: tuple[int, ...]) -> None:
        """Rebuild the registrations before the next wait: just these GPUs."""
        with self._lock:
            self._gpus = gpus

    def stop(self, *, hand_over_release: bool = False) -> bool:
        """Enter NVML no more; whether the thread is inside NVML now. With
        ``hand_over_release``, a thread inside releases the driver as it leaves."""
        with self._lock:
            self._stop.set()
            inside = self._in_nvml
            if hand_over_release:
                self._release_on_exit = inside
        return inside

    async def wait_closed(self) -> None:
        """Until the thread has left (and released the driver, if that was left to it)."""
        if self._thread is not None:
            await self._done.wait()

    def _run(self, loop: asyncio.AbstractEventLoop) -> None:
        """Runs on the ``nvml-events`` thread: blocks in the driver, posts events to the loop."""
        try:
            self._wait_for_events(loop)
        finally:
            with self._lock:
                self._in_nvml = False
                release = self._release_on_exit
            if release:
                self._release()
            _post(loop, self._done.set)

    def _wait_for_events(self, loop: asyncio.AbstractEventLoop) -> None:
        backoff = Backoff(min(self._wait_ms / 1000, EVENT_BACKOFF_MIN_S), self._backoff_max)
        failures = 0  # waits in a row that failed
        while True:
            with self._lock:
                if self._stop.is_set():
                    return
                self._in_nvml = True
            try:
                self._maybe_reregister()
                received = self._backend.wait_event(self._wait_ms)
            except EventWaitError as exc:
                with self._lock:
                    self._in_nvml = False
                failures += 1
                pause = backoff.ceiling(failures)
                (log.warning if failures == 1 else log.debug)(
                    "event wait failed; probing all gpus",
                    error=str(exc),
                    lost=exc.lost,
                    retry_in_s=pause,
                )
                if not _post(loop, self._probe_all):
                    return
                self._stop.wait(pause)
                continue
            with self._lock:
                self._in_nvml = False
            if failures:
                log.info("event waits work again")
                failures = 0
            if received is not None and not _post(loop, self._on_event, received):
                return

    def _maybe_reregister(self) -> None:
        with self._lock:
            gpus, self._gpus = self._gpus, None
        if gpus is None:
            return
        failed = self._backend.rebuild_events(gpus)
        for index, error in failed.items():
            log.error("gpu event registration failed", gpu=index, error=error)


def _post(loop: asyncio.AbstractEventLoop, callback: Callable[..., None], *args: object) -> bool:
    """Hand ``callback`` to the loop from another thread; ``False`` once the loop has closed."""
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:
        return False
    return True
