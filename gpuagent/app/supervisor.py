"""The agent's root tasks, supervised, and its bounded shutdown.

* Root tasks are named and run until the agent stops: a root task that ends has failed, and the
  agent stops (exit code 1; 2 for a setting found wrong once the GPUs are known).
* Shutdown ends ListAndWatch streams with ``UNAVAILABLE``, removes the plugin sockets, stops the
  HTTP server and releases the driver, within :data:`SHUTDOWN_SECONDS` in all. Nothing is
  released under an NVML call still running: the event thread releases the driver when its wait
  returns (up to 5 s later), and a call still running after :data:`SHUTDOWN_NVML_SECONDS` (a
  hung driver) is abandoned: its thread is a daemon, and the process exits without
  ``nvmlShutdown`` (the kernel closes the driver's files).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

import structlog

from gpuagent.domain.errors import SettingError

if TYPE_CHECKING:
    from gpuagent.dra.side import DraSide
    from gpuagent.gpu import sim
    from gpuagent.gpu.monitor import GpuMonitor
    from gpuagent.kube.client import KubeApi
    from gpuagent.kubelet.endpoints import PluginEndpoints
    from gpuagent.web.listener import Listener
    from gpuagent.web.server import HttpServer

__all__ = ["FatalError", "Supervisor"]

log = structlog.get_logger("gpuagent")

SHUTDOWN_SECONDS = 2.5  # the whole shutdown; the DaemonSet's grace period is 10 s
SHUTDOWN_STREAMS_SECONDS = 0.5
SHUTDOWN_TASKS_SECONDS = 1.0
SHUTDOWN_HTTP_SECONDS = 1.0
# How long the driver's release waits for a call in progress (a probe takes milliseconds; a hung
# one is not waited out) and for nvmlShutdown itself.
SHUTDOWN_NVML_SECONDS = 1.0


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

    async def shut_down(
        self,
        *,
        stopping: asyncio.Event,
        endpoints: PluginEndpoints | None,
        http: HttpServer | None,
        node_health_api: KubeApi | None,
        listener: Listener,
        dra: DraSide | None,
        monitor: GpuMonitor,
        simulator: sim.SimDriver | None,
    ) -> None:
        """Stop everything, in order, within :data:`SHUTDOWN_SECONDS`: the kubelet's streams
        (``stopping`` set), the root tasks, the HTTP server (or the bound ``listener`` it never
        served), the DRA side, the driver. Said in the log once something had started (a start
        refused before, for a setting, ends with that error alone)."""
        started = bool(self._tasks)
        if started:
            log.info("shutting down")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + SHUTDOWN_SECONDS

        def budget(cap: float, reserve: float = SHUTDOWN_NVML_SECONDS) -> float:
            # The driver's release keeps its share whatever the steps before it take.
            return max(0.0, min(cap, deadline - reserve - loop.time()))

        stopping.set()
        if endpoints is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(budget(SHUTDOWN_STREAMS_SECONDS)):
                    await endpoints.wait_drained()
        for task in self._tasks.values():
            task.cancel()
        if self._tasks:
            _, hung = await asyncio.wait(
                self._tasks.values(), timeout=budget(SHUTDOWN_TASKS_SECONDS)
            )
            for task in hung:
                log.warning("task did not stop in time", task=task.get_name())
        if http is not None:
            try:
                async with asyncio.timeout(budget(SHUTDOWN_HTTP_SECONDS)):
                    await http.close()
            except TimeoutError:
                log.warning("http server did not close in time")
        else:
            listener.close()
        if dra is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(budget(SHUTDOWN_HTTP_SECONDS)):
                    await dra.close()
        if node_health_api is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(budget(SHUTDOWN_HTTP_SECONDS)):
                    await node_health_api.close()
        await monitor.close(wait=budget(SHUTDOWN_NVML_SECONDS, 0.0))  # bounded by its own wait
        if simulator is not None:
            from gpuagent.gpu import sim  # noqa: PLC0415

            # A real driver is released by the kernel when the process exits; the simulated one
            # is uninstalled now, so its event wait is ended (as an interrupt ends a real one)
            # and the event thread releases the driver first.
            simulator.interrupt_waits()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(budget(SHUTDOWN_HTTP_SECONDS, 0.0)):
                    await monitor.wait_closed()
            sim.uninstall()
        if started:
            log.info("stopped")
