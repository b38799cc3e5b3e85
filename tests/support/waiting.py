"""Waiting for a condition that another task or process brings about, never for a fixed time."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

__all__ = ["eventually"]

T = TypeVar("T")


async def eventually(
    check: Callable[[], T], *, within: float = 10.0, what: str = "the condition"
) -> T:
    """Poll ``check`` until it returns a truthy value, and return that value.

    ``within`` is a deadline for a broken build, not a timing: a passing test returns as soon as
    the condition holds. Fails with the last value seen.
    """
    deadline = time.monotonic() + within
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not hold within {within} s; last value: {value!r}")
        await asyncio.sleep(0.005)
