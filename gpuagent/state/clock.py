"""What waits are timed by: the event loop's clock, or a test's (which moves only when told)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

__all__ = ["Clock", "LoopClock", "Timer"]


class Timer(Protocol):
    """A call to be made at a time (:meth:`Clock.call_at`)."""

    def cancel(self) -> object:
        """Do not make the call (nothing, once it is made)."""
        ...


class Clock(Protocol):
    """What a component's waits are timed by."""

    def now(self) -> float: ...

    async def wait(self, event: asyncio.Event, seconds: float) -> bool:
        """Wait until ``event`` is set (``True``) or ``seconds`` have passed (``False``)."""
        ...

    def call_at(self, when: float, callback: Callable[[], None]) -> Timer:
        """Call ``callback`` on the event loop once the clock reaches ``when`` (this clock's
        time, as :meth:`now` tells it), unless the timer is cancelled first."""
        ...


class LoopClock:
    """The event loop's clock."""

    def now(self) -> float:
        return asyncio.get_running_loop().time()

    async def wait(self, event: asyncio.Event, seconds: float) -> bool:
        try:
            async with asyncio.timeout(seconds):
                await event.wait()
        except TimeoutError:
            return False
        return True

    def call_at(self, when: float, callback: Callable[[], None]) -> Timer:
        return asyncio.get_running_loop().call_at(when, callback)
