"""Settings → plan: what the configuration means for the agent, checked once.

:func:`make_plan` turns validated :class:`~gpuagent.config.Settings` (already in the domain's own
types) into the :class:`~gpuagent.domain.plan.Plan` the store keeps, finding the host facts the
domain may not look up itself (which driver control nodes exist). The files the settings point at
— the web config, the simulated node — are loaded here too, so every setting's error is a
:class:`~gpuagent.config.ConfigError` naming it (exit code 2) before anything starts.

A reload applies the options declared ``live`` (:class:`~gpuagent.config.option.Option`), the
ones the plan holds: :func:`live_settings` takes them from the reloaded settings, and
:func:`reloaded_plan` is the plan of the result. :func:`restart_keys` says which settings a reload
cannot apply: everything else (sockets, addresses, intervals, files, and the plan's parts read
once: the driver root, the CDI spec's mode, the DRA split) is read once at start.
"""

from __future__ import annotations

import socket
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from gpuagent.config.errors import ConfigError
from gpuagent.config.groups.nodefiles import CDI_SPEC_TOOLKIT
from gpuagent.config.option import bindings
from gpuagent.config.options import OPTIONS
from gpuagent.config.settings import Settings
from gpuagent.domain.containers import CDI_KIND, CONTROL_NODES, TOOLKIT_CDI_KIND, ContainerSettings
from gpuagent.domain.dra import DraGpus, DraPlan
from gpuagent.domain.errors import SettingError
from gpuagent.domain.health import HealthCheckSpecError, HealthPolicy
from gpuagent.domain.mps import MpsDirs
from gpuagent.domain.plan import Plan
from gpuagent.domain.resources import ResourceSettings
from gpuagent.domain.serving import ServingPolicy
from gpuagent.sockets.dirwatch import file_in_the_way

if TYPE_CHECKING:  # imported when used: neither is needed on most nodes
    from gpuagent.gpu import sim
    from gpuagent.web.webconfig import WebConfig, WebConfigFile

__all__ = [
    "LIVE",
    "check_metrics_address",
    "check_on_the_host",
    "check_socket_dirs",
    "driver_root_as_read",
    "live_settings",
    "load_simulator",
    "load_web_config",
    "make_plan",
    "reloaded_plan",
    "reread_web_config",
    "restart_keys",
    "unresolved",
    "use_web_config",
]

# Settings the plan holds (the fields of the options declared live): a reload applies them
# without a restart.
LIVE = frozenset(bound.field for bound in bindings(Settings) if bound.option.live)
_SPELLING = {opt.dest: opt.name for opt in OPTIONS}


