"""The composition root: settings → store → driver → services, as named, supervised tasks.

Shutdown is graceful and bounded: ListAndWatch streams end with UNAVAILABLE, the plugin socket is
removed, the HTTP server stops, and the driver is released, all within about two seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from gpuagent import __version__
from gpuagent.cdi import DEFAULT_CDI_DIR
from gpuagent.config import ConfigError, Settings
from gpuagent.domain.containers import (
    CDI_KIND,
    CONTROL_NODES,
    TOOLKIT_CDI_KIND,
    ContainerSettings,
    DeviceListStrategy,
)
from gpuagent.domain.counters import AgentCounters, CriStats, NvmlCallStats, PodResourcesStats
from gpuagent.domain.devices import IdStrategy
from gpuagent.domain.dra import DraGpus, DraPlan
from gpuagent.domain.errors import SettingError
from gpuagent.domain.health import HealthCheckSpecError, HealthPolicy
from gpuagent.domain.naming import socket_name
from gpuagent.domain.preferred import SharedAllocationPolicy
from gpuagent.domain.resources import MigStrategy, ResourceSettings
from gpuagent.domain.serving import ResourceView, ServingPolicy
from gpuagent.domain.store import DeviceStore
from gpuagent.domain.timeslicing import ReplicaRule, TimeSlicing
from gpuagent.gpu import sim
from gpuagent.gpu.monitor import GpuMonitor
from gpuagent.gpu.nvml import DriverUnavailable, Nvml
from gpuagent.kubelet.plugin import DevicePluginService
from gpuagent.kubelet.podresources import PodResourcesClient
from gpuagent.kubelet.registration import PluginEndpoint, Timing
from gpuagent.labels import DEFAULT_FEATURES_FILE
from gpuagent.nodefiles import TOOLKIT, CdiTarget, LabelTarget, write_cdi, write_labels
from gpuagent.runtime.accountant import Accountant
from gpuagent.runtime.cri import CriClient
from gpuagent.runtime.procfs import ProcReader
from gpuagent.web.metrics import MetricsRenderer
from gpuagent.web.server import HttpServer, build_app
from gpuagent.web.webconfig import WebConfigError, WebConfigFile

if TYPE_CHECKING:
    from gpuagent.draplugin import DraSide

log = structlog.get_logger("gpuagent")

SHUTDOWN_STREAMS_TIMEOUT = 0.5
SHUTDOWN_TASKS_TIMEOUT = 1.0


# Settings a reload applies without a restart (the rest need one: sockets, addresses, …).
_LIVE_KEYS = frozenset(
    {
        "resource_name", "device_list_strategy", "device_id_strategy", "mig_strategy",
        "pass_device_specs", "sharing", "shared_devices_allocation_policy",
        "cdi_annotation_prefix", "disable_healthchecks", "enable_healthchecks",
    }
)  # fmt: skip


class FatalError(Exception):
    """The agent cannot run (exit code 1): e.g. no driver with --fail-on-init-error."""


@dataclass(frozen=True, slots=True)
class Plan:
    """Settings turned into domain policies."""

    serving: ServingPolicy
    health: HealthPolicy
    dra: DraPlan = field(default_factory=DraPlan)


def plan(settings: Settings, *, control_nodes: tuple[str, ...] | None = None) -> Plan:
    """Validate settings beyond their syntax; raises :class:`ConfigError` (exit code 2).

    ``control_nodes`` are the NVIDIA control device nodes present under the driver root, found
    once here (the domain does no I/O).
    """
    root = settings.nvidia_driver_root
    if control_nodes is None:
        seen_at = driver_root_as_read(settings)
        control_nodes = tuple(p for p in CONTROL_NODES if (seen_at / p.lstrip("/")).exists())
    try:
        health = HealthPolicy.from_env_values(
            settings.disable_healthchecks, settings.enable_healthchecks
        )
    except HealthCheckSpecError as exc:
        raise ConfigError("healthchecks", str(exc)) from exc
    try:
        serving = ServingPolicy(
            resources=ResourceSettings(
                resource_name=settings.resource_name,
                mig_strategy=MigStrategy(settings.mig_strategy),
                time_slicing=time_slicing(settings.sharing),
            ),
            containers=ContainerSettings(
                strategies=tuple(DeviceListStrategy(s) for s in settings.device_list_strategy),
                id_strategy=IdStrategy(settings.device_id_strategy),
                pass_device_specs=settings.pass_device_specs,
                dev_root=str(root),
                control_nodes=control_nodes,
                cdi_annotation_prefix=settings.cdi_annotation_prefix,
                cdi_kind=TOOLKIT_CDI_KIND if settings.cdi_spec == TOOLKIT else CDI_KIND,
            ),
            shared_allocation=SharedAllocationPolicy(settings.shared_devices_allocation_policy),
            dra_gpus=DraGpus.parse(settings.dra_gpus),
        )
    except SettingError as exc:
        raise ConfigError(exc.key, exc.reason) from exc
    dra = DraPlan(
        gpus=serving.dra_gpus,
        driver=settings.dra_driver_name,
        mig_strategy=serving.resources.mig_strategy,
    )
    return Plan(serving=serving, health=health, dra=dra)


def driver_root_as_read(settings: Settings) -> Path:
    """Where the agent reads the driver root: its mount in the agent's container, or itself."""
    return settings.driver_root_ctr_path or settings.nvidia_driver_root


