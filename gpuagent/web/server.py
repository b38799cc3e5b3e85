"""The aiohttp application: /metrics, /healthz, /readyz, a landing page, /sim/* in simulation."""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable
from typing import Protocol

import structlog
from aiohttp import web

from gpuagent.domain.store import DeviceStore
from gpuagent.web.exposition import CONTENT_TYPE
from gpuagent.web.metrics import AgentCounters, MetricsRenderer

log = structlog.get_logger("gpuagent.http")

MAX_BODY = 64 * 1024


class SimulatorControl(Protocol):
    """Fault injection into the simulated driver (only present under --simulate/--sim-config)."""

    def describe(self) -> list[dict[str, object]]: ...

    def inject(
        self,
        gpu: int,
        fault: str,
        xid: int | None = None,
        *,
        seconds: object = None,
        symbol: object = None,
    ) -> dict[str, object]: ...


class Probes(Protocol):
    """Liveness and readiness as the composition root sees them: ``None`` means OK, else why not."""

    def liveness(self) -> str | None: ...

    def readiness(self) -> str | None: ...


def build_app(
    store: DeviceStore,
    renderer: MetricsRenderer,
    counters: Callable[[], AgentCounters],
    probes: Probes,
    simulator: SimulatorControl | None = None,
) -> web.Application:
    """The HTTP surface, reading only from ``store`` and the injected callables."""
    app = web.Application(client_max_size=MAX_BODY)

    async def metrics(request: web.Request) -> web.Response:
        body = renderer.render(store.snapshot, counters()).encode()
        headers = {"Content-Type": CONTENT_TYPE}
        if "gzip" in request.headers.get("Accept-Encoding", ""):
            body = gzip.compress(body, compresslevel=1)
            headers["Content-Encoding"] = "gzip"
        return web.Response(body=body, headers=headers)

    async def healthz(request: web.Request) -> web.Response:
        problem = probes.liveness()
        if problem is None:
            return web.Response(text="ok\n")
        return web.Response(status=503, text=f"{problem}\n")

    async def readyz(request: web.Request) -> web.Response:
        problem = probes.readiness()
        if problem is None:
            return web.Response(text="ready\n")
        return web.Response(status=503, text=f"{problem}\n")

    async def index(request: web.Request) -> web.Response:
        links = "".join(f'<li><a href="{p}">{p}</a></li>' for p in ("metrics", "healthz", "readyz"))
        return web.Response(
            text=f"<html><head><title>gpuagent</title></head><body><h1>gpuagent</h1>"
            f"<ul>{links}</ul></body></html>",
            content_type="text/html",
        )

    app.router.add_get("/", index)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    if simulator is not None:
        _add_simulation_routes(app, simulator)
    return app


def _add_simulation_routes(app: web.Application, simulator: SimulatorControl) -> None:
    async def gpus(request: web.Request) -> web.Response:
        return web.json_response(simulator.describe())

    async def faults(request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(400, "body must be a JSON object")
        if not isinstance(body, dict):
            return _error(400, "body must be a JSON object")
        gpu, fault, xid = body.get("gpu"), body.get("fault"), body.get("xid")
        if not isinstance(gpu, int) or isinstance(gpu, bool):
            return _error(400, "'gpu' must be an integer GPU index")
        if not isinstance(fault, str):
            return _error(400, "'fault' must be a string naming the fault")
        unknown = set(body) - {"gpu", "fault", "xid", "seconds", "symbol"}
        if unknown:
            return _error(400, f"unknown keys: {', '.join(sorted(map(str, unknown)))}")
        if xid is not None and (not isinstance(xid, int) or isinstance(xid, bool)):
            return _error(400, "'xid' must be an integer")
        try:
            state = simulator.inject(
                gpu, fault, xid, seconds=body.get("seconds"), symbol=body.get("symbol")
            )
        except LookupError:
            return _error(404, f"no simulated GPU with index {gpu}")
        except ValueError as exc:
            return _error(400, str(exc))
        log.info("fault injected", gpu=gpu, fault=fault, xid=xid)
        return web.json_response(state)

    app.router.add_get("/sim/gpus", gpus)
    app.router.add_post("/sim/faults", faults)


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


class HttpServer:
    """Runs an application on a TCP address; ``port`` is the bound port (useful with port 0)."""

    def __init__(self, app: web.Application, host: str, port: int) -> None:
        self._runner = web.AppRunner(
            app, handle_signals=False, shutdown_timeout=1.0, access_log=None
        )
        self._host = host or None
        self._port = port
        self.port = port

    async def start(self) -> None:
        await self._runner.setup()
        site = web.TCPSite(self._runner, self._host, self._port)
        await site.start()
        addresses = self._runner.addresses
        if addresses:
            self.port = int(addresses[0][1])
        log.info("http listening", host=self._host or "*", port=self.port)

    async def close(self) -> None:
        await self._runner.cleanup()
