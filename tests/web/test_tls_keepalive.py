"""A reload that changes who may be served closes the connections opened before it.

Real handshakes on the HTTP server (the loop's TLS server, asyncio and uvloop) and Python's
``ssl`` client in a thread, speaking HTTP/1.1 on one kept-alive connection as Prometheus does. A
connection verified under a client CA that a reload removed (or accepted under a weaker
``client_auth_type``) gets no answer to any request it sends after the reload: an idle one is
closed at once, one with a request under way gets that response and is closed after it. A
reload that leaves trust alone closes nothing.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import bcrypt
from aiohttp import web
from support.synthetic import synthetic_snapshot
from support.tls import Pki, write_web_config
from support.tlsclient import KeptConnection
from support.waiting import eventually

from gpuagent.domain.readiness import Readiness
from gpuagent.state.store import DeviceStore
from gpuagent.web.metrics import MetricsRenderer
from gpuagent.web.server import HttpLimits, HttpServer, build_app
from gpuagent.web.webconfig import WebConfigFile

REQUIRE = "RequireAndVerifyClientCert"
IF_GIVEN = "VerifyClientCertIfGiven"
PASSWORD = b"s3cret"
HASH = bcrypt.hashpw(PASSWORD, bcrypt.gensalt(4)).decode()
AUTH = "Basic " + base64.b64encode(b"prometheus:" + PASSWORD).decode()
# Long enough that no idle timer of the server's closes a connection during a test.
LIMITS = HttpLimits(keepalive_timeout=3600, first_bytes_timeout=3600)


class _Probes:
    def liveness(self) -> str | None:
        return None

    def readiness(self) -> Readiness:
        return Readiness(None)

    def freshness(self) -> str | None:
        return None


class Held:
    """``GET /held``: answered only once the test releases it (a request under way); its
    connection's protocol is :attr:`connection`."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.release = asyncio.Event()
        self.connection: asyncio.BaseProtocol | None = None

    async def handle(self, request: web.Request) -> web.Response:
        assert request.transport is not None
        self.connection = request.transport.get_protocol()
        self.entered.set()
        await self.release.wait()
        return web.Response(text="held\n")


@dataclass
class Served:
    server: HttpServer
    held: Held
    opened: list[KeptConnection]

    def connect(self, trusts: Pki, cert: Pki | None = None) -> KeptConnection:
        """A new connection (the handshake comes with its first request)."""
        connection = KeptConnection(self.server.port, trusts.ca_cert, cert)
        self.opened.append(connection)
        return connection


@asynccontextmanager
async def serving(web_config: WebConfigFile) -> AsyncIterator[Served]:
    store = DeviceStore(synthetic_snapshot(1))
    renderer = MetricsRenderer("node-1", "1.0")
    app = build_app(store, renderer, _Probes(), web_config=web_config, limits=LIMITS)
    held = Held()
    app.router.add_get("/held", held.handle)
    server = HttpServer(
        app,
        "127.0.0.1",
        0,
        ssl_context=web_config.ssl_context,
        limits=LIMITS,
        web_config=web_config,
    )
    await server.start()
    served = Served(server, held, [])
    try:
        yield served
    finally:
        for connection in served.opened:
            connection.close()
        held.release.set()
        await server.close()


def reload(web_config: WebConfigFile) -> bool:
    return web_config.use(web_config.reread())


async def test_a_connection_verified_by_a_removed_ca_gets_no_further_answer(
    tmp_path: Path, pki: Pki, other: Pki
) -> None:
    web_config = WebConfigFile(write_web_config(tmp_path, pki, pki, client_auth_type=REQUIRE))
    async with serving(web_config) as s:
        kept = s.connect(pki, cert=pki)
        assert (await kept.ask()).startswith("200 OK")
        write_web_config(tmp_path, pki, other, client_auth_type=REQUIRE)
        assert reload(web_config) is True
        assert await kept.ask() == "closed"
        assert await s.connect(pki, cert=pki).ask() == "closed"  # refused
        assert (await s.connect(pki, cert=other).ask()).startswith("200 OK")


