"""The start order: register first, then import, build and start the rest.

With the metrics address bound, the agent starts the driver and, while NVML initialises and the
GPUs are discovered (the device list must be true), imports what serves the kubelet on a thread;
it serves the kubelet; then it imports what the kubelet does not need on a thread (the loop keeps
answering the kubelet meanwhile: :mod:`gpuagent.app.tuning`), builds it
(:func:`~gpuagent.app.rest.build_rest`) and starts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import Callable, Coroutine
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import structlog

from gpuagent.app import policy
from gpuagent.app.rest import Rest, cdi_keeper
from gpuagent.app.supervisor import FatalError, Supervisor
from gpuagent.app.tuning import import_deferred, import_modules, import_off_loop
from gpuagent.config import CDI_SPEC_TOOLKIT, ConfigError, Settings
from gpuagent.config.planning import unresolved
from gpuagent.domain.devices import CdiSpec
from gpuagent.gpu.monitor import GpuMonitor
from gpuagent.gpu.nvml import DriverUnavailable
from gpuagent.kubehealth import WRITER_MODULE, NodeHealthWanted, say_off
from gpuagent.kubelet.endpoints import SERVING, PluginEndpoints
from gpuagent.state.store import DeviceStore
from gpuagent.web.listener import Listener

if TYPE_CHECKING:  # imported only when used (DRA's API client costs memory; see DEFERRED)
    from gpuagent.dra.side import DraSide
    from gpuagent.nodefiles.cdikeeper import CdiSpecKeeper

__all__ = ["Startup", "listen"]

log = structlog.get_logger("gpuagent")

# How long the rest waits for GPU discovery and the kubelet's first answer before it starts anyway:
# a slow driver, or a kubelet that holds Register open, must not keep /metrics and the probes down.
REGISTER_FIRST_SECONDS = 2.0
CDI_KEEPER = ("gpuagent.nodefiles.cdikeeper",)


class Startup:
    """One start of the agent: its root tasks in order, then the rest.

    ``build_rest`` builds the rest once its modules are imported, given the CDI spec's keeper.
    ``mps``: keeps the MPS control daemons, started with the registration (a shared device is
    unhealthy until its daemon is up).
    ``keeps_cdi_spec``: this agent keeps the node's CDI spec (written before the device plugin
    registers when the plan starts with CDI, else started with the rest: a reload may turn CDI
    on). ``dra_unusable``: why the DRA side could not be built, said once the GPUs
    ``--dra-gpus`` names are checked.
    """

    def __init__(
        self,
        store: DeviceStore,
        settings: Settings,
        supervisor: Supervisor,
        monitor: GpuMonitor,
        *,
        endpoints: PluginEndpoints | None,
        dra: DraSide | None,
        dra_unusable: ConfigError | None = None,
        mps: Callable[[], Coroutine[Any, Any, None]] | None = None,
        stopping: asyncio.Event,
        keeps_cdi_spec: bool,
        node_health: NodeHealthWanted | str | None,
        own_process: bool,
        build_rest: Callable[[CdiSpecKeeper | None], Rest],
    ) -> None:
        self._store = store
        self._settings = settings
        self._supervisor = supervisor
        self._monitor = monitor
        self._endpoints = endpoints
        self._dra = dra
        self._dra_unusable = dra_unusable
        self._mps = mps
        self._stopping = stopping
        self._keeps_cdi_spec = keeps_cdi_spec
        self._node_health = node_health
        self._own_process = own_process
        self._build_rest = build_rest

    async def start(self) -> Rest:
        """Start the driver and the kubelet registration, then the rest; returns the rest."""
        store, spawn = self._store, self._supervisor.spawn
        driver = asyncio.create_task(self._start_driver(), name="driver-start")
        if store.plan.dra.gpus.refs:
            await self._named_dra_gpus(driver)
        early_cdi: asyncio.Task[CdiSpecKeeper] | None = None
        try:
            if self._keeps_cdi_spec and store.plan.writes_cdi_spec:
                # The first device list waits for the spec from now on (NVIDIA's plugin, too,
                # writes it before it registers): no device is offered that cannot be started.
                if self._settings.cdi_spec != CDI_SPEC_TOOLKIT:
                    store.update(lambda s: replace(s, cdi=s.cdi or CdiSpec()))
                early_cdi = asyncio.create_task(self._cdi_keeper(), name="cdi-spec-import")
                spawn("cdi-spec", _keep_cdi_spec(early_cdi))
            if self._endpoints is not None:
                # gRPC's modules, imported while the driver starts: it waits on NVML, not the GIL.
                await import_off_loop(SERVING, own_process=self._own_process)
                spawn("kubelet-registration", self._endpoints.run())
            if self._mps is not None:
                spawn("mps-daemons", self._mps())
            spawn("nvml-poller", self._drive(driver))
            if store.plan.dra.gpus.refs:
                spawn("dra-gpus-check", self._check_dra_gpus())
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(REGISTER_FIRST_SECONDS):
                    await asyncio.shield(driver)
                    if self._endpoints is not None and store.snapshot.discovered:
                        await self._first_answer()
            if driver.done() and not driver.cancelled() and driver.exception() is not None:
                await driver  # --fail-on-init-error: the agent cannot start
            writes_health = isinstance(self._node_health, NodeHealthWanted)
            await import_deferred(
                own_process=self._own_process, extra=(WRITER_MODULE,) if writes_health else ()
            )
            cdi = await early_cdi if early_cdi is not None else None
            if cdi is None and self._keeps_cdi_spec:
                cdi = cdi_keeper(store, self._settings)
            rest = self._build_rest(cdi)
        finally:
            if early_cdi is not None and not early_cdi.done():
                early_cdi.cancel()  # (a start that failed before it was awaited)
        await self._start_rest(rest, cdi_started=early_cdi is not None)
        return rest

    async def _start_rest(self, rest: Rest, *, cdi_started: bool) -> None:
        """Start the HTTP server, the pod-resources client, accounting, the node's files, the
        CDI spec's keeper (unless it started before the registration) and the DRA side."""
        spawn = self._supervisor.spawn
        await rest.http.start()
        if rest.pod_resources is not None:
            spawn("pod-resources", rest.pod_resources.run())
        if rest.accountant is not None:
            policy.warn_of_a_pid_namespace()
            spawn("gpu-accounting", rest.accountant.run())
        if rest.node_files.wanted:
            spawn("node-files", rest.node_files.run())
        if rest.cdi is not None and not cdi_started:
            spawn("cdi-spec", rest.cdi.run())
        if self._dra is not None:
            for name, task in self._dra.tasks().items():
                spawn(name, task())
        if rest.node_health is not None:
            spawn("node-health", rest.node_health.run())
        elif isinstance(self._node_health, str):
            say_off(self._node_health)

    async def _start_driver(self) -> None:
        try:
            await self._monitor.start()
        except DriverUnavailable as exc:
            if self._settings.fail_on_init_error:
                raise FatalError(
                    f"NVIDIA driver unavailable: {exc}. On a machine without NVIDIA GPUs, "
                    "--simulate N runs on N simulated ones."
                ) from exc
            log.warning("driver unavailable; serving probes and metrics, retrying", error=str(exc))

    async def _drive(self, driver: asyncio.Task[None]) -> None:
        """The first driver start (a slow driver does not hold the rest up), then the poller,
        which retries a start that failed."""
        await driver
        await self._monitor.run()

    async def _named_dra_gpus(self, driver: asyncio.Task[None]) -> None:
        """Before anything is served or written: once the driver has listed the GPUs, a
        :class:`ConfigError` (exit 2) when ``--dra-gpus`` names one the node does not have, then
        the DRA side's want of credentials. A driver that could not start is left to the start
        (``--fail-on-init-error``); GPUs named but not yet told apart, to ``dra-gpus-check``."""
        await asyncio.wait({driver})
        if driver.exception() is not None:
            return  # (the start raises it)
        snapshot = self._store.snapshot
        if snapshot.discovered:
            count = len(self._monitor.gpu_indexes)
            problem = policy.absent_dra_gpus(snapshot.plan.dra.gpus, snapshot, count)
            if problem is not None:
                raise ConfigError(self._settings.named("dra_gpus"), problem)
        if self._dra_unusable is not None:
            raise self._dra_unusable

    async def _check_dra_gpus(self) -> None:
        """Once the GPUs are known, stop the agent with a configuration error (exit 2) if
        ``--dra-gpus`` names one the node does not have; then idle (the check is final once every
        GPU listed is found, or every GPU's UUID is known)."""
        gpus = self._store.plan.dra.gpus
        async for snapshot in self._store.watch(lambda s: s):
            if snapshot.discovered:
                count = len(self._monitor.gpu_indexes)
                problem = policy.absent_dra_gpus(gpus, snapshot, count)
                if problem is not None:
                    raise ConfigError(self._settings.named("dra_gpus"), problem)
                if gpus.decided(snapshot.gpus, count):
                    break
        await self._stopping.wait()

    async def _cdi_keeper(self) -> CdiSpecKeeper:
        """The CDI spec's keeper, its module imported off the loop (beside NVML's start)."""
        await asyncio.to_thread(import_modules, CDI_KEEPER)
        return cdi_keeper(self._store, self._settings)

    async def _first_answer(self) -> None:
        """Until every endpoint has registered or said why not, or the registration task ended."""
        assert self._endpoints is not None
        settled = asyncio.create_task(self._endpoints.wait_settled(), name="registration-settled")
        try:
            await asyncio.wait(
                {settled, self._supervisor.task("kubelet-registration")},
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            settled.cancel()


async def _keep_cdi_spec(keeper: asyncio.Task[CdiSpecKeeper]) -> None:
    await (await keeper).run()


async def listen(listener: Listener, settings: Settings) -> None:
    """Bind the metrics address; a :class:`ConfigError` when it cannot be (said before anything
    starts, so before any line of a shutdown)."""
    try:
        await listener.bind()
    except OSError as exc:
        host = settings.metrics_host or "*"
        if isinstance(exc, socket.gaierror):  # (resolvable when checked, no longer)
            raise ConfigError(settings.named("metrics_address"), unresolved(host, exc)) from exc
        # (uvloop's strerror repeats the address: "error while attempting to bind on …")
        reason = os.strerror(exc.errno) if exc.errno else str(exc)
        hint = " (another process holds it: dcgm-exporter?)" if "in use" in reason else ""
        raise ConfigError(
            settings.named("metrics_address"),
            f"cannot listen on {host}:{settings.metrics_port}: {reason}{hint}",
        ) from exc
