"""The agent, wired: settings → plan → store → its parts, in order.

Everything the agent serves is derived from the store: the snapshot (devices, health, pods,
registrations) and the plan it is served under (:mod:`gpuagent.config.planning`). The agent is
an ordered list of parts (:data:`PARTS`, each of the shape :class:`~gpuagent.app.part.Part`):
each is built with the agent, what serves the kubelet starts at once, the rest once the kubelet
has its device plugin; their tasks run supervised, and they close in reverse order within a
bounded shutdown (:mod:`gpuagent.app.supervisor`); reloads change the plan
(:mod:`gpuagent.app.reload`). Adding a part is adding its module to :mod:`gpuagent.app.parts`
and its entry here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from gpuagent.app import policy
from gpuagent.app.part import Context, Knobs, Part, Parts, Stage
from gpuagent.app.parts import (
    accounting,
    cdi,
    configreload,
    dra,
    driver,
    http,
    kubelet,
    mps,
    nodefiles,
    nodehealth,
    podresources,
)
from gpuagent.app.probes import AgentProbes
from gpuagent.app.supervisor import Supervisor
from gpuagent.app.tuning import collector_held
from gpuagent.config import Settings
from gpuagent.config.planning import check_on_the_host, load_web_config, make_plan
from gpuagent.domain.plan import Plan
from gpuagent.domain.readiness import freshness_limit
from gpuagent.domain.serving import ResourceView
from gpuagent.kubelet.timing import Timing
from gpuagent.state.store import DeviceStore
from gpuagent.web.listener import Listener

if TYPE_CHECKING:
    from gpuagent.gpu import sim

__all__ = ["PARTS", "Agent"]

P = TypeVar("P", bound=Part)

#: The agent's parts in their order: built in it, started in it (what serves the kubelet first,
#: then the rest), closed in its reverse. Each builds its part, or ``None`` where the node has
#: none (a setting turns it off).
PARTS: tuple[Callable[[Context], Part | None], ...] = (
    driver.build,  # NVML, started first and released last
    dra.check_gpus,  # the GPUs --dra-gpus names, once the driver lists them
    cdi.build,  # the CDI spec: before the registration when the plan starts with CDI
    kubelet.build,  # the device plugin's endpoints, registered with the kubelet
    mps.build,  # the MPS control daemons, once the plan shares through MPS
    podresources.build,  # which pods hold which devices
    accounting.build,  # per-container GPU accounting
    nodefiles.build,  # node-feature-discovery's feature file
    dra.build,  # the DRA kubelet plugin and the ResourceSlices
    nodehealth.build,  # the node condition, events and taint
    http.build,  # /metrics and the probes, on the address bound first
    configreload.build,  # SIGHUP and config file changes
)

# How long the rest waits for GPU discovery and the kubelet's first answer before it starts anyway:
# a slow driver, or a kubelet that holds Register open, must not keep /metrics and the probes down.
REGISTER_FIRST_SECONDS = 2.0


class Agent:
    """One agent: its store and plan, and its parts.

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
        config_check_interval: float = 2.0,
        dra_options: Mapping[str, Any] | None = None,
        node_health_options: Mapping[str, Any] | None = None,
        own_process: bool = False,
    ) -> None:
        knobs = Knobs(
            registration_timing=registration_timing,
            nvml_call_timeout=nvml_call_timeout,
            config_check_interval=config_check_interval,
            settings_source=settings_source,
            dra_options=dra_options or {},
            node_health_options=node_health_options or {},
        )
        self.store = DeviceStore(plan=plan or make_plan(settings))
        check_on_the_host(settings, self.store.plan)  # exit 2 before anything runs
        self.simulator = simulator
        self.started = asyncio.Event()
        self.supervisor = Supervisor()
        self.context = self._context(settings, knobs, sysfs_root, node_name, own_process)
        self.parts = self.context.parts
        for build in PARTS:  # (a ConfigError here: exit 2 before anything starts)
            part = build(self.context)
            if part is not None:
                self.parts.add(part)
        self.reloads = self.parts.get(configreload.ConfigReload).reloads

    def _context(
        self,
        settings: Settings,
        knobs: Knobs,
        sysfs_root: Path | None,
        node_name: str | None,
        own_process: bool,
    ) -> Context:
        web_config = load_web_config(settings)
        view = ResourceView()
        probes = AgentProbes(
            self.store,
            self.supervisor.liveness,
            view,
            kubernetes=settings.kubernetes,
            freshness_limit=freshness_limit(settings.poll_interval, knobs.nvml_call_timeout),
        )
        tls = web_config.ssl_context if web_config is not None else None
        return Context(
            settings=settings,
            store=self.store,
            node_name=node_name or settings.node_name,
            stopping=asyncio.Event(),  # set when shutting down: streams end with UNAVAILABLE
            view=view,
            simulator=self.simulator,
            sysfs_root=policy.sysfs_root(sysfs_root, self.simulator),
            proc_root=policy.proc_root(self.simulator),
            web_config=web_config,
            listener=Listener(settings.metrics_host, settings.metrics_port, ssl_context=tls),
            probes=probes,
            own_process=own_process,
            knobs=knobs,
            parts=Parts(own_process=own_process),
        )

    @property
    def settings(self) -> Settings:
        """The running settings (a reload changes the live ones)."""
        return self.reloads.settings

    def part(self, kind: type[P]) -> P:
        """The agent's part of this kind (a :class:`LookupError` when it has none)."""
        return self.parts.get(kind)

    # ----- probes ------------------------------------------------------------------------------
    @property
    def probes(self) -> AgentProbes:
        return self.context.probes

    def liveness(self) -> str | None:
        return self.probes.liveness()

    def readiness(self) -> str | None:
        return self.probes.readiness().reason

    # ----- lifecycle ---------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        """Run until ``stop`` is set, then shut down.

        Raises :class:`~gpuagent.app.supervisor.FatalError` when the agent cannot go on, and
        :class:`ConfigError` when a setting keeps it from starting (the metrics address cannot be
        bound: said before anything starts, so before any line of a shutdown).
        """
        context, parts, supervisor = self.context, self.parts, self.supervisor
        await http.listen(context.listener, context.settings)
        try:
            with collector_held(own_process=context.own_process) as started:
                await parts.start(Stage.KUBELET, supervisor.spawn)
                await parts.settle(Stage.KUBELET, REGISTER_FIRST_SECONDS)
                await parts.start(Stage.REST, supervisor.spawn)
                started()
                self.started.set()
                await supervisor.supervise(stop)
        finally:
            await supervisor.shut_down(list(parts), context.stopping)

    # ----- reload ------------------------------------------------------------------------------
    def request_reload(self) -> None:
        """Re-read flags, environment and config file soon (SIGHUP)."""
        self.reloads.request()

    async def reload(self) -> list[str] | None:
        """Re-read the settings and apply them (see :meth:`Reloads.reload`)."""
        return await self.reloads.reload(self.parts.get(configreload.ConfigReload).node)