async def test_an_idle_connection_is_closed_at_once_when_a_certificate_becomes_required(
    tmp_path: Path, pki: Pki
) -> None:
    web_config = WebConfigFile(write_web_config(tmp_path, pki, pki, client_auth_type=IF_GIVEN))
    async with serving(web_config) as s:
        anonymous, signed = s.connect(pki), s.connect(pki, cert=pki)
        for connection in (anonymous, signed):
            assert (await connection.ask()).startswith("200 OK")
        write_web_config(tmp_path, pki, pki, client_auth_type=REQUIRE)
        assert reload(web_config) is True
        # Both are closed, unasked: a connection holds no verification the server could
        # still go by (the signed one's certificate would pass; it connects again).
        assert [await anonymous.closed_by_server(), await signed.closed_by_server()] == [
            True,
            True,
        ]
        assert await s.connect(pki).ask() == "closed"  # refused
        assert (await s.connect(pki, cert=pki).ask()).startswith("200 OK")


async def test_a_request_under_way_is_answered_then_its_connection_closed(
    tmp_path: Path, pki: Pki, other: Pki
) -> None:
    web_config = WebConfigFile(write_web_config(tmp_path, pki, pki, client_auth_type=REQUIRE))
    async with serving(web_config) as s:
        kept = s.connect(pki, cert=pki)
        assert (await kept.ask()).startswith("200 OK")
        await kept.send("/held")
        async with asyncio.timeout(30):
            await s.held.entered.wait()
        write_web_config(tmp_path, pki, other, client_auth_type=REQUIRE)
        assert reload(web_config) is True
        s.held.release.set()
        assert await kept.answer() == "200 OK held\n"
        assert await kept.ask() == "closed"


async def test_a_request_read_before_the_reload_but_not_yet_handled_is_not_answered(
    tmp_path: Path, pki: Pki, other: Pki
) -> None:
    """The reload runs between aiohttp's reading of a request and its handling (the loop
    runs the reload first): the request is not answered, and the connection is closed."""
    web_config = WebConfigFile(write_web_config(tmp_path, pki, pki, client_auth_type=REQUIRE))
    async with serving(web_config) as s:
        kept = s.connect(pki, cert=pki)
        s.held.release.set()
        assert await kept.ask("/held") == "200 OK held\n"
        connection = s.held.connection
        assert isinstance(connection, asyncio.Protocol)
        read = connection.data_received

        def read_then_reload(data: bytes) -> None:
            read(data)
            write_web_config(tmp_path, pki, other, client_auth_type=REQUIRE)
            assert reload(web_config) is True

        connection.data_received = read_then_reload  # type: ignore[method-assign]
        assert await kept.ask() == "closed"


async def test_a_connection_whose_handshake_ends_after_the_reload_is_closed(
    tmp_path: Path, pki: Pki
) -> None:
    """Accepted before the reload, its handshake has the verify mode of then (OpenSSL copies
    it when the connection is accepted): an anonymous client would pass where a certificate is
    now required. It is closed once its handshake ends, before any request."""
    web_config = WebConfigFile(write_web_config(tmp_path, pki, pki, client_auth_type=IF_GIVEN))
    async with serving(web_config) as s:
        early = s.connect(pki)
        await eventually(lambda: s.server.accepted == 1, what="the connection accepted")
        write_web_config(tmp_path, pki, pki, client_auth_type=REQUIRE)
        assert reload(web_config) is True
        await early.handshake()  # passes: no certificate was asked for when it was accepted
        assert await early.ask() == "closed"


async def test_a_reload_that_leaves_trust_alone_closes_nothing(
    tmp_path: Path, pki: Pki, other: Pki
) -> None:
    """The same files written again, basic auth turned on (checked per request: the kept
    connection is asked for credentials at once) and the server's own certificate rotated:
    the client keeps its connection through all three."""
    path = write_web_config(tmp_path, pki, pki, client_auth_type=REQUIRE)
    web_config = WebConfigFile(path)
    async with serving(web_config) as s:
        kept = s.connect(pki, cert=pki)
        assert (await kept.ask()).startswith("200 OK")
        write_web_config(tmp_path, pki, pki, client_auth_type=REQUIRE)
        assert reload(web_config) is False
        assert (await kept.ask()).startswith("200 OK")
        users = ("basic_auth_users:", f"  prometheus: {HASH}")
        write_web_config(tmp_path, pki, pki, *users, client_auth_type=REQUIRE)
        assert reload(web_config) is True
        assert (await kept.ask()).startswith("401 Unauthorized")
        assert (await kept.ask(authorization=AUTH)).startswith("200 OK")
        # The server's certificate and key from the other PKI, the client CA still ``pki``'s.
        write_web_config(tmp_path, other, None, *users, client_auth_type=REQUIRE,
                     client_ca_file=str(pki.ca_cert))  # fmt: skip
        assert reload(web_config) is True
        assert (await kept.ask(authorization=AUTH)).startswith("200 OK")
        assert s.server.connections == 1
