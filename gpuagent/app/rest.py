"""The rest: what the agent starts once the kubelet has its device plugin, built together.

Their modules are imported off the loop first (:mod:`gpuagent.app.startup`), so they are built
by one function, :func:`build_rest`, once that is done: the metrics renderer and HTTP server,
the pod-resources client, per-container accounting (process -> cgroup -> container -> names,
from the CRI), the node's files, and the CDI spec's keeper (unless it was built before the
kubelet registration, when the plan starts with CDI).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpuagent.app import policy
from gpuagent.config import ConfigError, Settings
from gpuagent.gpu.monitor import GpuMonitor
from gpuagent.kubehealth import NodeHealthWanted, build_writer
from gpuagent.state.store import DeviceStore
from gpuagent.web.listener import Listener

if TYPE_CHECKING:  # imported off the loop before build_rest is called (see startup.py)
    from gpuagent.dra.side import DraSide
    from gpuagent.gpu import sim
    from gpuagent.kube.client import KubeApi
    from gpuagent.kube.nodehealth import NodeHealthWriter
    from gpuagent.kubelet.podresources import PodResourcesClient
    from gpuagent.nodefiles.cdikeeper import CdiSpecKeeper
    from gpuagent.nodefiles.labelkeeper import NodeFiles
    from gpuagent.runtime.accountant import Accountant
    from gpuagent.web.server import HttpServer, Probes
    from gpuagent.web.webconfig import WebConfigFile

__all__ = ["Rest", "build_dra_side", "build_rest", "cdi_keeper"]


@dataclass(frozen=True, slots=True)
class Rest:
    """The parts that run beside the kubelet's device plugin once the agent has started.

    ``monitor`` is the driver's (built as the agent starts, before the rest); ``pod_resources``
    exists with Kubernetes, ``accountant`` with container accounting, ``cdi`` when this agent
    keeps the node's CDI spec, ``node_health`` when it writes the node's GPU health to the API
    server (``node_health_api``: the connection it opened for that, closed at shutdown; none when
    it shares the DRA side's).
    """

    monitor: GpuMonitor
    http: HttpServer
    node_files: NodeFiles
    pod_resources: PodResourcesClient | None
    accountant: Accountant | None
    cdi: CdiSpecKeeper | None
    node_health: NodeHealthWriter | None = None
    node_health_api: KubeApi | None = None

    @property
    def gpu_count(self) -> int:
        """The node's GPUs as the driver counts them (described or not)."""
        return len(self.monitor.gpu_indexes)


def build_rest(
    store: DeviceStore,
    settings: Settings,
    *,
    node_name: str,
    monitor: GpuMonitor,
    probes: Probes,
    listener: Listener,
    web_config: WebConfigFile | None,
    simulator: sim.SimDriver | None,
    sysfs_root: Path,
    cdi: CdiSpecKeeper | None,
    dra: DraSide | None = None,
    node_health: NodeHealthWanted | str | None = None,
    node_health_options: Mapping[str, Any] | None = None,
) -> Rest:
    """The rest, built (nothing started); ``cdi``: the CDI spec's keeper, if this agent keeps the
    spec (built before the registration when the plan starts with CDI, else just now);
    ``node_health``: what of the node's GPU health to write (its writer shares ``dra``'s API
    connection when there is one)."""
    from gpuagent import __version__  # noqa: PLC0415
    from gpuagent.kubelet.podresources import PodResourcesClient  # noqa: PLC0415
    from gpuagent.runtime.accountant import Accountant  # noqa: PLC0415
    from gpuagent.runtime.cri import CriClient  # noqa: PLC0415
    from gpuagent.runtime.loglinks import LogLinks  # noqa: PLC0415
    from gpuagent.runtime.procfs import ProcReader  # noqa: PLC0415
    from gpuagent.web.metrics import MetricsRenderer  # noqa: PLC0415
    from gpuagent.web.server import HttpServer, build_app  # noqa: PLC0415

    renderer = MetricsRenderer(
        node_name,
        __version__,
        hostname_label=None if settings.no_hostname else settings.hostname_label,
        series_per_container=settings.dcgm_series_per_container,
        container_shares=settings.dcgm_container_shares,
        detailed=settings.detailed_agent_metrics,
        kubernetes=settings.kubernetes,
        accounting=settings.container_accounting,
    )
    app = build_app(store, renderer, probes, simulator, web_config=web_config)
    http = HttpServer(
        app, settings.metrics_host, settings.metrics_port, probes=probes, listener=listener
    )
    pod_resources = None
    if settings.kubernetes:
        pod_resources = PodResourcesClient(
            store, settings.pod_resources_socket, interval=settings.pod_resources_interval
        )
    accountant = None
    if settings.container_accounting:
        links = LogLinks(settings.container_logs_dir) if settings.kubernetes else None
        accountant = Accountant(
            store, ProcReader(settings.proc_root), CriClient(settings.cri_socket), links
        )
    writer = api = None
    if isinstance(node_health, NodeHealthWanted):
        built = build_writer(
            store,
            settings,
            node_health,
            node=node_name,
            api=dra.api if dra is not None else None,
            options=node_health_options,
        )
        if built is not None:
            writer, api = built
            api = api if dra is None else None
    return Rest(
        monitor=monitor,
        http=http,
        node_files=policy.node_files(
            store, settings, sysfs_root=sysfs_root, simulated=simulator is not None
        ),
        pod_resources=pod_resources,
        accountant=accountant,
        cdi=cdi,
        node_health=writer,
        node_health_api=api,
    )


def cdi_keeper(store: DeviceStore, settings: Settings) -> CdiSpecKeeper:
    """The keeper of the node's CDI spec (its module imported already)."""
    from gpuagent.nodefiles.cdikeeper import CdiSpecKeeper  # noqa: PLC0415

    return CdiSpecKeeper(store, policy.cdi_target(settings))


def build_dra_side(
    store: DeviceStore,
    settings: Settings,
    *,
    node: str,
    stopping: asyncio.Event,
    proc_root: Path,
    options: Mapping[str, Any],
) -> DraSide:
    """The DRA side, built with the agent (imported only when DRA is on: its API client costs
    memory); ``proc_root``: where the node's boot is read (the checkpoint's boot).
    Raises :class:`ConfigError` without usable credentials, naming the kubeconfig as given, or
    the setting that needs them."""
    from gpuagent.dra.side import DraSide, KubeConfigError  # noqa: PLC0415

    try:
        return DraSide(
            store,
            node=node,
            plugins_dir=settings.plugins_dir,
            registry_dir=settings.plugins_registry_dir,
            cdi_dir=settings.cdi_spec_dir,
            kubeconfig=settings.kubeconfig,
            stopping=stopping,
            node_spec=policy.dra_node_spec(settings),
            proc_root=proc_root,
            **options,
        )
    except KubeConfigError as exc:
        given = settings.kubeconfig is not None
        why = str(exc) if given else f"needs API server credentials: {exc}"
        raise ConfigError(settings.named("kubeconfig" if given else "dra_gpus"), why) from exc