def make_plan(settings: Settings, *, control_nodes: tuple[str, ...] | None = None) -> Plan:
    """The plan for ``settings``; raises :class:`ConfigError` naming the setting at fault.

    ``control_nodes`` are the NVIDIA control device nodes present under the driver root, looked
    up here unless given (the domain does no I/O). Reads the file system: call it off the loop.
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
        knob = "enable_healthchecks" if "ENABLE" in exc.knob else "disable_healthchecks"
        raise ConfigError(settings.named(knob), exc.reason) from exc
    try:
        serving = ServingPolicy(
            resources=ResourceSettings(
                resource_name=settings.resource_name,
                mig_strategy=settings.mig_strategy,
                time_slicing=settings.sharing.time_slicing,
                mps=settings.sharing.mps,
            ),
            containers=ContainerSettings(
                strategies=settings.device_list_strategy,
                id_strategy=settings.device_id_strategy,
                pass_device_specs=settings.pass_device_specs,
                dev_root=str(root),
                control_nodes=control_nodes,
                cdi_annotation_prefix=settings.cdi_annotation_prefix,
                cdi_kind=TOOLKIT_CDI_KIND if settings.cdi_spec == CDI_SPEC_TOOLKIT else CDI_KIND,
                mps=MpsDirs(str(settings.mps_root)),
            ),
            shared_allocation=settings.shared_devices_allocation_policy,
            dra_gpus=DraGpus.parse(settings.dra_gpus),
        )
    except SettingError as exc:
        raise ConfigError(_named(settings, exc.key), exc.reason) from exc
    dra = DraPlan(
        gpus=serving.dra_gpus,
        driver=settings.dra_driver_name,
        mig_strategy=serving.resources.mig_strategy,
        mig=settings.dra_mig,
        sharing=settings.dra_sharing,
    )
    return Plan(serving=serving, health=health, dra=dra)


# The domain's names of what it checks, where they are not the option's.
_DOMAIN_KEYS = {"dev-root": "nvidia_driver_root"}


def _named(settings: Settings, key: str) -> str:
    """The domain's ``key`` (an option's name, or a path under one: ``sharing.timeSlicing``)
    as the operator gave the option."""
    head, dot, rest = key.partition(".")
    option = _DOMAIN_KEYS.get(head, head.replace("-", "_"))
    if option not in _SPELLING:
        return key
    return f"{settings.named(option)}{dot}{rest}"


def live_settings(running: Settings, reloaded: Settings) -> Settings:
    """What a reload to ``reloaded`` runs under: ``running`` with the live settings of
    ``reloaded`` (the others wait for a restart)."""
    return replace(running, **{key: getattr(reloaded, key) for key in LIVE})


def reloaded_plan(running: Plan, settings: Settings) -> Plan:
    """The plan a reload serves, for ``settings`` (from :func:`live_settings`), with the host's
    facts found at start kept from the ``running`` plan (the driver's control nodes)."""
    return make_plan(settings, control_nodes=running.serving.containers.control_nodes)


def driver_root_as_read(settings: Settings) -> Path:
    """Where the agent reads the driver root: its mount in the agent's container, or itself."""
    return settings.driver_root_ctr_path or settings.nvidia_driver_root


def restart_keys(running: Settings, reloaded: Settings) -> list[str]:
    """The settings that differ between ``running`` and ``reloaded`` but only apply at start,
    spelled as options (``metrics-address``, ``poll-interval``)."""
    old, new = running.as_dict(), reloaded.as_dict()
    changed = {k for k in new if k not in LIVE and new[k] != old[k]}
    if changed & {"metrics_host", "metrics_port"}:
        changed = (changed - {"metrics_host", "metrics_port"}) | {"metrics_address"}
    return sorted(_SPELLING.get(k, k.replace("_", "-")) for k in changed)


def load_web_config(settings: Settings) -> WebConfigFile | None:
    """The ``--web-config-file``, checked (TLS files included); raises :class:`ConfigError`."""
    if settings.web_config_file is None:
        return None
    from gpuagent.web.webconfig import WebConfigFile  # noqa: PLC0415

    try:
        return WebConfigFile(settings.web_config_file)
    except SettingError as exc:
        raise _in_file(settings.named("web_config_file"), settings.web_config_file, exc) from exc


def reread_web_config(web: WebConfigFile, named: str = "--web-config-file") -> WebConfig:
    """The running ``--web-config-file`` (given as ``named``) read again for a reload
    (blocking: call it off the loop), checked as at start; raises :class:`ConfigError`."""
    try:
        return web.reread()
    except SettingError as exc:
        raise _in_file(named, web.path, exc) from exc


def use_web_config(web: WebConfigFile, config: WebConfig, named: str = "--web-config-file") -> bool:
    """Serve ``config`` (from :func:`reread_web_config`) from now on; returns whether it changed.
    Raises :class:`ConfigError` when its certificates no longer load (replaced since)."""
    try:
        return web.use(config)
    except SettingError as exc:
        raise _in_file(named, web.path, exc) from exc


def load_simulator(settings: Settings) -> sim.SimDriver | None:
    """The simulated driver described by the settings, or ``None`` on real hardware."""
    if settings.simulate is None and settings.sim_config is None:
        return None
    from gpuagent.gpu import sim  # noqa: PLC0415

    try:
        if settings.simulate is not None:
            return sim.SimDriver(sim.node_from_count(settings.simulate))
        if settings.sim_config is not None:
            return sim.SimDriver(sim.load_sim_config(settings.sim_config))
    except SettingError as exc:
        raise _in_file(settings.named("sim_config"), settings.sim_config, exc) from exc
    return None


def check_on_the_host(settings: Settings, plan: Plan) -> None:
    """Raise :class:`ConfigError` for a setting the host cannot serve: a socket directory that is
    a file (:func:`check_socket_dirs`), a metrics host that does not resolve
    (:func:`check_metrics_address`). Blocking."""
    check_socket_dirs(settings, plan)
    check_metrics_address(settings)


def check_socket_dirs(settings: Settings, plan: Plan) -> None:
    """Raise :class:`ConfigError` when a directory the agent keeps or finds sockets in is a file,
    or lies under one: nothing could ever be served or found there. A directory that does not
    exist yet is fine (it is made, or waited for)."""
    dirs: list[tuple[str, Path]] = []
    if settings.kubernetes:
        dirs += [
            ("socket_dir", settings.socket_dir),
            ("kubelet_socket", settings.kubelet_socket.parent),
            ("pod_resources_socket", settings.pod_resources_socket.parent),
        ]
    if plan.dra.gpus.enabled:
        dirs += [
            ("plugins_dir", settings.plugins_dir),
            ("plugins_registry_dir", settings.plugins_registry_dir),
        ]
    for option, directory in dirs:
        blocker = file_in_the_way(directory)
        if blocker is not None:
            raise ConfigError(settings.named(option), f"{blocker} is not a directory")


def check_metrics_address(settings: Settings) -> None:
    """Raise :class:`ConfigError` when the metrics address's host does not resolve (binding it
    would fail with a resolver code, 'Unknown error -2'). Asks the resolver: blocking."""
    host = settings.metrics_host
    if not host:
        return
    try:
        socket.getaddrinfo(
            host, settings.metrics_port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as exc:
        raise ConfigError(settings.named("metrics_address"), unresolved(host, exc)) from exc


def unresolved(host: str, exc: socket.gaierror) -> str:
    """Why ``host`` cannot be listened on: the resolver's answer, said as such."""
    return f"host {host!r} does not resolve ({exc.strerror})"


def _in_file(option: str, path: Path | None, exc: SettingError) -> ConfigError:
    """``exc``, a key inside the file ``option`` (as given) names, as an error of that option;
    an error of the whole file (unreadable, not YAML: its reason names the file) as the
    option's own."""
    if exc.key in ("file", "sim-config", "web-config-file"):
        return ConfigError(option, exc.reason)
    where = f" (in {path})" if path is not None else ""
    return ConfigError(f"{option} {exc.key}", f"{exc.reason}{where}")