def time_slicing(sharing: Mapping[str, object]) -> TimeSlicing:
    """NVIDIA's ``sharing.timeSlicing`` block as the domain's :class:`TimeSlicing`.

    Raises :class:`SettingError` naming the key (``sharing.timeSlicing.resources[1].replicas``).
    """
    block = sharing.get("timeSlicing")
    if block is None:
        block = {}
    key = "sharing.timeSlicing"
    if not isinstance(block, Mapping):
        raise SettingError(key, "expected a mapping")
    unknown = set(block) - {"renameByDefault", "failRequestsGreaterThanOne", "resources"}
    if unknown:
        raise SettingError(key, f"unknown keys {sorted(map(str, unknown))}")
    rules = []
    entries = block.get("resources")
    if entries is None:
        entries = []
    if not isinstance(entries, list):
        raise SettingError(f"{key}.resources", "expected a list")
    for i, entry in enumerate(entries):
        where = f"{key}.resources[{i}]"
        if not isinstance(entry, Mapping):
            raise SettingError(where, "expected a mapping {name, replicas, devices, rename}")
        extra = set(entry) - {"name", "replicas", "devices", "rename"}
        if extra:
            raise SettingError(where, f"unknown keys {sorted(map(str, extra))}")
        name, replicas = entry.get("name"), entry.get("replicas")
        rename, devices = entry.get("rename", ""), entry.get("devices", "all")
        if not isinstance(name, str):
            raise SettingError(f"{where}.name", "a resource name is required")
        if isinstance(replicas, bool) or not isinstance(replicas, int):
            raise SettingError(f"{where}.replicas", f"expected a whole number, got {replicas!r}")
        if not isinstance(rename, str):
            raise SettingError(f"{where}.rename", f"expected a resource name, got {rename!r}")
        if isinstance(devices, list):
            if not all(isinstance(d, str | int) and not isinstance(d, bool) for d in devices):
                raise SettingError(f"{where}.devices", "expected indexes or UUIDs")
            devices = tuple(str(d) for d in devices)
        elif isinstance(devices, bool) or not isinstance(devices, str | int):
            raise SettingError(f"{where}.devices", f"expected all, a count or a list: {devices!r}")
        rules.append(ReplicaRule(name=name, replicas=replicas, devices=devices, rename=rename))
    flags = {}
    for name in ("renameByDefault", "failRequestsGreaterThanOne"):
        value = block.get(name, False)
        if not isinstance(value, bool):
            raise SettingError(f"{key}.{name}", f"expected true or false, got {value!r}")
        flags[name] = value
    return TimeSlicing(
        resources=tuple(rules),
        rename_by_default=flags["renameByDefault"],
        fail_requests_greater_than_one=flags["failRequestsGreaterThanOne"],
    )


