"""The composition root: settings → plan → store → driver → services, as named, supervised tasks.

Everything the agent serves is derived from the store: the snapshot (devices, health, pods,
registrations) and the plan it is served under (:mod:`gpuagent.config.planning`). This module
only builds the parts, runs them as tasks, reloads the plan, and shuts down:

* a root task that ends has failed, and the agent stops (exit code 1);
* shutdown ends ListAndWatch streams with ``UNAVAILABLE``, removes the plugin sockets, stops the
  HTTP server and releases the driver, within :data:`SHUTDOWN_SECONDS` in all. Nothing is
  released under an NVML call still running: the event thread releases the driver when its wait
  returns (up to 5 s later), and a call still running after :data:`SHUTDOWN_NVML_SECONDS` (a
  hung driver) is abandoned: its thread is a daemon, and the process exits without
  ``nvmlShutdown`` (the kernel closes the driver's files).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib
import os
import sys
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from gpuagent.config import CDI_SPEC_TOOLKIT, ConfigError, Settings
from gpuagent.config.planning import (
    LIVE,
    check_socket_dirs,
    driver_root_as_read,
    keep_restart_only,
    load_web_config,
    make_plan,
    restart_keys,
)
from gpuagent.domain.containers import CDI_SPEC_DIR
from gpuagent.domain.devices import CdiSpec
from gpuagent.domain.dra import DraGpus
from gpuagent.domain.errors import SettingError
from gpuagent.domain.plan import Plan
from gpuagent.domain.readiness import readiness
from gpuagent.domain.serving import ResourceView, cdi_gated
from gpuagent.domain.snapshot import Snapshot
from gpuagent.gpu.monitor import GpuMonitor
from gpuagent.gpu.nvml import DriverUnavailable, Nvml
from gpuagent.kubehealth import WRITER_MODULE, NodeHealthWanted, build_writer, say_off, wanted
from gpuagent.kubelet.endpoints import PluginEndpoints
from gpuagent.kubelet.registration import Timing
from gpuagent.state.store import DeviceStore
from gpuagent.web.listener import Listener

if TYPE_CHECKING:  # the rest is imported once the kubelet has its device plugin (_start_rest)
    from gpuagent.dra.side import DraSide
    from gpuagent.gpu import sim
    from gpuagent.kube.client import KubeApi
    from gpuagent.kube.nodehealth import NodeHealthWriter
    from gpuagent.kubelet.podresources import PodResourcesClient
    from gpuagent.nodefiles.cdikeeper import CdiSpecKeeper, CdiTarget
    from gpuagent.nodefiles.labelkeeper import NodeFiles
    from gpuagent.runtime.accountant import Accountant
    from gpuagent.web.metrics import MetricsRenderer
    from gpuagent.web.server import HttpServer

log = structlog.get_logger("gpuagent")

SHUTDOWN_SECONDS = 2.5  # the whole shutdown; the DaemonSet's grace period is 10 s
SHUTDOWN_STREAMS_SECONDS = 0.5
SHUTDOWN_TASKS_SECONDS = 1.0
SHUTDOWN_HTTP_SECONDS = 1.0
# How long the driver's release waits for a call in progress (a probe takes milliseconds; a hung
# one is not waited out) and for nvmlShutdown itself.
SHUTDOWN_NVML_SECONDS = 1.0
# How long the rest waits for GPU discovery and the kubelet's first answer before it starts anyway:
# a slow driver, or a kubelet that holds Register open, must not keep /metrics and the probes down.
REGISTER_FIRST_SECONDS = 2.0
# The GIL switch interval while the rest is imported on a thread (Python's default is 5 ms): the
# import holds the GIL for ~150 ms of CPU in all, and with the default every call the loop answers
# meanwhile would first wait up to 5 ms for it.
IMPORT_SWITCH_INTERVAL = 0.0005
# Imported off the loop once the kubelet has its device plugin: what the kubelet does not need.
_DEFERRED = (
    "gpuagent.web.server",
    "gpuagent.web.metrics",
    "gpuagent.kubelet.podresources",
    "gpuagent.runtime.accountant",
    "gpuagent.runtime.cri",
    "gpuagent.runtime.loglinks",
    "gpuagent.runtime.procfs",
    "gpuagent.nodefiles.cdikeeper",
    "gpuagent.nodefiles.labelkeeper",
)


class FatalError(Exception):
    """The agent cannot run (exit code 1): e.g. no driver with --fail-on-init-error."""


class Agent:
    """One agent: its store and plan, driver, kubelet endpoints, DRA side, node files and HTTP
    server.

    ``node_name`` overrides the settings' (``NODE_NAME``, else the host name); ``dra_options``
    are passed to the DRA side (tests shorten its timings), ``node_health_options`` to the
    node-health writer (tests give it their clock). ``own_process``: the process is the
    agent's alone (the command line), so start-up may set process-wide knobs: the cyclic collector
    stays off until the agent has started (then what start-up built leaves its view, and it is
    turned on), and threads hand the GIL to the loop sooner while the rest is imported (see
    :data:`IMPORT_SWITCH_INTERVAL`).
    """

    def __init__(
        self,
        settings: Settings,
        *,
        plan: Plan | None = None,
        simulator: sim.SimDriver | None = None,
        sysfs_root: Path = Path("/sys"),
        node_name: str | None = None,
        registration_timing: Timing = Timing(),
        nvml_call_timeout: float = 10.0,
        settings_source: Callable[[], Settings] | None = None,
        config_poll_interval: float = 2.0,
        dra_options: Mapping[str, Any] | None = None,
        node_health_options: Mapping[str, Any] | None = None,
        own_process: bool = False,
    ) -> None:
        self.settings = settings
        self.node_name = node_name or settings.node_name
        self.store = DeviceStore(plan=plan or make_plan(settings))
        check_socket_dirs(settings, self.store.plan)  # a file there: exit 2 before anything runs
        self.web_config = load_web_config(settings)
        self.simulator = simulator
        self.view = ResourceView()
        self.stopping = asyncio.Event()  # set when shutting down: streams end with UNAVAILABLE
        self.pod_resources: PodResourcesClient | None = None
        self.endpoints: PluginEndpoints | None = None
        if settings.kubernetes:
            self.endpoints = PluginEndpoints(
                self.store,
                self.view,
                self.stopping,
                socket_dir=settings.socket_dir,
                kubelet_socket=settings.kubelet_socket,
                timing=registration_timing,
                on_allocate=self._allocated,
            )
        self.dra = self._dra_side(dra_options or {}) if self.store.plan.dra.gpus.enabled else None
        # The GPUHealthy condition, events, taint: what of them is on (exit 2 for one asked for
        # without API credentials); the writer is built with the rest.
        decided = wanted(settings)
        self.node_health_wanted = decided if isinstance(decided, NodeHealthWanted) else None
        self._node_health_off = decided if isinstance(decided, str) else None
        self._node_health_options = node_health_options
        self.node_health: NodeHealthWriter | None = None
        self._node_health_api: KubeApi | None = None
        # Built by _start_rest, after the kubelet registration: the metrics renderer and HTTP
        # server, the pod-resources client, per-container accounting (process -> cgroup ->
        # container -> names, from the CRI), the node's files.
        self.renderer: MetricsRenderer | None = None
        self.accountant: Accountant | None = None
        self.node_files: NodeFiles | None = None
        # The node's CDI spec (with a CDI strategy): written before the device plugin registers
        # when the plan starts with CDI, else started with the rest (a reload may turn CDI on).
        self.cdi: CdiSpecKeeper | None = None
        self._keeps_cdi_spec = _keeps_cdi_spec(settings, simulated=simulator is not None)
        self.monitor: GpuMonitor | None = None
        self.http: HttpServer | None = None
        self.listener = Listener(
            settings.metrics_host,
            settings.metrics_port,
            ssl_context=self.web_config.ssl_context if self.web_config is not None else None,
        )
        self.started = asyncio.Event()
        self._sysfs_root = sysfs_root
        self._nvml_call_timeout = nvml_call_timeout
        self._settings_source = settings_source
        self._config_poll_interval = config_poll_interval
        self._own_process = own_process
        self._reload_requested = asyncio.Event()
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def _allocated(self) -> None:
        if self.pod_resources is not None:
            self.pod_resources.poke()

    # ----- probes ------------------------------------------------------------------------------
    def liveness(self) -> str | None:
        dead = [name for name, task in self._tasks.items() if task.done()]
        return f"tasks not running: {', '.join(dead)}" if dead else None

    def readiness(self) -> str | None:
        snapshot = self.store.snapshot
        serving = snapshot.plan.serving
        self.view.resources(snapshot, serving)  # builds (or finds cached) them, or the error
        reason = readiness(snapshot, self.view.error, kubernetes=self.settings.kubernetes)
        cdi = snapshot.cdi
        if (
            reason is None
            and cdi is not None
            and cdi.error
            and cdi_gated(snapshot, serving.containers)
        ):
            return f"CDI spec not written (devices it lacks are not offered): {cdi.error}"
        if reason is None and self.dra is not None:
            return self.dra.readiness()
        return reason

    def _dra_side(self, options: Mapping[str, Any]) -> DraSide:
        """The DRA side (imported only when DRA is on: its API client costs memory)."""
        from gpuagent.dra.side import DraSide, KubeConfigError  # noqa: PLC0415
        from gpuagent.nodefiles.cdikeeper import NodeSpecs  # noqa: PLC0415

        specs = NodeSpecs(_cdi_target(self.settings))

        def node_spec(snapshot: Snapshot) -> Mapping[str, Any] | None:
            # The claims' CDI edits follow the serving plan's container settings, as the node
            # spec's do; built again only when devices, driver or those settings change.
            return specs.get(snapshot, snapshot.plan.serving.containers)

        try:
            return DraSide(
                self.store,
                node=self.node_name,
                plugins_dir=self.settings.plugins_dir,
                registry_dir=self.settings.plugins_registry_dir,
                cdi_dir=self.settings.cdi_spec_dir,
                kubeconfig=self.settings.kubeconfig,
                stopping=self.stopping,
                node_spec=node_spec,
                **options,
            )
        except KubeConfigError as exc:
            raise ConfigError("kubeconfig", str(exc)) from exc

    # ----- lifecycle ---------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        """Run until ``stop`` is set, then shut down.

        Raises :class:`FatalError` when the agent cannot go on, and :class:`ConfigError` when a
        setting keeps it from starting (the metrics address cannot be bound: said before anything
        starts, so before any line of a shutdown).
        """
        await self._listen()
        if self.simulator is not None:
            from gpuagent.gpu import sim  # noqa: PLC0415

            sim.install(self.simulator)
        self.monitor = monitor = GpuMonitor(
            self.store,
            Nvml(self._sysfs_root, processes=self.settings.container_accounting),
            poll_interval=self.settings.poll_interval,
            call_timeout=self._nvml_call_timeout,
            nvml_timeout=self.settings.nvml_timeout,
        )
        if self._own_process:
            # Start-up allocates hundreds of thousands of long-lived objects and next to no
            # cyclic garbage: collections would only stop the loop (a full one ~20 ms while the
            # rest is imported, under the kubelet's first calls). The command line turns the
            # collector off before its imports; this keeps it off until started.
            gc.disable()
        try:
            # Register first (the metrics address is bound): discover the GPUs (the device list
            # must be true), serve the kubelet; then import and start what the kubelet does not
            # need.
            driver = asyncio.create_task(self._start_driver(monitor), name="driver-start")
            if self._keeps_cdi_spec and self.store.plan.writes_cdi_spec:
                # The first device list waits for the spec from now on (NVIDIA's plugin, too,
                # writes it before it registers): no device is offered that cannot be started.
                if self.settings.cdi_spec != CDI_SPEC_TOOLKIT:
                    self.store.update(lambda s: replace(s, cdi=s.cdi or CdiSpec()))
                self._spawn("cdi-spec", self._keep_cdi_spec())
            if self.endpoints is not None:
                self._spawn("kubelet-registration", self.endpoints.run())
            self._spawn("nvml-poller", self._drive(driver, monitor))
            if self.store.plan.dra.gpus.refs:
                self._spawn("dra-gpus-check", self._check_dra_gpus(monitor))
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(REGISTER_FIRST_SECONDS):
                    await asyncio.shield(driver)
                    if self.endpoints is not None and self.store.snapshot.discovered:
                        await self._first_answer()
            if driver.done() and not driver.cancelled() and driver.exception() is not None:
                await driver  # --fail-on-init-error: the agent cannot start
            await self._start_rest()
            if self._own_process:
                # What start-up built lives as long as the process: the cyclic collector need
                # not walk it again on every full collection (shorter pauses in answers to the
                # kubelet, fewer pages touched).
                gc.freeze()
                gc.enable()
            self.started.set()
            await self._supervise(stop)
        finally:
            if self._own_process:
                gc.enable()  # (a start-up that failed)
            await self._shutdown(monitor)

    async def _drive(self, driver: asyncio.Task[None], monitor: GpuMonitor) -> None:
        """The first driver start (a slow driver does not hold the rest up), then the poller,
        which retries a start that failed."""
        await driver
        await monitor.run()

    async def _check_dra_gpus(self, monitor: GpuMonitor) -> None:
        """Once the GPUs are known, stop the agent with a configuration error (exit 2) if
        ``--dra-gpus`` names one the node does not have; then idle (the check is final once every
        GPU listed is found, or every GPU's UUID is known)."""
        gpus = self.store.plan.dra.gpus
        async for snapshot in self.store.watch(lambda s: s):
            if snapshot.discovered:
                count = len(monitor.gpu_indexes)
                problem = _absent_dra_gpus(gpus, snapshot, count)
                if problem is not None:
                    raise ConfigError("dra-gpus", problem)
                if gpus.decided(snapshot.gpus, count):
                    break
        await self.stopping.wait()

    async def _keep_cdi_spec(self) -> None:
        """Keep the node's CDI spec (its module imported off the loop, beside NVML's start)."""
        await asyncio.to_thread(_import, ("gpuagent.nodefiles.cdikeeper",))
        from gpuagent.nodefiles.cdikeeper import CdiSpecKeeper  # noqa: PLC0415

        self.cdi = CdiSpecKeeper(self.store, _cdi_target(self.settings))
        await self.cdi.run()

    async def _first_answer(self) -> None:
        """Until every endpoint has registered or said why not, or the registration task ended."""
        assert self.endpoints is not None
        settled = asyncio.create_task(self.endpoints.wait_settled(), name="registration-settled")
        try:
            await asyncio.wait(
                {settled, self._tasks["kubelet-registration"]},
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            settled.cancel()

    async def _start_rest(self) -> None:
        """Import (off the loop, which keeps serving the kubelet) and start the HTTP server, the
        pod-resources client, accounting, the node's files, the DRA side and config reloads."""
        switch = sys.getswitchinterval()
        if self._own_process:
            sys.setswitchinterval(min(switch, IMPORT_SWITCH_INTERVAL))
        try:
            health = (WRITER_MODULE,) if self.node_health_wanted is not None else ()
            await asyncio.to_thread(_import, _DEFERRED + health)
        finally:
            sys.setswitchinterval(switch)
        from gpuagent import __version__  # noqa: PLC0415
        from gpuagent.kubelet.podresources import PodResourcesClient  # noqa: PLC0415
        from gpuagent.runtime.accountant import Accountant  # noqa: PLC0415
        from gpuagent.runtime.cri import CriClient  # noqa: PLC0415
        from gpuagent.runtime.loglinks import LogLinks  # noqa: PLC0415
        from gpuagent.runtime.procfs import ProcReader  # noqa: PLC0415
        from gpuagent.web.metrics import MetricsRenderer  # noqa: PLC0415
        from gpuagent.web.server import HttpServer, build_app  # noqa: PLC0415

        settings = self.settings
        self.renderer = MetricsRenderer(
            self.node_name,
            __version__,
            hostname_label=None if settings.no_hostname else settings.hostname_label,
            container_shares=settings.dcgm_container_shares,
            kubernetes=settings.kubernetes,
            accounting=settings.container_accounting,
        )
        app = build_app(self.store, self.renderer, self, self.simulator, web_config=self.web_config)
        self.http = HttpServer(
            app, settings.metrics_host, settings.metrics_port, probes=self, listener=self.listener
        )
        await self.http.start()
        if settings.kubernetes:
            self.pod_resources = PodResourcesClient(
                self.store, settings.pod_resources_socket, interval=settings.pod_resources_interval
            )
            self._spawn("pod-resources", self.pod_resources.run())
        if settings.container_accounting:
            if os.getpid() == 1:
                log.warning(
                    "container accounting is on, but the agent is PID 1 of its own PID "
                    "namespace: NVML lists no other container's processes (run it in the host's "
                    "PID namespace, or set container-accounting: false)"
                )
            links = LogLinks(settings.container_logs_dir) if settings.kubernetes else None
            self.accountant = Accountant(
                self.store, ProcReader(settings.proc_root), CriClient(settings.cri_socket), links
            )
            self._spawn("gpu-accounting", self.accountant.run())
        self.node_files = _node_files(
            self.store, settings, sysfs_root=self._sysfs_root, simulated=self.simulator is not None
        )
        if self.node_files.wanted:
            self._spawn("node-files", self.node_files.run())
        if self._keeps_cdi_spec and "cdi-spec" not in self._tasks:
            self._spawn("cdi-spec", self._keep_cdi_spec())
        if self.dra is not None:
            for name, task in self.dra.tasks().items():
                self._spawn(name, task())
        if self.node_health_wanted is not None:
            self._start_node_health(self.node_health_wanted)
        elif self._node_health_off is not None:
            say_off(self._node_health_off)
        if self._settings_source is not None:
            self._spawn("config-reload", self._reload_when_asked())

    def _start_node_health(self, parts: NodeHealthWanted) -> None:
        built = build_writer(
            self.store,
            self.settings,
            parts,
            node=self.node_name,
            api=self.dra.api if self.dra is not None else None,
            options=self._node_health_options,
        )
        if built is not None:
            self.node_health, api = built
            self._node_health_api = api if self.dra is None else None
            self._spawn("node-health", self.node_health.run())

    async def _listen(self) -> None:
        try:
            await self.listener.bind()
        except OSError as exc:
            host = self.settings.metrics_host or "*"
            # (uvloop's strerror repeats the address: "error while attempting to bind on …")
            reason = os.strerror(exc.errno) if exc.errno else str(exc)
            hint = " (another process holds it: dcgm-exporter?)" if "in use" in reason else ""
            raise ConfigError(
                "--metrics-address",
                f"cannot listen on {host}:{self.settings.metrics_port}: {reason}{hint}",
            ) from exc

    async def _start_driver(self, monitor: GpuMonitor) -> None:
        try:
            await monitor.start()
        except DriverUnavailable as exc:
            if self.settings.fail_on_init_error:
                raise FatalError(
                    f"NVIDIA driver unavailable: {exc}. On a machine without NVIDIA GPUs, "
                    "--simulate N runs on N simulated ones."
                ) from exc
            log.warning("driver unavailable; serving probes and metrics, retrying", error=str(exc))

    def _spawn(self, name: str, coro: Coroutine[Any, Any, None]) -> None:
        self._tasks[name] = asyncio.create_task(coro, name=name)

    async def _supervise(self, stop: asyncio.Event) -> None:
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

    async def _shutdown(self, monitor: GpuMonitor) -> None:
        log.info("shutting down")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + SHUTDOWN_SECONDS

        def budget(cap: float, reserve: float = SHUTDOWN_NVML_SECONDS) -> float:
            # The driver's release keeps its share whatever the steps before it take.
            return max(0.0, min(cap, deadline - reserve - loop.time()))

        self.stopping.set()
        if self.endpoints is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(budget(SHUTDOWN_STREAMS_SECONDS)):
                    await self.endpoints.wait_drained()
        for task in self._tasks.values():
            task.cancel()
        if self._tasks:
            _, hung = await asyncio.wait(
                self._tasks.values(), timeout=budget(SHUTDOWN_TASKS_SECONDS)
            )
            for task in hung:
                log.warning("task did not stop in time", task=task.get_name())
        if self.http is not None:
            try:
                async with asyncio.timeout(budget(SHUTDOWN_HTTP_SECONDS)):
                    await self.http.close()
            except TimeoutError:
                log.warning("http server did not close in time")
        else:
            self.listener.close()
        if self.dra is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(budget(SHUTDOWN_HTTP_SECONDS)):
                    await self.dra.close()
        if self._node_health_api is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(budget(SHUTDOWN_HTTP_SECONDS)):
                    await self._node_health_api.close()
        await monitor.close(wait=budget(SHUTDOWN_NVML_SECONDS, 0.0))  # bounded by its own wait
        if self.simulator is not None:
            from gpuagent.gpu import sim  # noqa: PLC0415

            # A real driver is released by the kernel when the process exits; the simulated one
            # is uninstalled now, so its event wait is ended (as an interrupt ends a real one)
            # and the event thread releases the driver first.
            self.simulator.interrupt_waits()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(budget(SHUTDOWN_HTTP_SECONDS, 0.0)):
                    await monitor.wait_closed()
            sim.uninstall()
        log.info("stopped")

    # ----- reload ------------------------------------------------------------------------------
    def request_reload(self) -> None:
        """Re-read flags, environment and config file soon (SIGHUP); the work is done off the
        signal handler, and the file is parsed off the loop."""
        self._reload_requested.set()

    async def _reload_when_asked(self) -> None:
        """Reload on :meth:`request_reload`, and when the config file changes (a ConfigMap
        update, an edit: its size, times or inode move)."""
        path = self.settings.config_file
        interval = self._config_poll_interval if path is not None else None
        stamp = await asyncio.to_thread(_file_stamp, path) if path is not None else None
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval):
                    await self._reload_requested.wait()
            asked = self._reload_requested.is_set()
            self._reload_requested.clear()
            if path is not None:
                seen, stamp = stamp, await asyncio.to_thread(_file_stamp, path)
                if not asked and stamp == seen:
                    continue
                if not asked:
                    log.info("config file changed; reloading", path=str(path))
            await self.reload()

    async def reload(self) -> list[str] | None:
        """Re-read the settings (off the loop) and apply them; returns the keys that need a
        restart to change, or ``None`` when the new configuration is invalid (nothing changes).
        """
        assert self._settings_source is not None
        try:
            settings, plan = await asyncio.to_thread(self._read_settings, self._settings_source)
        except SettingError as exc:
            self.store.counters.reloaded("invalid")
            log.error("reloaded configuration is invalid; keeping the running one", error=str(exc))
            return None
        snapshot = self.store.snapshot
        if self.monitor is not None and snapshot.discovered:
            absent = _absent_dra_gpus(plan.dra.gpus, snapshot, len(self.monitor.gpu_indexes))
            if absent is not None:
                self.store.counters.reloaded("invalid")
                log.error(
                    "reloaded configuration is invalid; keeping the running one",
                    error=str(ConfigError("dra-gpus", absent)),
                )
                return None
        if self.cdi is not None and plan.writes_cdi_spec and snapshot.discovered:
            # The spec first, then the plan: an Allocate answered with CDI names finds them.
            containers = keep_restart_only(plan, self.store.plan).serving.containers
            await self.cdi.sync(snapshot, containers)
        return self.apply(settings, plan)

    def apply(self, settings: Settings, plan: Plan) -> list[str]:
        """Serve under ``plan`` (from ``settings``) from now on; returns the keys of ``settings``
        that need a restart to change. A plan equal to the running one changes nothing."""
        restart = restart_keys(self.settings, settings)
        published = self.store.publish(keep_restart_only(plan, self.store.plan))
        self.settings = replace(self.settings, **{k: getattr(settings, k) for k in LIVE})
        self.store.counters.reloaded("changed" if published is not None else "unchanged")
        generation = self.store.plan.generation
        if published is not None:
            log.info("configuration reloaded", generation=generation, needs_restart=restart)
        else:
            log.info("configuration unchanged", generation=generation, needs_restart=restart)
        if restart:
            log.warning("changed settings take effect only after a restart", keys=restart)
        return restart

    @staticmethod
    def _read_settings(source: Callable[[], Settings]) -> tuple[Settings, Plan]:
        settings = source()
        return settings, make_plan(settings)


def _absent_dra_gpus(gpus: DraGpus, snapshot: Snapshot, count: int) -> str | None:
    """Why ``gpus`` (``--dra-gpus``) cannot be served on the node of ``snapshot`` (``count``
    GPUs): the GPUs it names that the node does not have; None when there are none (so far)."""
    absent = gpus.absent(snapshot.gpus, count)
    if not absent:
        return None
    has = f"GPU indexes 0-{count - 1}" if count else "no GPUs"
    if any(not ref.isdigit() for ref in absent):
        uuids = ", ".join(g.uuid for g in sorted(snapshot.gpus, key=lambda g: g.index))
        has += f" and UUIDs {uuids}" if uuids else ""
    named = ", ".join(f"GPU {ref}" if ref.isdigit() else ref for ref in absent)
    return f"names {named}, which this node does not have (it has {has})"


def _cdi_target(settings: Settings) -> CdiTarget:
    """Where the CDI spec goes and how the driver's files are found (node spec and DRA claims)."""
    from gpuagent.nodefiles.cdikeeper import CdiTarget  # noqa: PLC0415

    return CdiTarget(
        spec_dir=settings.cdi_spec_dir,
        mode=settings.cdi_spec,
        driver_root=str(settings.nvidia_driver_root),
        read_root=driver_root_as_read(settings),
        hook_path=settings.nvidia_cdi_hook_path,
    )


def _node_files(
    store: DeviceStore, settings: Settings, *, sysfs_root: Path, simulated: bool
) -> NodeFiles:
    """The node's files this agent may write besides the CDI spec: simulated GPUs must not reach
    the host's real node-feature-discovery directory by default."""
    from gpuagent.nodefiles.labelkeeper import LabelTarget, NodeFiles  # noqa: PLC0415
    from gpuagent.nodefiles.labels import DEFAULT_FEATURES_FILE  # noqa: PLC0415

    labels: LabelTarget | None = LabelTarget(
        path=settings.node_labels_file,
        machine_type_file=settings.machine_type_file,
        sysfs_root=sysfs_root,
    )
    if not settings.node_labels or (
        simulated and settings.node_labels_file == DEFAULT_FEATURES_FILE
    ):
        labels = None
    return NodeFiles(store, labels=labels)


def _keeps_cdi_spec(settings: Settings, *, simulated: bool) -> bool:
    """Whether this agent keeps the node's CDI spec: simulated GPUs must not reach the host's
    real CDI directory by default."""
    return not (simulated and settings.cdi_spec_dir == Path(CDI_SPEC_DIR))


def _import(modules: tuple[str, ...]) -> None:
    for name in modules:
        importlib.import_module(name)


def _file_stamp(path: Path) -> tuple[int, ...] | None:
    """What changes when the file does (a ConfigMap swaps a symlink: a new inode), or None
    while it cannot be read."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
