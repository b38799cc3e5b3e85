"""The aiohttp application: /metrics, /health, /healthz, /readyz, a landing page, /sim/* in
simulation.

Limits against slow or hostile clients (see :class:`HttpLimits`, documented in docs/metrics.md):
request line and header sizes and count, request bodies, idle and header-read time (aiohttp's
keep-alive timer runs from the moment a connection opens), TLS handshake time, concurrent
connections, concurrent /metrics responses, and the time to write one. /metrics bodies are written
in 64 KiB pieces that wait for the socket to drain, so a client that reads slowly holds at most
about one piece in memory; the body itself is shared by every scrape of a snapshot version.

A reload of the web config that changes who may be served (client CAs, ``client_auth_type``, TLS
versions) closes the connections opened before it (:meth:`HttpServer.retire`): none of them is
served on the identity it was verified with then.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import structlog
from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from gpuagent.domain.readiness import Readiness
from gpuagent.state.store import DeviceStore
from gpuagent.web.basicauth import AuthResult
from gpuagent.web.connections import FirstBytes, ProbesOnly, evict_quietest
from gpuagent.web.exposition import CONTENT_TYPE
from gpuagent.web.listener import Listener
from gpuagent.web.metrics import SLICE_S, MetricsRenderer
from gpuagent.web.simulation import SimulatorControl, add_simulation_routes
from gpuagent.web.webconfig import WebConfigFile

log = structlog.get_logger("gpuagent.http")

MAX_BODY = 64 * 1024
# Paths the kubelet probes: its HTTP probes cannot send credentials, so auth never applies.
UNAUTHENTICATED = frozenset({"/health", "/healthz", "/readyz"})


@dataclass(frozen=True, slots=True)
class HttpLimits:
    """What one client, or many, may cost the HTTP server."""

    max_connections: int = 256
    max_concurrent_scrapes: int = 32
    keepalive_timeout: float = 60.0
    first_bytes_timeout: float = 5.0  # a new connection sends nothing for this long: closed
    evict_quiet_after: float = 5.0  # at the limit, a connection this quiet makes room
    overflow_timeout: float = 2.0  # a connection over the limit: its probe request
    write_timeout: float = 30.0
    tls_handshake_timeout: float = 10.0
    max_line_size: int = 8190
    max_field_size: int = 8190
    max_headers: int = 64
    chunk: int = 64 * 1024


class Probes(Protocol):
    """Liveness and the readings' freshness as the composition root sees them (``None`` means
    OK, else why not), and readiness with the note said beside it
    (:func:`gpuagent.domain.readiness.readiness`)."""

    def liveness(self) -> str | None: ...

    def readiness(self) -> Readiness: ...

    def freshness(self) -> str | None: ...


def build_app(
    store: DeviceStore,
    renderer: MetricsRenderer,
    probes: Probes,
    simulator: SimulatorControl | None = None,
    *,
    web_config: WebConfigFile | None = None,
    limits: HttpLimits = HttpLimits(),
) -> web.Application:
    """The HTTP surface, reading only from ``store`` (snapshot, plan, counters) and ``probes``."""
    app = web.Application(
        client_max_size=MAX_BODY, middlewares=[_retired, _auth_middleware(web_config)]
    )
    scrapes = _Scrapes(store, renderer, limits)

    async def add_headers(request: web.Request, response: web.StreamResponse) -> None:
        response.headers["X-Content-Type-Options"] = "nosniff"
        if web_config is not None:
            response.headers.update(web_config.config.headers)

    app.on_response_prepare.append(add_headers)

    async def healthz(request: web.Request) -> web.Response:
        problem = probes.liveness()
        if problem is None:
            return web.Response(text="ok\n")
        return web.Response(status=503, text=f"{problem}\n")

    async def readyz(request: web.Request) -> web.Response:
        answer = probes.readiness()
        return web.Response(status=200 if answer.reason is None else 503, text=answer.text)

    async def health(request: web.Request) -> web.Response:
        # dcgm-exporter's answer: "OK" (200) while readings are current; "KO" (503), with why.
        problem = probes.freshness()
        if problem is None:
            return web.Response(text="OK")
        return web.Response(status=503, text=f"KO: {problem}\n")

    async def index(request: web.Request) -> web.Response:
        paths = ("metrics", "health", "healthz", "readyz")
        links = "".join(f'<li><a href="{p}">{p}</a></li>' for p in paths)
        return web.Response(
            text=f"<html><head><title>gpuagent</title></head><body><h1>gpuagent</h1>"
            f"<ul>{links}</ul></body></html>",
            content_type="text/html",
        )

    app.router.add_get("/", index)
    app.router.add_get("/metrics", scrapes.handle)
    app.router.add_get("/health", health)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    if simulator is not None:
        add_simulation_routes(app, simulator)
    return app


@web.middleware
async def _retired(request: web.Request, handler: Handler) -> web.StreamResponse:
    """A request on a retired connection (accepted before a change of who may be served, see
    :meth:`HttpServer.retire`) is not answered: the connection is closed, and the client asks
    again on a new one, verified under what is served now."""
    transport = request.transport
    connection = transport.get_protocol() if transport is not None else None
    if isinstance(connection, FirstBytes) and connection.retired:
        request.protocol.force_close()
        return web.Response(status=503)  # never written: the connection is closed
    return await handler(request)


def _auth_middleware(web_config: WebConfigFile | None) -> Middleware:
    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        if (
            web_config is not None
            and web_config.auth.enabled
            and request.path not in UNAUTHENTICATED
        ):
            result = await web_config.auth.check(request.headers.get("Authorization"))
            if result == AuthResult.BUSY:
                return web.Response(status=429, text="too many authentication attempts\n")
            if result != AuthResult.OK:
                return web.Response(
                    status=401,
                    text="unauthorized\n",
                    headers={"WWW-Authenticate": 'Basic realm="gpuagent"'},
                )
        return await handler(request)

    return auth


class _Scrapes:
    """/metrics: the cached device part plus a fresh agent part, written with back-pressure."""

    def __init__(self, store: DeviceStore, renderer: MetricsRenderer, limits: HttpLimits) -> None:
        self._store = store
        self._renderer = renderer
        self._limits = limits
        self._in_flight = 0

    async def handle(self, request: web.Request) -> web.StreamResponse:
        started = time.perf_counter()
        if self._in_flight >= self._limits.max_concurrent_scrapes:
            return web.Response(status=503, text="too many concurrent scrapes\n")
        self._in_flight += 1
        try:
            return await self._respond(request)
        finally:
            self._in_flight -= 1
            self._renderer.scrapes.observe(time.perf_counter() - started)

    async def _respond(self, request: web.Request) -> web.StreamResponse:
        snapshot = self._store.snapshot
        served = snapshot.plan.served_resources
        gzipped = _accepts_gzip(request.headers.get("Accept-Encoding", ""))
        # A new version is rendered (and compressed) a family at a time, the loop handed back
        # between them: a scrape never holds it for long, whatever the node's size.
        part = await self._renderer.devices_async(snapshot, served)
        if gzipped:
            await part.deflate(SLICE_S)
        tail = self._renderer.agent(snapshot, self._store.counters.read(), served)
        headers = {"Content-Type": CONTENT_TYPE, "Vary": "Accept-Encoding"}
        if gzipped:
            chunks = part.gzip(tail)
            headers["Content-Encoding"] = "gzip"
        else:
            chunks = [*part.chunks, tail]
        response = web.StreamResponse(headers=headers)
        response.content_length = sum(len(c) for c in chunks)
        await response.prepare(request)
        if request.method != "HEAD":
            try:
                async with asyncio.timeout(self._limits.write_timeout):
                    for chunk in chunks:
                        view = memoryview(chunk)
                        for i in range(0, len(view), self._limits.chunk):
                            await response.write(view[i : i + self._limits.chunk])
            except TimeoutError:
                log.warning("scrape client too slow; connection dropped")
                if request.transport is not None:
                    request.transport.abort()
                return response
        await response.write_eof()
        return response


def _accepts_gzip(accept_encoding: str) -> bool:
    for item in accept_encoding.split(","):
        coding, _, params = item.partition(";")
        if coding.strip().lower() != "gzip":
            continue
        q = params.strip()
        if q.startswith("q="):
            try:
                return float(q[2:]) > 0
            except ValueError:
                return False
        return True
    return False


class HttpServer:
    """Runs an application on a TCP address; ``port`` is the bound port (useful with port 0).

    ``listener``: the address already bound (:class:`~gpuagent.web.listener.Listener`); by
    default :meth:`start` binds ``host`` and ``port``. ``web_config``: the web config served,
    whose changes of who may be served retire the connections accepted before them.
    """

    def __init__(
        self,
        app: web.Application,
        host: str,
        port: int,
        *,
        ssl_context: ssl.SSLContext | None = None,
        limits: HttpLimits = HttpLimits(),
        probes: Probes | None = None,
        listener: Listener | None = None,
        web_config: WebConfigFile | None = None,
    ) -> None:
        self._runner = web.AppRunner(
            app,
            handle_signals=False,
            shutdown_timeout=1.0,
            access_log=None,
            keepalive_timeout=limits.keepalive_timeout,
            max_line_size=limits.max_line_size,
            max_field_size=limits.max_field_size,
            max_headers=limits.max_headers,
        )
        self._listener = listener or Listener(
            host, port, ssl_context=ssl_context,
            tls_handshake_timeout=limits.tls_handshake_timeout,
        )  # fmt: skip
        self._limits = limits
        self._probes: dict[str, Callable[[], str | None]] = {}
        if probes is not None:
            ready = probes.readiness
            self._probes = {
                "/health": probes.freshness,
                "/healthz": probes.liveness,
                "/readyz": lambda: ready().reason,
            }
        self._started = False
        self._live: set[FirstBytes] = set()  # made (past their TLS handshake), not yet lost
        self._web_config = web_config
        self._trust_changes = 0  # since the start (each connection knows the count it met)
        self._draining: set[asyncio.Task[None]] = set()
        self.port = self._listener.port
        self.refused = 0
        self.evicted = 0
        self.accepted = 0  # handed to the HTTP protocol (their TLS handshakes not yet done)

    @property
    def connections(self) -> int:
        """The connections open now, past their TLS handshake (over-limit ones aside)."""
        return len(self._live)

    async def start(self) -> None:
        await self._runner.setup()
        self._started = True
        handler_factory = self._runner.server
        assert handler_factory is not None

        limits = self._limits

        live = self._live

        def protocol() -> asyncio.Protocol:
            full = len(handler_factory.connections) >= limits.max_connections
            if full and not evict_quietest(live, limits.evict_quiet_after):
                # Over the limit, nobody idle: probes are still answered (the kubelet must
                # never see a healthy agent as dead because others hold connections); the rest
                # get 503.
                self.refused += 1
                return ProbesOnly(self._probes, limits.overflow_timeout)
            if full:
                self.evicted += 1
            self.accepted += 1
            connection = FirstBytes(
                handler_factory(), limits.first_bytes_timeout, accepted_in=self._trust_changes
            )
            # Counted once made: a connection whose TLS handshake fails is never lost either.
            connection.on_made = self._made
            connection.on_lost = live.discard
            return connection

        if self._web_config is not None:
            self._web_config.trust_changed.append(self.retire)
        await self._listener.serve(protocol)
        self.port = self._listener.port
        log.info(
            "http listening",
            host=self._listener.host or "*",
            port=self.port,
            tls=self._listener.tls,
        )

    def _made(self, connection: FirstBytes) -> None:
        # Accepted before a change of trust, handshaken after: OpenSSL took the verify mode and
        # versions from the listening context when it was accepted, the CAs at its ClientHello.
        # Whatever it was verified under, it is retired: it is closed before any request.
        if connection.accepted_in != self._trust_changes:
            connection.retired = True
        self._live.add(connection)

    def retire(self) -> None:
        """Retire every connection open now (a reload changed who may be served: the client
        CAs, ``client_auth_type`` or the TLS versions): none of them gets an answer to a request
        not yet under way; each is closed at once if idle, else once its response is written.
        One accepted but still in its TLS handshake is closed once that ends. The clients
        connect again, and their new handshakes are verified under the new config."""
        self._trust_changes += 1
        retired = [c for c in self._live if not c.retired]
        for connection in retired:
            connection.retire()
        if not retired:
            return
        log.info("closing the connections opened before a change of TLS trust", count=len(retired))
        task = asyncio.create_task(self._drain(retired), name="http-retired-connections")
        self._draining.add(task)
        task.add_done_callback(self._draining.discard)

    async def _drain(self, retired: list[FirstBytes]) -> None:
        timeout = self._limits.write_timeout  # a response in progress: as long as its write
        await asyncio.gather(*(c.drain(timeout) for c in retired), return_exceptions=True)

    async def close(self) -> None:
        if self._web_config is not None and self.retire in self._web_config.trust_changed:
            self._web_config.trust_changed.remove(self.retire)
        for task in self._draining:
            task.cancel()
        await asyncio.gather(*self._draining, return_exceptions=True)
        self._listener.close()
        if self._started:
            await self._runner.cleanup()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(1.0):  # not wait_for: it may swallow a cancellation
                await self._listener.wait_closed()