def served_resources(plan: Plan) -> tuple[str, ...]:
    """The resource names this agent advertises (time-slicing renames included), for attribution.

    MIG resources (``<domain>/mig-…``) are recognised by the attribution itself.
    """
    resources = plan.serving.resources
    sharing = resources.time_slicing
    names = {resources.resource_name, f"{resources.resource_name}.shared"}
    names.update(rule.name for rule in sharing.resources)
    names.update(sharing.target(rule) for rule in sharing.resources)
    return tuple(sorted(names))


def load_web_config(settings: Settings) -> WebConfigFile | None:
    """The ``--web-config-file``, checked (TLS files included); raises :class:`ConfigError`."""
    if settings.web_config_file is None:
        return None
    try:
        return WebConfigFile(settings.web_config_file)
    except WebConfigError as exc:
        raise ConfigError(f"web-config-file {exc.key}", exc.reason) from exc


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
        settings_source: Callable[[], Settings] | None = None,
        config_poll_interval: float = 2.0,
        node_name: str | None = None,
        dra_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.settings = settings
        self._nvml_call_timeout = nvml_call_timeout
        self.plan = plan(settings)
        self.web_config = load_web_config(settings)
        self.simulator = simulator
        self.store = DeviceStore()
        self.pod_resources = PodResourcesClient(
            self.store,
            settings.pod_resources_socket,
            served_resources(self.plan),
            interval=settings.pod_resources_interval,
        )
        # Per-container GPU accounting: process -> cgroup -> container -> names (CRI).
        self.cri = CriClient(settings.cri_socket)
        self.accountant = Accountant(self.store, ProcReader(settings.proc_root), self.cri)
        self.stats = Stats()
        self.stopping = asyncio.Event()
        self.started = asyncio.Event()
        self._sysfs_root = sysfs_root
        self._hostname = hostname or socket.gethostname()
        self._timing = registration_timing
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self.view = ResourceView(self.plan.serving)
        self.services: dict[str, DevicePluginService] = {}
        self.endpoints: dict[str, PluginEndpoint] = {}
        self.http: HttpServer | None = None
        self.monitor: GpuMonitor | None = None
        self._resources_changed = asyncio.Event()
        self._settings_source = settings_source
        self._config_poll_interval = config_poll_interval
        self.node_name = node_name or os.environ.get("NODE_NAME") or self._hostname
        self.dra = self._dra_side(dra_options or {}) if self.plan.dra.gpus.enabled else None

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
        if self.view.error:
            return f"devices cannot be advertised: {self.view.error}"
        if not snapshot.registered:
            missing = [e for e in self.endpoints.values() if not e.registered]
            detail = "; ".join(
                f"{e.resource_name}: {e.last_error}" for e in missing if e.last_error
            )
            return "not registered with the kubelet" + (f": {detail}" if detail else "")
        if self.dra is not None:
            return self.dra.readiness()
        return None

    @property
    def endpoint(self) -> PluginEndpoint | None:
        """The endpoint of the main resource (``--resource-name``), else the first one."""
        main = self.endpoints.get(self.plan.serving.resources.resource_name)
        return main or next(iter(self.endpoints.values()), None)

    def counters(self) -> AgentCounters:
        registrations = sum(e.registrations for e in self.endpoints.values())
        pods = self.pod_resources
        return AgentCounters(
            registrations=registrations,
            allocations=self.stats.allocations,
            pod_resources=PodResourcesStats(pods.requests, pods.errors, pods.socket_present),
            cri=CriStats(self.cri.requests, self.cri.errors, len(self.cri.names)),
            nvml=tuple(
                NvmlCallStats(name, s.count, s.seconds, s.errors)
                for name, s in self.monitor.call_totals()
            )
            if self.monitor is not None
            else (),
            dra=self.dra.counters() if self.dra is not None else None,
        )

    def _dra_side(self, options: Mapping[str, Any]) -> DraSide:
        """The DRA side (imported only when DRA is on: its API client costs memory)."""
        from gpuagent.draplugin import DraSide, KubeConfigError  # noqa: PLC0415

        containers = self.plan.serving.containers
        try:
            return DraSide(
                self.store,
                self.plan.dra,
                node=self.node_name,
                plugins_dir=self.settings.plugins_dir,
                registry_dir=self.settings.plugins_registry_dir,
                cdi_dir=self.settings.cdi_spec_dir,
                kubeconfig=self.settings.kubeconfig,
                stopping=self.stopping,
                dev_root=containers.dev_root,
                control_nodes=containers.control_nodes,
                **options,
            )
        except KubeConfigError as exc:
            raise ConfigError("kubeconfig", str(exc)) from exc

    def _on_allocate(self, seconds: float) -> None:
        self.stats.on_allocate(seconds)
        self.pod_resources.poke()

    # ----- lifecycle ---------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        """Run until ``stop`` is set, then shut down; raises :class:`FatalError` on failure."""
        if self.simulator is not None:
            sim.install(self.simulator)
        self.monitor = monitor = GpuMonitor(
            self.store,
            Nvml(self._sysfs_root),
            self.plan.health,
            poll_interval=self.settings.poll_interval,
            call_timeout=self._nvml_call_timeout,
        )
        renderer = MetricsRenderer(
            self._hostname,
            __version__,
            hostname_label=None if self.settings.no_hostname else self.settings.hostname_label,
            container_shares=self.settings.dcgm_container_shares,
        )
        app = build_app(
            self.store,
            renderer,
            self.counters,
            self,
            simulator=self.simulator,
            web_config=self.web_config,
        )
        self.http = HttpServer(
            app,
            self.settings.metrics_host,
            self.settings.metrics_port,
            ssl_context=self.web_config.ssl_context if self.web_config is not None else None,
        )
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
            self._spawn("kubelet-registration", self._serve_resources())
            self._spawn("pod-resources", self.pod_resources.run())
            self._spawn("gpu-accounting", self.accountant.run())
            self._spawn("node-files", self._write_node_files())
            self._spawn("config-watch", self._watch_config_file())
            if self.dra is not None:
                for name, task in self.dra.tasks().items():
                    self._spawn(name, task())
            self.started.set()
            await self._supervise(stop)
        finally:
            await self._shutdown(monitor)

    def _spawn(self, name: str, coro: Coroutine[Any, Any, None]) -> None:
        self._tasks[name] = asyncio.create_task(coro, name=name)

    async def _serve_resources(self) -> None:
        """Once GPUs are discovered, serve and register one endpoint per advertised resource.

        Runs for the agent's lifetime: after a reload it starts endpoints for new resources and
        stops those of resources no longer advertised; the others keep their streams.
        """
        version = self.store.snapshot.version
        while not self.store.snapshot.discovered:
            version = (await self.store.wait_newer(version)).version
        tasks: dict[str, asyncio.Task[None]] = {}
        try:
            while True:
                await self._reconcile_endpoints(tasks)
                self._resources_changed.clear()
                changed = asyncio.create_task(self._resources_changed.wait())
                done, _ = await asyncio.wait(
                    {changed, *tasks.values()}, return_when=asyncio.FIRST_COMPLETED
                )
                changed.cancel()
                for task in done:
                    if task is not changed:
                        task.result()  # an endpoint never ends by itself: surface its error
                        raise RuntimeError(f"{task.get_name()} ended")
        finally:
            for task in tasks.values():
                task.cancel()
            if tasks:
                await asyncio.wait(tasks.values(), timeout=SHUTDOWN_TASKS_TIMEOUT)

    async def _reconcile_endpoints(self, tasks: dict[str, asyncio.Task[None]]) -> None:
        resources = self.view.resources(self.store.snapshot)
        for note in resources.notes:
            log.warning("resource note", note=note)
        # A node without devices still registers its main resource (with no devices), so the
        # kubelet shows capacity 0 rather than a stale value.
        names = resources.names or (self.plan.serving.resources.resource_name,)
        for name in [n for n in tasks if n not in names]:
            log.info("resource no longer advertised; stopping its endpoint", resource=name)
            tasks.pop(name).cancel()
            self.endpoints.pop(name, None)
            self.services.pop(name, None)
        for name in names:
            if name in tasks:
                continue
            resource = resources.get(name)
            socket_file = resource.socket_name if resource is not None else socket_name(name)
            service = DevicePluginService(
                self.store, self.view, name, self.stopping, on_allocate=self._on_allocate
            )
            self.services[name] = service
            endpoint = PluginEndpoint(
                service,
                self.store,
                socket_path=self.settings.socket_dir / socket_file,
                kubelet_socket=self.settings.kubelet_socket,
                resource_name=name,
                timing=self._timing,
                on_registered=self.stats.register_seconds.append,
                on_state=self._publish_registration,
            )
            self.endpoints[name] = endpoint
            tasks[name] = asyncio.create_task(endpoint.run(), name=f"kubelet-registration:{name}")
        log.info("serving resources", resources=list(names))
        self._publish_registration()

    def reload_from_source(self) -> None:
        """Re-read flags, environment and config file (SIGHUP, or the file changed) and apply."""
        if self._settings_source is None:
            log.warning("reload requested but the agent has no settings source")
            return
        try:
            self.reload(self._settings_source())
        except ConfigError as exc:
            log.error("reloaded configuration is invalid; keeping the running one", error=str(exc))

    async def _watch_config_file(self) -> None:
        """Reload when the config file's content changes (a ConfigMap update, an edit)."""
        path = self.settings.config_file
        if path is None or self._settings_source is None:
            await asyncio.Event().wait()  # nothing to watch; stay alive for supervision
            return
        seen = await asyncio.to_thread(_file_stamp, path)
        while True:
            await asyncio.sleep(self._config_poll_interval)
            stamp = await asyncio.to_thread(_file_stamp, path)
            if stamp != seen:
                seen = stamp
                log.info("config file changed; reloading", path=str(path))
                self.reload_from_source()

    def reload(self, settings: Settings) -> list[str]:
        """Apply a re-read configuration; returns the keys that need a restart to change.

        Serving (resources, sharing, strategies) and health-check settings apply at once: only
        resources that appear or disappear are registered or withdrawn, and every stream resends
        its list if it changed. Raises :class:`ConfigError` for an invalid configuration, which
        is then not applied at all.
        """
        new_plan = plan(settings)
        # Which GPUs DRA serves, and as which driver, needs a restart: keep the running split so
        # a GPU never shows up in both APIs (or in neither).
        new_plan = replace(
            new_plan,
            serving=replace(new_plan.serving, dra_gpus=self.plan.serving.dra_gpus),
            dra=replace(self.plan.dra, mig_strategy=new_plan.dra.mig_strategy),
        )
        live = _LIVE_KEYS
        old, new = self.settings.as_dict(), settings.as_dict()
        restart = sorted(k for k in new if k not in live and new[k] != old[k])
        self.plan = new_plan
        self.view.set_policy(new_plan.serving)
        if self.dra is not None:
            self.dra.set_plan(new_plan.dra)
        if self.monitor is not None:
            self.monitor.set_policy(new_plan.health)
        self.settings = replace(self.settings, **{k: getattr(settings, k) for k in live})
        self.store.update(lambda s: replace(s, policy_generation=s.policy_generation + 1))
        self._resources_changed.set()
        log.info("configuration reloaded", needs_restart=restart)
        return restart

    async def _write_node_files(self) -> None:
        """Keep the CDI spec (with a cdi-* strategy) and the node-label file current.

        Both depend on which devices exist, not on health or telemetry, so they are rebuilt only
        when the device set changes; the writers replace a file atomically and only when its
        content differs. A write that fails is logged and retried at the next change.
        """
        containers = self.plan.serving.containers
        cdi_wanted = any(s.value.startswith("cdi-") for s in containers.strategies)
        labels_wanted = self.settings.node_labels
        if self.simulator is not None:
            # Simulated GPUs must not reach the host's real CDI or NFD directories by default.
            cdi_wanted = cdi_wanted and self.settings.cdi_spec_dir != DEFAULT_CDI_DIR
            labels_wanted = (
                labels_wanted and self.settings.node_labels_file != DEFAULT_FEATURES_FILE
            )
        if not cdi_wanted and not labels_wanted:
            await asyncio.Event().wait()  # nothing to keep current; stay alive for supervision
        written: object = None
        version = -1
        while True:
            snapshot = await self.store.wait_newer(version)
            version = snapshot.version
            key = (
                snapshot.discovered,
                snapshot.policy_generation,  # a reload may change sharing, naming, CDI kind
                snapshot.driver.version,
                tuple((g.uuid, g.mig_devices) for g in snapshot.gpus),
            )
            if not snapshot.discovered or key == written:
                continue
            written = key
            if cdi_wanted:
                target = CdiTarget(
                    spec_dir=self.settings.cdi_spec_dir,
                    mode=self.settings.cdi_spec,
                    driver_root=str(self.settings.nvidia_driver_root),
                    read_root=driver_root_as_read(self.settings),
                    hook_path=self.settings.nvidia_cdi_hook_path,
                )
                await self._write(
                    "cdi spec", self.settings.cdi_spec_dir, write_cdi, snapshot, containers, target
                )
            if labels_wanted:
                labels = LabelTarget(
                    path=self.settings.node_labels_file,
                    machine_type_file=self.settings.machine_type_file,
                    sysfs_root=self._sysfs_root,
                )
                resources = self.plan.serving.resources
                await self._write(
                    "node labels", labels.path, write_labels, snapshot, resources, labels
                )

    async def _write(
        self, what: str, path: Path, writer: Callable[..., bool], *args: object
    ) -> None:
        try:
            changed = await asyncio.to_thread(writer, *args)
        except OSError as exc:
            log.warning("cannot write file", what=what, error=str(exc))
        else:
            if changed:
                log.info("file updated", what=what, path=str(path))

    def _publish_registration(self) -> None:
        registered = bool(self.endpoints) and all(e.registered for e in self.endpoints.values())
        self.store.update(lambda s: replace(s, registered=registered))

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

    async def _shutdown(self, monitor: GpuMonitor) -> None:
        log.info("shutting down")
        self.stopping.set()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(
                asyncio.gather(*(s.wait_drained() for s in self.services.values())),
                SHUTDOWN_STREAMS_TIMEOUT,
            )
        for task in self._tasks.values():
            task.cancel()
        if self._tasks:
            _, hung = await asyncio.wait(self._tasks.values(), timeout=SHUTDOWN_TASKS_TIMEOUT)
            for task in hung:
                log.warning("task did not stop in time", task=task.get_name())
        await monitor.close()
        if self.dra is not None:
            await self.dra.close()
        if self.http is not None:
            await self.http.close()
        if self.simulator is not None:
            sim.uninstall()
        log.info("stopped")


def _file_stamp(path: Path) -> bytes | None:
    """The file's content (config files are small), or None while it cannot be read."""
    try:
        return path.read_bytes()
    except OSError:
        return None
