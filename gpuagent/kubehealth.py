"""The node's GPU health where Kubernetes looks, assembled: which of the condition, events and
taint are on (from the settings and whether the agent has API credentials), and the writer task.

``--node-condition`` and ``--events`` are on by default where the agent has credentials (a
service-account token in a pod, or ``--kubeconfig``): without them both are quietly off (one info
line). Asked for explicitly without credentials, the agent does not start (exit 2, naming the
key). ``--kubernetes=false`` turns both off (the settings say so already).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog

from gpuagent.config import ConfigError, Settings
from gpuagent.kube.credentials import missing
from gpuagent.state.store import DeviceStore

if TYPE_CHECKING:  # the client is imported only where it is used (off the loop, at start)
    from gpuagent.kube.client import KubeApi
    from gpuagent.kube.nodehealth import NodeHealthWriter

__all__ = ["WRITER_MODULE", "NodeHealthWanted", "build_writer", "say_off", "wanted"]

log = structlog.get_logger("gpuagent.kube")

#: The writer's module, for the agent to import off the loop before :func:`build_writer`.
WRITER_MODULE = "gpuagent.kube.nodehealth"


@dataclass(frozen=True, slots=True)
class NodeHealthWanted:
    """What of the node's health is written."""

    condition: bool
    events: bool
    taint: bool
    heartbeat: float


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


def say_off(reason: str) -> None:
    """The one line that says the condition and events are off for want of credentials."""
    log.info("node condition and events off: no API server credentials", reason=reason)


def build_writer(
    store: DeviceStore,
    settings: Settings,
    parts: NodeHealthWanted,
    *,
    node: str,
    api: KubeApi | None = None,
    options: Mapping[str, Any] | None = None,
) -> tuple[NodeHealthWriter, KubeApi] | None:
    """The writer and the API connection it uses (``api``: one the agent has already, else a new
    one); ``None``, with a warning, when the credentials cannot be loaded."""
    from gpuagent.kube.client import KubeApi, KubeConfigError, load_config  # noqa: PLC0415
    from gpuagent.kube.nodehealth import NodeHealthWriter  # noqa: PLC0415

    extra = dict(options or {})
    timeout = float(extra.pop("api_timeout", 10.0))
    if api is None:
        try:
            api = KubeApi(load_config(settings.kubeconfig), timeout=timeout)
        except KubeConfigError as exc:
            log.warning("node condition and events off: credentials unusable", error=str(exc))
            return None
    writer = NodeHealthWriter(
        store,
        api,
        node=node,
        condition=parts.condition,
        events=parts.events,
        taint=parts.taint,
        heartbeat=parts.heartbeat,
        **extra,
    )
    return writer, api
