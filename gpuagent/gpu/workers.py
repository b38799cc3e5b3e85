"""Blocking NVML calls off the event loop, one daemon thread per GPU.

A call that hangs in the driver stalls only its own GPU's worker; the loop and the other GPUs go on.
Threads are daemons so a hung call can never hold up process exit.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")

_Job = tuple[Future[Any], Callable[[], Any]]


class Worker:
    """A daemon thread that runs submitted blocking calls in order."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()
        self._busy: Future[Any] | None = None
        self.name = name

    @property
    def busy(self) -> bool:
        """Whether a submitted call has not returned yet (a hung driver call stays busy)."""
        return self._busy is not None and not self._busy.done()

    @property
    def ident(self) -> int | None:
        """The worker thread's identifier (to find the NVML call it is in)."""
        return self._thread.ident

    def submit(self, fn: Callable[[], T]) -> asyncio.Future[T]:
        """Run ``fn`` on this worker; await the returned future from the event loop.

        Callers submit to a busy worker only knowingly: the job waits behind one that has not
        returned. The returned future's exception is always retrieved, even when nobody awaits it
        any more (a probe given up on), so none is reported as never retrieved.
        """
        future: Future[T] = Future()
        self._busy = future
        self._jobs.put((future, fn))
        wrapped = asyncio.wrap_future(future)
        wrapped.add_done_callback(_retrieve)
        return wrapped

    def close(self) -> None:
        """Let the thread exit after the call it is running, if any."""
        self._jobs.put(None)

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:  # delivered to the awaiting coroutine
                future.set_exception(exc)


def _retrieve(future: asyncio.Future[Any]) -> None:
    """Mark a finished future's exception as seen (its owner may have stopped waiting)."""
    if not future.cancelled():
        future.exception()
