"""A coroutine run as a task for the length of a ``with`` block."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Coroutine
from typing import Any

__all__ = ["running"]


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
