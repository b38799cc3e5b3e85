"""The agent's root tasks, supervised, and its bounded shutdown.

* Root tasks are named and run until the agent stops: a root task that ends has failed, and the
  agent stops (exit code 1; 2 for a setting found wrong once the GPUs are known).
* Shutdown ends ListAndWatch streams with ``UNAVAILABLE``, cancels the root tasks (the plugin
  sockets go with them), then closes the agent's parts in the reverse of their order — the HTTP
  server, the DRA side, the API connection, the driver released last — within
  :data:`SHUTDOWN_SECONDS` in all, each part within its share (:class:`~gpuagent.app.part.Part`).
  Nothing is released under an NVML call still running (see :mod:`gpuagent.app.parts.driver`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any

import structlog

from gpuagent.domain.errors import SettingError

if TYPE_CHECKING:
    from gpuagent.app.part import Part

__all__ = ["FatalError", "ShutdownBudget", "Supervisor"]

log = structlog.get_logger("gpuagent")

SHUTDOWN_SECONDS = 2.5  # the whole shutdown; the DaemonSet's grace period is 10 s
SHUTDOWN_STREAMS_SECONDS = 0.5
SHUTDOWN_TASKS_SECONDS = 1.0


class FatalError(Exception):
    """The agent cannot run (exit code 1): e.g. no driver with --fail-on-init-error."""


class Supervisor:
    """The agent's named root tasks: each runs until the agent stops."""

    def __init__(self) -> None:
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def spawn(self, name: str, coro: Coroutine[Any, Any, None]) -> None:
        self._tasks[name] = asyncio.create_task(coro, name=name)

    def task(self, name: str) -> asyncio.Task[None]:
        return self._tasks[name]

    def liveness(self) -> str | None:
        dead = [name for name, task in self._tasks.items() if task.done()]
        return f"tasks not running: {', '.join(dead)}" if dead else None

    async def supervise(self, stop: asyncio.Event) -> None:
        """Until ``stop`` is set; raises when a root task ends (:class:`FatalError`, or the
        :class:`SettingError` it ended with)."""
        stopper = asyncio.create_task(stop.wait(), name="stop-signal")
        try:
            done, _ = await asyncio.wait(
                {stopper, *self._tasks.values()}, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            stopper.cancel()
            await asyncio.wait({stopper})
        for task in done - {stopper}:
            # Root tasks run forever: one that ends has failed, and the agent cannot go on.
            error = task.exception() if not task.cancelled() else None
            if isinstance(error, FatalError | SettingError):
                # The driver's first start (--fail-on-init-error); a setting found wrong once
                # the GPUs are known (exit code 2).
                raise error
            log.error("task ended unexpectedly", task=task.get_name(), error=repr(error))
            raise FatalError(f"task {task.get_name()} ended: {error!r}")

    async def shut_down(self, parts: Sequence[Part], stopping: asyncio.Event) -> None:
        """Stop everything within :data:`SHUTDOWN_SECONDS`: ``stopping`` set and the parts
        drained (the kubelet's streams end), the root tasks cancelled, then each part closed in
        the reverse of its order (the HTTP server, the DRA side, the API connection, ..., the
        driver last), each within its share. Said in the log once something had started (a
        start refused before, for a setting, ends with that error alone)."""
        started = bool(self._tasks)
        if started:
            log.info("shutting down")
        budget = ShutdownBudget(parts, asyncio.get_running_loop().time)
        stopping.set()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(budget.left(SHUTDOWN_STREAMS_SECONDS)):
                for part in reversed(parts):
                    await part.drain()
        await self._cancel(budget.left(SHUTDOWN_TASKS_SECONDS))
        for part in reversed(parts):
            budget.closing(part)
            try:
                await part.close(budget.left(part.close_seconds))
            except Exception:  # a part's bug must not keep the others (the driver) open
                log.exception("part did not close", part=part.name)
        if started:
            log.info("stopped")

    async def _cancel(self, seconds: float) -> None:
        """Cancel the root tasks and wait for them, ``seconds`` at most."""
        for task in self._tasks.values():
            task.cancel()
        if self._tasks:
            _, hung = await asyncio.wait(self._tasks.values(), timeout=seconds)
            for task in hung:
                log.warning("task did not stop in time", task=task.get_name())


class ShutdownBudget:
    """What is left of the shutdown's :data:`SHUTDOWN_SECONDS` (from now, by ``clock``) for its
    next step: the parts not closed yet keep their reserved share (the driver's release)
    whatever the steps before them take."""

    def __init__(self, parts: Sequence[Part], clock: Callable[[], float]) -> None:
        self._clock = clock
        self._deadline = clock() + SHUTDOWN_SECONDS
        self._reserved = sum(part.reserved_seconds for part in parts)

    def closing(self, part: Part) -> None:
        """``part`` closes next: its reserve is its own now."""
        self._reserved -= part.reserved_seconds

    def left(self, cap: float) -> float:
        """Seconds for the next step: ``cap`` at most, and none of the reserves."""
        return max(0.0, min(cap, self._deadline - self._reserved - self._clock()))
