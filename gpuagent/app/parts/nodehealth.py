"""The node's GPU health where Kubernetes looks: which of the condition, events and taint are on
(from the settings and whether the agent has API credentials), and the writer
(:mod:`gpuagent.kube.nodehealth`), in one part.

``--node-condition`` and ``--events`` are on by default where the agent has credentials (a
service-account token in a pod, or ``--kubeconfig``): without them both are quietly off (one info
line, once the rest starts). Asked for explicitly without credentials, the agent does not start
(exit 2, naming the key). ``--kubernetes=false`` turns both off (the settings say so already).
The writer shares the DRA side's API connection when DRA is on; else it opens its own, closed at
shutdown.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog

from gpuagent.app.part import Context, Part, Task, bounded
from gpuagent.app.parts.dra import Dra
from gpuagent.config import ConfigError, Settings
from gpuagent.kube.credentials import missing

if TYPE_CHECKING:  # the client is imported only where it is used (off the loop, at start)
    from gpuagent.kube.client import KubeApi
    from gpuagent.kube.nodehealth import NodeHealthWriter

__all__ = ["NodeHealth", "NodeHealthWanted", "build", "wanted"]

log = structlog.get_logger("gpuagent.kube")

#: The writer's module, imported off the loop before the part starts.
WRITER_MODULE = "gpuagent.kube.nodehealth"


@dataclass(frozen=True, slots=True)
class NodeHealthWanted:
    """What of the node's health is written."""

    condition: bool
    events: bool
    taint: bool
    heartbeat: float


class NodeHealth(Part):
    """The node-health writer (``writer``, once started), or the line that says why not."""

    name = "node-health"

    def __init__(self, context: Context, wanted: NodeHealthWanted | str) -> None:
        self._context = context
        self.wanted = wanted
        self.imports = (WRITER_MODULE,) if isinstance(wanted, NodeHealthWanted) else ()
        self.writer: NodeHealthWriter | None = None
        self._own_api: KubeApi | None = None  # the connection it opened (none: DRA's, shared)

    async def start(self) -> None:
        if not isinstance(self.wanted, NodeHealthWanted):
            log.info("node condition and events off: no API server credentials", reason=self.wanted)
            return
        dra = self._context.parts.find(Dra)
        shared = dra.side.api if dra is not None and dra.side is not None else None
        api = shared if shared is not None else self._api()
        if api is None:
            return
        self._own_api = None if shared is not None else api
        self.writer = _writer(self._context, api, self.wanted)

    def tasks(self) -> Mapping[str, Task]:
        return {"node-health": self.writer.run} if self.writer is not None else {}

    async def close(self, seconds: float) -> None:
        if self._own_api is not None:
            await bounded(seconds, self._own_api.close())

    def _api(self) -> KubeApi | None:
        """A connection of its own; ``None``, with a warning, when the credentials cannot be
        loaded."""
        from gpuagent.kube.client import KubeApi, KubeConfigError, load_config  # noqa: PLC0415

        timeout = float(self._context.knobs.node_health_options.get("api_timeout", 10.0))
        try:
            return KubeApi(load_config(self._context.settings.kubeconfig), timeout=timeout)
        except KubeConfigError as exc:
            log.warning("node condition and events off: credentials unusable", error=str(exc))
            return None


def _writer(context: Context, api: KubeApi, parts: NodeHealthWanted) -> NodeHealthWriter:
    from gpuagent.kube.nodehealth import NodeHealthWriter  # noqa: PLC0415

    options: dict[str, Any] = dict(context.knobs.node_health_options)
    options.pop("api_timeout", None)
    return NodeHealthWriter(
        context.store,
        api,
        node=context.node_name,
        condition=parts.condition,
        events=parts.events,
        taint=parts.taint,
        heartbeat=parts.heartbeat,
        **options,
    )


def wanted(settings: Settings) -> NodeHealthWanted | str | None:
    """What to write; or why nothing is (no credentials: a line for the log once the agent
    runs); ``None`` when everything is off by setting. Raises :class:`ConfigError` for a part
    asked for explicitly without credentials."""
    asked = {
        "node_condition": settings.node_condition,
        "events": settings.events,
        "taint_unhealthy_node": settings.taint_unhealthy_node,
    }
    if not any(value is not False for value in asked.values()):
        return None
    why = missing(settings.kubeconfig, named=settings.named("kubeconfig"))
    if why is not None:
        explicit = [key for key, value in asked.items() if value is True]
        if explicit:
            raise ConfigError(settings.named(explicit[0]), f"needs API server credentials: {why}")
        return why
    result = NodeHealthWanted(
        condition=settings.node_condition is not False,
        events=settings.events is not False,
        taint=settings.taint_unhealthy_node,
        heartbeat=settings.node_condition_heartbeat,
    )
    return result if (result.condition or result.events or result.taint) else None


def build(context: Context) -> NodeHealth | None:
    """The part, unless everything is off by setting (a :class:`ConfigError` for a part asked
    for explicitly without credentials)."""
    what = wanted(context.settings)
    return None if what is None else NodeHealth(context, what)
