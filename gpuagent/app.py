"""The composition root: settings → store → driver → services, as named, supervised tasks.

Shutdown is graceful and bounded: ListAndWatch streams end with UNAVAILABLE, the plugin socket is
removed, the HTTP server stops, and the driver is released, all within about two seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from gpuagent import __version__
from gpuagent.config import ConfigError, Settings
from gpuagent.domain.allocation import SUPPORTED_STRATEGIES, AllocationPolicy
from gpuagent.domain.devices import IdStrategy
from gpuagent.domain.health import HealthCheckSpecError, HealthPolicy
from gpuagent.domain.naming import socket_name
from gpuagent.domain.store import DeviceStore
from gpuagent.gpu import sim
from gpuagent.gpu.monitor import GpuMonitor
from gpuagent.gpu.nvml import DriverUnavailable, Nvml
from gpuagent.kubelet.plugin import DevicePluginService
from gpuagent.kubelet.registration import PluginEndpoint, Timing
from gpuagent.web.metrics import AgentCounters, MetricsRenderer
from gpuagent.web.server import HttpServer, build_app

log = structlog.get_logger("gpuagent")

SHUTDOWN_STREAMS_TIMEOUT = 0.5
SHUTDOWN_TASKS_TIMEOUT = 1.0


class FatalError(Exception):
    """The agent cannot run (exit code 1): e.g. no driver with --fail-on-init-error."""


@dataclass(frozen=True, slots=True)
class Plan:
    """Settings checked for what this build supports, turned into domain policies."""

    allocation: AllocationPolicy
    health: HealthPolicy


def plan(settings: Settings) -> Plan:
    """Validate settings beyond their syntax; raises :class:`ConfigError` (exit code 2)."""
    unsupported = [s for s in settings.device_list_strategy if s not in SUPPORTED_STRATEGIES]
    if unsupported:
        raise ConfigError(
            "device-list-strategy", f"{', '.join(unsupported)} is not supported by this version"
        )
    if settings.mig_strategy != "none":
        raise ConfigError("mig-strategy", "MIG strategies are not supported by this version")
    if settings.pass_device_specs:
        raise ConfigError("pass-device-specs", "device specs are not supported by this version")
    try:
        health = HealthPolicy.from_env_values(
            settings.disable_healthchecks, settings.enable_healthchecks
        )
    except HealthCheckSpecError as exc:
        raise ConfigError("healthchecks", str(exc)) from exc
    return Plan(
        allocation=AllocationPolicy(
            id_strategy=IdStrategy(settings.device_id_strategy),
            list_strategies=settings.device_list_strategy,
        ),
        health=health,
    )


def load_simulator(settings: Settings) -> sim.SimDriver | None:
    """The simulated driver described by the settings, or ``None`` on real hardware."""
    try:
        if settings.simulate is not None:
            return sim.SimDriver(sim.node_from_count(settings.simulate))
        if settings.sim_config is not None:
            return sim.SimDriver(sim.load_sim_config(settings.sim_config))
    except sim.SimConfigError as exc:
        raise ConfigError(f"sim-config {exc.key}", str(exc)) from exc
    return None


@dataclass
class Stats:
    """Counters and timings the agent keeps about itself (exported, and read by the benchmark)."""

    allocations: int = 0
    allocate_seconds: list[float] = field(default_factory=list)
    register_seconds: list[float] = field(default_factory=list)

    def on_allocate(self, seconds: float) -> None:
        self.allocations += 1
        if len(self.allocate_seconds) < 100_000:
            self.allocate_seconds.append(seconds)


class Agent:
    """One agent: its store, driver, plugin endpoint and HTTP server, and their lifetimes."""

    def __init__(
        self,
        settings: Settings,
        *,
        simulator: sim.SimDriver | None = None,
        sysfs_root: Path = Path("/sys"),
        hostname: str | None = None,
        registration_timing: Timing = Timing(),
        nvml_call_timeout: float = 10.0,
    ) -> None:
        self.settings = settings
        self._nvml_call_timeout = nvml_call_timeout
        self.plan = plan(settings)
        self.simulator = simulator
        self.store = DeviceStore()
        self.stats = Stats()
        self.stopping = asyncio.Event()
        self.started = asyncio.Event()
        self._sysfs_root = sysfs_root
        self._hostname = hostname or socket.gethostname()
        self._timing = registration_timing
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self.endpoint: PluginEndpoint | None = None
        self.http: HttpServer | None = None

    # ----- probes ------------------------------------------------------------------------------
    def liveness(self) -> str | None:
        dead = [name for name, task in self._tasks.items() if task.done()]
        return f"tasks not running: {', '.join(dead)}" if dead else None

    def readiness(self) -> str | None:
        snapshot = self.store.snapshot
        if not snapshot.driver.up:
            return f"driver unavailable: {snapshot.driver.error or 'not initialised yet'}"
        if not snapshot.discovered:
            return "gpus not discovered yet"
        if not snapshot.registered:
            detail = self.endpoint.last_error if self.endpoint is not None else ""
            return "not registered with the kubelet" + (f": {detail}" if detail else "")
        return None

    def counters(self) -> AgentCounters:
        registrations = self.endpoint.registrations if self.endpoint is not None else 0
        return AgentCounters(registrations=registrations, allocations=self.stats.allocations)

    # ----- lifecycle ---------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        """Run until ``stop`` is set, then shut down; raises :class:`FatalError` on failure."""
        if self.simulator is not None:
            sim.install(self.simulator)
        monitor = GpuMonitor(
            self.store,
            Nvml(self._sysfs_root),
            self.plan.health,
            poll_interval=self.settings.poll_interval,
            call_timeout=self._nvml_call_timeout,
        )
        service = DevicePluginService(
            self.store, self.plan.allocation, self.stopping, on_allocate=self.stats.on_allocate
        )
        self.endpoint = PluginEndpoint(
            service,
            self.store,
            socket_path=self.settings.socket_dir / socket_name(self.settings.resource_name),
            kubelet_socket=self.settings.kubelet_socket,
            resource_name=self.settings.resource_name,
            timing=self._timing,
            on_registered=self.stats.register_seconds.append,
        )
        app = build_app(
            self.store,
            MetricsRenderer(self._hostname, __version__),
            self.counters,
            self,
            simulator=self.simulator,
        )
        self.http = HttpServer(app, self.settings.metrics_host, self.settings.metrics_port)
        try:
            await self.http.start()
            try:
                await monitor.start()
            except DriverUnavailable as exc:
                if self.settings.fail_on_init_error:
                    raise FatalError(f"NVIDIA driver unavailable: {exc}") from exc
                log.warning(
                    "driver unavailable; serving probes and metrics, retrying", error=str(exc)
                )
            self._spawn("nvml-poller", monitor.run())
            self._spawn("kubelet-registration", self._register_when_discovered(self.endpoint))
            self.started.set()
            await self._supervise(stop)
        finally:
            await self._shutdown(service, monitor)

    def _spawn(self, name: str, coro: Coroutine[Any, Any, None]) -> None:
        self._tasks[name] = asyncio.create_task(coro, name=name)

    async def _register_when_discovered(self, endpoint: PluginEndpoint) -> None:
        version = self.store.snapshot.version
        while not self.store.snapshot.discovered:
            version = (await self.store.wait_newer(version)).version
        await endpoint.run()

    async def _supervise(self, stop: asyncio.Event) -> None:
        stopper = asyncio.create_task(stop.wait(), name="stop-signal")
        try:
            done, _ = await asyncio.wait(
                {stopper, *self._tasks.values()}, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            stopper.cancel()
        for task in done:
            if task is stopper:
                continue
            # Root tasks run forever: one that ends has failed, and the agent cannot go on.
            error = task.exception() if not task.cancelled() else None
            log.error("task ended unexpectedly", task=task.get_name(), error=repr(error))
            raise FatalError(f"task {task.get_name()} ended: {error!r}")

    async def _shutdown(self, service: DevicePluginService, monitor: GpuMonitor) -> None:
        log.info("shutting down")
        self.stopping.set()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(service.wait_drained(), SHUTDOWN_STREAMS_TIMEOUT)
        for task in self._tasks.values():
            task.cancel()
        if self._tasks:
            _, hung = await asyncio.wait(self._tasks.values(), timeout=SHUTDOWN_TASKS_TIMEOUT)
            for task in hung:
                log.warning("task did not stop in time", task=task.get_name())
        await monitor.close()
        if self.http is not None:
            await self.http.close()
        if self.simulator is not None:
            sim.uninstall()
        log.info("stopped")
