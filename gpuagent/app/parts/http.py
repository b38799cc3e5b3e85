"""The HTTP server: /metrics, the probes, /sim/* in simulation (:mod:`gpuagent.web.server`).

Its address is bound before anything else starts (:func:`listen`: an address that cannot be had
is a configuration error, said before any line of a shutdown), and served once the kubelet has
its device plugin, with aiohttp and the metrics renderer imported off the loop; until then a
client is refused, as by an agent that is still starting.
"""

from __future__ import annotations

import os
import socket
from typing import TYPE_CHECKING

from gpuagent.app.part import Context, Part, bounded
from gpuagent.config import ConfigError, Settings
from gpuagent.config.planning import unresolved
from gpuagent.web.listener import Listener

if TYPE_CHECKING:  # imported off the loop before the part starts
    from gpuagent.web.server import HttpServer

__all__ = ["Http", "build", "listen"]


class Http(Part):
    """The HTTP server (``server``, once started) on the agent's bound address."""

    name = "http"
    imports = ("gpuagent.web.server", "gpuagent.web.metrics")

    def __init__(self, context: Context) -> None:
        self._context = context
        self.server: HttpServer | None = None

    @property
    def port(self) -> int:
        """The port bound (useful with port 0)."""
        return self._context.listener.port

    async def start(self) -> None:
        from gpuagent import __version__  # noqa: PLC0415
        from gpuagent.web.metrics import MetricsRenderer  # noqa: PLC0415
        from gpuagent.web.server import HttpServer, build_app  # noqa: PLC0415

        context, settings = self._context, self._context.settings
        renderer = MetricsRenderer(
            context.node_name,
            __version__,
            hostname_label=None if settings.no_hostname else settings.hostname_label,
            series_per_container=settings.dcgm_series_per_container,
            container_shares=settings.dcgm_container_shares,
            detailed=settings.detailed_agent_metrics,
            kubernetes=settings.kubernetes,
            accounting=settings.container_accounting,
        )
        app = build_app(
            context.store, renderer, context.probes, context.simulator,
            web_config=context.web_config,
        )  # fmt: skip
        self.server = HttpServer(
            app,
            settings.metrics_host,
            settings.metrics_port,
            probes=context.probes,
            listener=context.listener,
            web_config=context.web_config,
        )
        await self.server.start()

    async def close(self, seconds: float) -> None:
        """The server closed, or the address it never served."""
        if self.server is None:
            self._context.listener.close()
            return
        await bounded(seconds, self.server.close(), late="http server did not close in time")


def build(context: Context) -> Http:
    return Http(context)


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
