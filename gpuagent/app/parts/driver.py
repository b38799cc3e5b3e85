"""The NVIDIA driver: NVML started first, polled, and released last.

The driver's start begins before anything else is served (discovery within a budget,
``--nvml-timeout``; NVML's initialisation waits on the driver, not on the GIL, so what serves the
kubelet is imported meanwhile), and the poller follows it. A simulated driver is installed below
pynvml as the driver starts and uninstalled as it is released. Nothing is released under an NVML
call still running: the event thread releases the driver when its wait returns, and a call still
running after :data:`RELEASE_SECONDS` (a hung driver) is abandoned: its thread is a daemon, and
the process exits without ``nvmlShutdown`` (the kernel closes the driver's files).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping

import structlog

from gpuagent.app.part import Context, Part, Stage, Task
from gpuagent.app.supervisor import SHUTDOWN_SECONDS, FatalError
from gpuagent.domain.dra import DraMig
from gpuagent.gpu.mig import MIG_MINORS_FILE
from gpuagent.gpu.monitor import GpuMonitor
from gpuagent.gpu.nvml import DriverUnavailable, Nvml

__all__ = ["RELEASE_SECONDS", "Driver", "build"]

log = structlog.get_logger("gpuagent")

# How long the driver's release waits for a call in progress (a probe takes milliseconds; a hung
# one is not waited out) and for nvmlShutdown itself; kept for it whatever the shutdown's other
# steps take.
RELEASE_SECONDS = 1.0


class Driver(Part):
    """NVML through the driver's backend, and its poller (the only part every agent has)."""

    name = "driver"
    stage = Stage.KUBELET
    close_seconds = SHUTDOWN_SECONDS  # what is left of the shutdown: the driver is released last
    reserved_seconds = RELEASE_SECONDS

    def __init__(self, context: Context) -> None:
        self._context = context
        self.nvml: Nvml | None = None
        self.monitor: GpuMonitor | None = None
        self._first: asyncio.Task[None] | None = None
        self._installed = False

    @property
    def first_start(self) -> asyncio.Task[None]:
        """The driver's first start (once started): a :class:`FatalError` when it failed and
        ``--fail-on-init-error`` holds."""
        assert self._first is not None, "the driver has not started"
        return self._first

    @property
    def gpu_count(self) -> int:
        """The node's GPUs as the driver counts them (described or not)."""
        return len(self.monitor.gpu_indexes) if self.monitor is not None else 0

    async def start(self) -> None:
        context, settings = self._context, self._context.settings
        if context.simulator is not None:
            from gpuagent.gpu import sim  # noqa: PLC0415

            sim.install(context.simulator)
            self._installed = True
        # With MIG made on demand (--dra-mig dynamic), the DRA side makes MIG devices through it.
        dynamic = context.store.plan.dra.mig is DraMig.DYNAMIC
        self.nvml = Nvml(
            context.sysfs_root,
            context.proc_root / MIG_MINORS_FILE,
            processes=settings.container_accounting,
            mig_shapes=dynamic,
        )
        self.monitor = GpuMonitor(
            context.store,
            self.nvml,
            poll_interval=settings.poll_interval,
            call_timeout=context.knobs.nvml_call_timeout,
            nvml_timeout=settings.nvml_timeout,
        )
        self._first = asyncio.create_task(self._start_driver(self.monitor), name="driver-start")

    def tasks(self) -> Mapping[str, Task]:
        return {"nvml-poller": self._poll}

    async def settled(self) -> None:
        await asyncio.shield(self.first_start)

    def check(self) -> None:
        """A first start that failed at the end of the wait (``--fail-on-init-error``)."""
        first = self.first_start
        if first.done() and not first.cancelled() and (error := first.exception()) is not None:
            raise error

    async def close(self, seconds: float) -> None:
        """Release the driver within ``seconds``; a simulated one is uninstalled, once its event
        wait is ended (as an interrupt ends a real one) and the event thread has released it."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        monitor = self.monitor
        if monitor is not None:
            await monitor.close(wait=min(RELEASE_SECONDS, seconds))  # bounded by its own wait
        if not self._installed:
            return
        from gpuagent.gpu import sim  # noqa: PLC0415

        assert self._context.simulator is not None
        # A real driver is released by the kernel when the process exits; the simulated one is
        # uninstalled now.
        self._context.simulator.interrupt_waits()
        if monitor is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(RELEASE_SECONDS, deadline - loop.time())):
                    await monitor.wait_closed()
        sim.uninstall()

    async def _start_driver(self, monitor: GpuMonitor) -> None:
        try:
            await monitor.start()
        except DriverUnavailable as exc:
            if self._context.settings.fail_on_init_error:
                raise FatalError(
                    f"NVIDIA driver unavailable: {exc}. On a machine without NVIDIA GPUs, "
                    "--simulate N runs on N simulated ones."
                ) from exc
            log.warning("driver unavailable; serving probes and metrics, retrying", error=str(exc))

    async def _poll(self) -> None:
        """The first driver start (a slow driver does not hold the rest up), then the poller,
        which retries a start that failed."""
        assert self.monitor is not None
        await self.first_start
        await self.monitor.run()


def build(context: Context) -> Driver:
    return Driver(context)
