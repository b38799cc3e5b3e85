"""The agent, wired: settings → plan → store → driver → services.

Everything the agent serves is derived from the store: the snapshot (devices, health, pods,
registrations) and the plan it is served under (:mod:`gpuagent.config.planning`). This module
only builds the parts and runs them: what serves the kubelet first is built with the agent, the
driver's monitor as it starts, and the rest (:mod:`gpuagent.app.rest`) once the kubelet has its
device plugin (:mod:`gpuagent.app.startup`); they run as supervised tasks and stop within a
bounded shutdown (:mod:`gpuagent.app.supervisor`); reloads change the plan
(:mod:`gpuagent.app.reload`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpuagent.app import policy
from gpuagent.app.probes import AgentProbes
from gpuagent.app.reload import Reloads
from gpuagent.app.rest import Rest, build_dra_side, build_rest
from gpuagent.app.startup import Startup, listen
from gpuagent.app.supervisor import Supervisor
from gpuagent.app.tuning import collector_held
from gpuagent.config import ConfigError, Settings
from gpuagent.config.planning import check_on_the_host, load_web_config, make_plan
from gpuagent.domain.plan import Plan
from gpuagent.domain.readiness import freshness_limit
from gpuagent.domain.serving import ResourceView
from gpuagent.gpu.mig import MIG_MINORS_FILE
from gpuagent.gpu.monitor import GpuMonitor
from gpuagent.kubehealth import NodeHealthWanted, wanted
from gpuagent.kubelet.endpoints import PluginEndpoints
from gpuagent.kubelet.timing import Timing
from gpuagent.state.store import DeviceStore
from gpuagent.web.listener import Listener

if TYPE_CHECKING:
    from gpuagent.dra.side import DraSide
    from gpuagent.gpu import sim

__all__ = ["Agent"]


class Agent:
    """One agent: its store and plan, driver, kubelet endpoints, DRA side, node files and HTTP
    server.

    ``node_name`` overrides the settings' (``NODE_NAME``, else the host name); ``dra_options``
    and ``node_health_options`` go to the DRA side and the node-health writer (tests shorten
    their timings). ``settings_source`` reads the settings again for a reload (none: no reloads).
    ``own_process``: the process is the agent's alone (the command line), so start-up may set
    process-wide knobs (see :mod:`gpuagent.app.tuning`). A simulated node has its own ``/proc``
    and ``/sys``; ``sysfs_root``: the host's /sys (by default /sys, or a simulated node's).
    """

    def __init__(
        self,
        settings: Settings,
        *,
        plan: Plan | None = None,
        simulator: sim.SimDriver | None = None,
        sysfs_root: Path | None = None,
        node_name: str | None = None,
        registration_timing: Timing = Timing(),
        nvml_call_timeout: float = 10.0,
        settings_source: Callable[[], Settings] | None = None,
        config_poll_interval: float = 2.0,
        dra_options: Mapping[str, Any] | None = None,
        node_health_options: Mapping[str, Any] | None = None,
        own_process: bool = False,
    ) -> None:
        self.node_name = node_name or settings.node_name
        self.store = DeviceStore(plan=plan or make_plan(settings))
        check_on_the_host(settings, self.store.plan)  # exit 2 before anything runs
        self.web_config = load_web_config(settings)
        self.simulator = simulator
        self.view = ResourceView()
        self.stopping = asyncio.Event()  # set when shutting down: streams end with UNAVAILABLE
        self.started = asyncio.Event()
        self.supervisor = Supervisor()
        self.reloads = Reloads(
            self.store,
            settings,
            source=settings_source,
            poll_interval=config_poll_interval,
            web_config=self.web_config,
        )
        self.endpoints: PluginEndpoints | None = None
        if settings.kubernetes:
            self.endpoints = PluginEndpoints(
                self.store,
                self.view,
                self.stopping,
                socket_dir=settings.socket_dir,
                kubelet_socket=settings.kubelet_socket,
                timing=registration_timing,
            )
        self.dra, self._dra_unusable = self._dra_side(settings, dra_options or {})
        limit = freshness_limit(settings.poll_interval, nvml_call_timeout)
        self.probes = AgentProbes(
            self.store,
            self.supervisor.liveness,
            self.view,
            kubernetes=settings.kubernetes,
            freshness_limit=limit,
        )
        # What of the node's GPU health is written, or why nothing is (ConfigError: exit 2).
        self.node_health_wanted: NodeHealthWanted | str | None = wanted(settings)
        self._node_health_options = node_health_options
        self.listener = Listener(
            settings.metrics_host,
            settings.metrics_port,
            ssl_context=self.web_config.ssl_context if self.web_config is not None else None,
        )
        self._sysfs_root = policy.sysfs_root(sysfs_root, simulator)
        self._mig_minors = policy.proc_root(simulator) / MIG_MINORS_FILE
        self._nvml_call_timeout = nvml_call_timeout
        self._own_process = own_process
        self._rest: Rest | None = None  # once started

    @property
    def settings(self) -> Settings:
        """The running settings (a reload changes the live ones)."""
        return self.reloads.settings

    @property
    def rest(self) -> Rest:
        """What runs beside the kubelet's device plugin: there once the agent has started."""
        if self._rest is None:
            raise RuntimeError("the agent has not started")
        return self._rest

    # ----- probes ------------------------------------------------------------------------------
    def liveness(self) -> str | None:
        return self.probes.liveness()

    def readiness(self) -> str | None:
        return self.probes.readiness().reason

    def _dra_side(
        self, settings: Settings, options: Mapping[str, Any]
    ) -> tuple[DraSide | None, ConfigError | None]:
        """The DRA side, when DRA is on. Without credentials, when ``--dra-gpus`` names GPUs:
        none, and the error, to be said once the GPUs named are checked (each mistake is found
        whatever the other)."""
        if not self.store.plan.dra.gpus.enabled:
            return None, None
        try:
            side = build_dra_side(
                self.store, settings, node=self.node_name, stopping=self.stopping,
                proc_root=policy.proc_root(self.simulator),
                options=options,
            )  # fmt: skip
        except ConfigError as exc:
            if not self.store.plan.dra.gpus.refs:
                raise
            return None, exc
        return side, None

    # ----- lifecycle ---------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        """Run until ``stop`` is set, then shut down.

        Raises :class:`~gpuagent.app.supervisor.FatalError` when the agent cannot go on, and
        :class:`ConfigError` when a setting keeps it from starting (the metrics address cannot be
        bound: said before anything starts, so before any line of a shutdown).
        """
        settings = self.settings
        await listen(self.listener, settings)
        if self.simulator is not None:
            from gpuagent.gpu import sim  # noqa: PLC0415

            sim.install(self.simulator)
        startup, monitor = self._startup(settings)
        try:
            with collector_held(own_process=self._own_process) as started:
                self._rest = rest = await startup.start()
                if self.reloads.enabled:
                    self.supervisor.spawn("config-reload", self.reloads.run(rest))
                started()
                self.started.set()
                await self.supervisor.supervise(stop)
        finally:
            await self.supervisor.shut_down(
                stopping=self.stopping,
                endpoints=self.endpoints,
                http=self._rest.http if self._rest is not None else None,
                node_health_api=self._rest.node_health_api if self._rest is not None else None,
                listener=self.listener,
                dra=self.dra,
                monitor=monitor,
                simulator=self.simulator,
            )

    def _startup(self, settings: Settings) -> tuple[Startup, GpuMonitor]:
        """The start of the agent on the driver's backend, and the backend's poller."""
        nvml = policy.driver(settings, self.store, self.dra, self._sysfs_root, self._mig_minors)
        monitor = GpuMonitor(
            self.store, nvml, poll_interval=settings.poll_interval,
            call_timeout=self._nvml_call_timeout, nvml_timeout=settings.nvml_timeout,
        )  # fmt: skip
        startup = Startup(
            self.store,
            settings,
            self.supervisor,
            monitor,
            endpoints=self.endpoints,
            dra=self.dra,
            mps=lambda: policy.keep_mps_daemons(settings, self.store, self.view, nvml),
            dra_unusable=self._dra_unusable,
            stopping=self.stopping,
            keeps_cdi_spec=policy.keeps_cdi_spec(settings, simulated=self.simulator is not None),
            node_health=self.node_health_wanted,
            own_process=self._own_process,
            build_rest=lambda cdi: build_rest(
                self.store,
                settings,
                node_name=self.node_name,
                monitor=monitor,
                probes=self.probes,
                listener=self.listener,
                web_config=self.web_config,
                simulator=self.simulator,
                sysfs_root=self._sysfs_root,
                cdi=cdi,
                dra=self.dra,
                node_health=self.node_health_wanted,
                node_health_options=self._node_health_options,
            ),
        )
        return startup, monitor

    # ----- reload ------------------------------------------------------------------------------
    def request_reload(self) -> None:
        """Re-read flags, environment and config file soon (SIGHUP)."""
        self.reloads.request()

    async def reload(self) -> list[str] | None:
        """Re-read the settings and apply them (see :meth:`Reloads.reload`)."""
        return await self.reloads.reload(self.rest)
