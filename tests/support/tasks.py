"""A coroutine run as a task for the length of a ``with`` block; where a task is waiting."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import types
from collections.abc import AsyncIterator, Coroutine
from typing import Any

__all__ = ["awaiting", "running"]


@contextlib.asynccontextmanager
async def running(coroutine: Coroutine[Any, Any, None]) -> AsyncIterator[asyncio.Task[None]]:
    """``coroutine`` as a task; cancelled, and waited for, on the way out."""
    task = asyncio.create_task(coroutine)
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def awaiting(task: asyncio.Task[Any]) -> list[str]:
    """The coroutines ``task`` is suspended in, outermost first (``["run", "sleep"]``: its
    ``run()`` awaits ``asyncio.sleep``; ``[]`` before it first runs), so a test can wait for code
    to reach a wait rather than count turns of the loop."""
    names: list[str] = []
    coroutine: object = task.get_coro()
    while (
        isinstance(coroutine, types.CoroutineType)
        and inspect.getcoroutinestate(coroutine) == inspect.CORO_SUSPENDED
    ):
        names.append(coroutine.cr_code.co_name)
        coroutine = coroutine.cr_await
    return names
