"""What waits are timed by: the event loop's clock, or a test's (which moves only when told)."""

from __future__ import annotations

import asyncio
from typing import Protocol

__all__ = ["Clock", "LoopClock"]


class Clock(Protocol):
    """What a component's waits are timed by."""

    def now(self) -> float: ...

    async def wait(self, event: asyncio.Event, seconds: float) -> bool:
        """Wait until ``event`` is set (``True``) or ``seconds`` have passed (``False``)."""
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
