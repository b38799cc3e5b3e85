"""The HTTP server on its own: scrapes, coalescing, TLS, basic auth and hostile clients."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import gzip
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import bcrypt
import pytest
from prometheus_client.parser import text_string_to_metric_families
from structlog.testing import capture_logs
from support.synthetic import synthetic_snapshot
from support.tls import Pki
from support.tlsclient import KeptConnection
from support.waiting import eventually

from gpuagent.domain.devices import Registration
from gpuagent.domain.readiness import Readiness
from gpuagent.state.store import DeviceStore
from gpuagent.web.metrics import MetricsRenderer
from gpuagent.web.server import HttpLimits, HttpServer, build_app
from gpuagent.web.webconfig import WebConfigFile

PASSWORD = b"scrape-me"
HASH = bcrypt.hashpw(PASSWORD, bcrypt.gensalt(4)).decode()
AUTH = {"Authorization": "Basic " + base64.b64encode(b"prometheus:" + PASSWORD).decode()}


class _Probes:
    stale: str | None = None  # what freshness() says: None while readings are current

    def liveness(self) -> str | None:
        return None

    def readiness(self) -> Readiness:
        return Readiness("not registered with the kubelet")

    def freshness(self) -> str | None:
        return self.stale


@dataclass
class Served:
    store: DeviceStore
    renderer: MetricsRenderer
    server: HttpServer
    url: str
    probes: _Probes


@asynccontextmanager
async def serving(
    *,
    gpus: int = 4,
    web_config: WebConfigFile | None = None,
    limits: HttpLimits | None = None,
    replicas: int = 0,
    per_container: bool = False,
) -> AsyncIterator[Served]:
    limits = limits or HttpLimits()
    store = DeviceStore(synthetic_snapshot(gpus, replicas=replicas))
    renderer = MetricsRenderer("node-1", "1.0", series_per_container=per_container)
    probes = _Probes()
    app = build_app(store, renderer, probes, web_config=web_config, limits=limits)
    server = HttpServer(
        app,
        "127.0.0.1",
        0,
        ssl_context=web_config.ssl_context if web_config else None,
        limits=limits,
        probes=probes,
    )
    await server.start()
    scheme = "https" if web_config is not None and web_config.ssl_context else "http"
    try:
        yield Served(store, renderer, server, f"{scheme}://127.0.0.1:{server.port}", probes)
    finally:
        await server.close()


def write_web_config(path: Path, body: str) -> WebConfigFile:
    path.write_text(body)
    return WebConfigFile(path)


async def test_scrape_parses_and_is_labelled_as_text_004() -> None:
    async with serving() as s, aiohttp.ClientSession() as http:
        async with http.get(s.url + "/metrics") as response:
            assert response.status == 200
            assert response.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
            assert response.headers["X-Content-Type-Options"] == "nosniff"
            text = await response.text()
        names = {f.name for f in text_string_to_metric_families(text)}
        assert {"DCGM_FI_DEV_GPU_TEMP", "gpuagent_scrape_duration_seconds"} <= names


@pytest.mark.parametrize(
    ("accept", "gzipped"),
    [
        ("gzip", True),
        ("deflate, gzip;q=0.5", True),
        ("gzip;q=0", False),
        ("identity", False),
        ("", False),
    ],
)
async def test_gzip_negotiation(accept: str, gzipped: bool) -> None:
    async with serving(replicas=40) as s, aiohttp.ClientSession(auto_decompress=False) as http:
        async with http.get(s.url + "/metrics", headers={"Accept-Encoding": accept}) as response:
            body = await response.read()
            assert response.headers.get("Content-Encoding") == ("gzip" if gzipped else None)
            assert int(response.headers["Content-Length"]) == len(body)
        text = (gzip.decompress(body) if gzipped else body).decode()
        assert "DCGM_FI_DEV_GPU_TEMP" in text
        assert text.endswith("gpuagent_scrape_duration_seconds_count 0\n")


async def test_head_has_no_body() -> None:
    async with (
        serving() as s,
        aiohttp.ClientSession() as http,
        http.head(s.url + "/metrics") as response,
    ):
        assert response.status == 200
        assert await response.read() == b""


async def test_concurrent_scrapes_render_once_per_version() -> None:
    async with serving(gpus=8, replicas=8) as s, aiohttp.ClientSession() as http:

        async def scrape() -> str:
            async with http.get(s.url + "/metrics", headers={"Accept-Encoding": "gzip"}) as r:
                return await r.text()

        bodies = await asyncio.gather(*(scrape() for _ in range(20)))
        assert s.renderer.device_renders == 1
        device_parts = {b.split("# HELP gpuagent_build_info")[0] for b in bodies}
        assert len(device_parts) == 1
        s.store.set_registration("nvidia.com/gpu", Registration(error="kubelet gone"))
        await scrape()
        assert s.renderer.device_renders == 2
        assert s.renderer.scrapes.count == 21


async def test_scrape_duration_is_recorded() -> None:
    async with serving() as s, aiohttp.ClientSession() as http:
        for _ in range(3):
            async with http.get(s.url + "/metrics") as response:
                text = await response.text()
        assert "gpuagent_scrape_duration_seconds_count 2\n" in text
        assert s.renderer.scrapes.count == 3


async def test_too_many_concurrent_scrapes_get_503() -> None:
    limits = HttpLimits(max_concurrent_scrapes=1, chunk=1024, write_timeout=5.0)
    # ~20 MB (a copy of every series per replica): more than loopback socket buffers hold.
    async with serving(gpus=8, replicas=300, limits=limits, per_container=True) as s:
        # A client that asks and never reads holds the only slot while its socket is full.
        _reader, writer = await asyncio.open_connection("127.0.0.1", s.server.port)
        writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        await writer.drain()
        async with aiohttp.ClientSession() as http:
            status = 0
            for _ in range(200):
                async with http.get(s.url + "/metrics") as response:
                    status = response.status
                if status == 503:
                    break
                await asyncio.sleep(0.01)
            assert status == 503
            # Probes are not scrapes: still answered.
            async with http.get(s.url + "/healthz") as response:
                assert response.status == 200
        writer.close()


async def test_a_client_that_stops_reading_is_dropped_without_blocking_others() -> None:
    limits = HttpLimits(write_timeout=0.3, chunk=16 * 1024)
    # ~20 MB (a copy of every series per replica): more than loopback socket buffers hold, so
    # the server's writes must wait.
    async with serving(gpus=8, replicas=300, limits=limits, per_container=True) as s:
        reader, writer = await asyncio.open_connection("127.0.0.1", s.server.port)
        with capture_logs() as logs:
            writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            await writer.drain()
            async with aiohttp.ClientSession() as http:
                for _ in range(5):  # others are served while it stalls
                    async with http.get(s.url + "/metrics") as response:
                        assert response.status == 200
                        await response.read()
            # Its connection is aborted once the write timeout passes (not read before:
            # reading would let the server's writes through).
            await eventually(lambda: any("too slow" in e["event"] for e in logs), what="abort")
        received = 0
        with contextlib.suppress(ConnectionResetError):
            async with asyncio.timeout(10):
                while chunk := await reader.read(1 << 20):
                    received += len(chunk)
        body_size = len(s.renderer.devices(s.store.snapshot).text)
        assert received < body_size
        writer.close()


async def test_oversized_headers_are_refused() -> None:
    async with serving() as s, aiohttp.ClientSession() as http:
        async with http.get(s.url + "/metrics", headers={"X-Big": "a" * 20_000}) as response:
            assert response.status in (400, 431)
        many = {f"X-H{i}": "v" for i in range(200)}
        async with http.get(s.url + "/metrics", headers=many) as response:
            assert response.status in (400, 431)


async def test_a_silent_connection_is_closed_after_the_keepalive_timeout() -> None:
    limits = HttpLimits(keepalive_timeout=0.2)
    async with serving(limits=limits) as s:
        reader, writer = await asyncio.open_connection("127.0.0.1", s.server.port)
        writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # headers never finished
        await writer.drain()
        async with asyncio.timeout(5):
            assert await reader.read() == b""
        writer.close()


async def _hold(port: int, count: int, server: HttpServer) -> list[asyncio.StreamWriter]:
    """``count`` idle connections, once the server has accepted them all."""
    held = [(await asyncio.open_connection("127.0.0.1", port))[1] for _ in range(count)]
    connections = server._runner.server.connections  # type: ignore[union-attr]
    await eventually(lambda: len(connections) >= min(count, server._limits.max_connections))
    return held


async def _ask(port: int, request: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    async with asyncio.timeout(5):
        answer = await reader.read()
    writer.close()
    return answer


async def test_connections_over_the_limit_get_503_but_probes_are_answered() -> None:
    limits = HttpLimits(max_connections=3)
    async with serving(limits=limits) as s:
        held = await _hold(s.server.port, 3, s.server)
        answer = await _ask(s.server.port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 503")
        assert answer.endswith(b"too many connections\n")
        healthz = await _ask(s.server.port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert healthz.startswith(b"HTTP/1.1 200 OK")
        assert healthz.endswith(b"\r\n\r\nok\n")
        readyz = await _ask(s.server.port, b"GET /readyz HTTP/1.1\r\n\r\n")
        assert readyz.startswith(b"HTTP/1.1 503")
        assert readyz.endswith(b"not registered with the kubelet\n")
        health = await _ask(s.server.port, b"GET /health HTTP/1.1\r\n\r\n")
        assert health.startswith(b"HTTP/1.1 200 OK")
        assert health.endswith(b"\r\n\r\nOK")
        s.probes.stale = "collection stalled"
        health = await _ask(s.server.port, b"GET /health HTTP/1.1\r\n\r\n")
        assert health.startswith(b"HTTP/1.1 503")
        assert health.endswith(b"\r\n\r\nKO: collection stalled\n")
        assert s.server.refused == 5
        for writer in held:
            writer.close()


async def test_idle_connections_cannot_keep_the_probes_from_an_answer() -> None:
    # The case, scaled down: more idle connections than the server takes, no requests.
    limits = HttpLimits(max_connections=16)
    async with serving(limits=limits) as s, aiohttp.ClientSession() as http:
        held = await _hold(s.server.port, 40, s.server)
        for _ in range(3):
            async with http.get(s.url + "/healthz") as response:
                assert (response.status, await response.text()) == (200, "ok\n")
        for writer in held:
            writer.close()


async def test_at_the_limit_the_quietest_connection_makes_room() -> None:
    limits = HttpLimits(max_connections=3, evict_quiet_after=0.0)
    async with serving(limits=limits) as s:
        held = [await asyncio.open_connection("127.0.0.1", s.server.port) for _ in range(3)]
        connections = s.server._runner.server.connections  # type: ignore[union-attr]
        await eventually(lambda: len(connections) == 3)
        request = b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        answer = await _ask(s.server.port, request)
        assert answer.startswith(b"HTTP/1.1 200")  # served, not refused
        assert (s.server.evicted, s.server.refused) == (1, 0)
        # One of those held (all equally quiet) was closed to make room; the others stay.
        reads = [asyncio.create_task(reader.read()) for reader, _ in held]
        done, pending = await asyncio.wait(reads, timeout=5, return_when=asyncio.FIRST_COMPLETED)
        assert [task.result() for task in done] == [b""]
        assert len(pending) == 2
        for task in pending:
            task.cancel()
        await asyncio.wait(pending)
        for _, writer in held:
            writer.close()


async def test_a_connection_that_sends_nothing_is_closed_soon() -> None:
    limits = HttpLimits(first_bytes_timeout=0.05)
    async with serving(limits=limits) as s:
        reader, writer = await asyncio.open_connection("127.0.0.1", s.server.port)
        async with asyncio.timeout(5):
            assert await reader.read() == b""  # closed by the server, long before keep-alive
        writer.close()
        # A connection that asks in time is served as usual.
        request = b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        answer = await _ask(s.server.port, request)
        assert answer.startswith(b"HTTP/1.1 200")


async def test_request_bodies_are_bounded() -> None:
    async with (
        serving() as s,
        aiohttp.ClientSession() as http,
        http.post(s.url + "/sim/faults", data=b"x" * 200_000) as response,
    ):
        assert response.status in (404, 405, 413)


async def test_basic_auth_protects_all_but_probes(tmp_path: Path) -> None:
    config = write_web_config(
        tmp_path / "web.yml",
        f"basic_auth_users:\n  prometheus: {HASH}\n"
        "http_server_config:\n  headers:\n    X-Frame-Options: deny\n",
    )
    async with serving(web_config=config) as s, aiohttp.ClientSession() as http:
        async with http.get(s.url + "/metrics") as response:
            assert response.status == 401
            assert response.headers["WWW-Authenticate"].startswith("Basic")
        bad = {"Authorization": "Basic " + base64.b64encode(b"prometheus:nope").decode()}
        async with http.get(s.url + "/metrics", headers=bad) as response:
            assert response.status == 401
        async with http.get(s.url + "/metrics", headers=AUTH) as response:
            assert response.status == 200
            assert response.headers["X-Frame-Options"] == "deny"
            assert "DCGM_FI_DEV_GPU_TEMP" in await response.text()
        async with http.get(s.url + "/") as response:
            assert response.status == 401
        async with http.get(s.url + "/healthz") as response:
            assert response.status == 200
        async with http.get(s.url + "/readyz") as response:
            assert response.status == 503  # answered (not 401): the kubelet can probe
        async with http.get(s.url + "/health") as response:
            assert response.status == 200  # dcgm-exporter's chart probes it, without credentials


async def test_health_answers_as_dcgm_exporter_does() -> None:
    """``OK`` while the readings are current, ``KO`` and why (503) once they are not."""
    async with serving() as s, aiohttp.ClientSession() as http:
        async with http.get(s.url + "/health") as response:
            assert (response.status, await response.text()) == (200, "OK")
            assert response.headers["X-Content-Type-Options"] == "nosniff"
        s.probes.stale = "collection stalled: no poll completed for 40s (limit 25s)"
        async with http.get(s.url + "/health") as response:
            assert response.status == 503
            assert await response.text() == (
                "KO: collection stalled: no poll completed for 40s (limit 25s)\n"
            )
        async with http.get(s.url + "/") as response:
            assert 'href="health"' in await response.text()


async def test_tls_scrape(tmp_path: Path, pki: Pki) -> None:
    config = write_web_config(
        tmp_path / "web.yml",
        f"tls_server_config:\n  cert_file: {pki.server_cert}\n  key_file: {pki.server_key}\n",
    )
    client = ssl.create_default_context(cafile=pki.ca_cert)
    async with serving(web_config=config) as s, aiohttp.ClientSession() as http:
        assert s.url.startswith("https://")
        async with http.get(s.url + "/metrics", ssl=client) as response:
            assert response.status == 200
            assert "DCGM_FI_DEV_GPU_TEMP" in await response.text()
        with pytest.raises(aiohttp.ClientError):  # plain HTTP on the TLS port
            async with http.get(s.url.replace("https", "http") + "/metrics"):
                pass


async def test_tls_client_certificates(tmp_path: Path, pki: Pki) -> None:
    config = write_web_config(
        tmp_path / "web.yml",
        f"tls_server_config:\n  cert_file: {pki.server_cert}\n  key_file: {pki.server_key}\n"
        f"  client_ca_file: {pki.ca_cert}\n  client_auth_type: RequireAndVerifyClientCert\n",
    )
    with_cert = ssl.create_default_context(cafile=pki.ca_cert)
    with_cert.load_cert_chain(pki.client_cert, pki.client_key)
    without = ssl.create_default_context(cafile=pki.ca_cert)
    async with serving(web_config=config) as s, aiohttp.ClientSession() as http:
        async with http.get(s.url + "/metrics", ssl=with_cert) as response:
            assert response.status == 200
        with pytest.raises(aiohttp.ClientError):
            async with http.get(s.url + "/metrics", ssl=without) as response:
                await response.read()


async def test_a_silent_tls_client_is_cut_off(tmp_path: Path, pki: Pki) -> None:
    config = write_web_config(
        tmp_path / "web.yml",
        f"tls_server_config:\n  cert_file: {pki.server_cert}\n  key_file: {pki.server_key}\n",
    )
    limits = HttpLimits(tls_handshake_timeout=0.2)
    async with serving(web_config=config, limits=limits) as s:
        reader, writer = await asyncio.open_connection("127.0.0.1", s.server.port)
        async with asyncio.timeout(5):
            assert await reader.read() == b""  # never sent a ClientHello
        writer.close()


async def test_a_refused_tls_handshake_leaves_no_connection_behind(
    tmp_path: Path, pki: Pki
) -> None:
    """asyncio and uvloop tell the protocol nothing of a failed handshake: a connection is
    counted (and can be evicted to make room) once made, never before."""
    config = write_web_config(
        tmp_path / "web.yml",
        f"tls_server_config:\n  cert_file: {pki.server_cert}\n  key_file: {pki.server_key}\n"
        f"  client_ca_file: {pki.ca_cert}\n  client_auth_type: RequireAndVerifyClientCert\n",
    )
    async with serving(web_config=config) as s:
        kept, refused = (KeptConnection(s.server.port, pki.ca_cert, cert=pki),
                         KeptConnection(s.server.port, pki.ca_cert))  # fmt: skip
        try:
            assert (await kept.ask()).startswith("200 OK")
            assert await refused.ask() == "closed"
            assert s.server.accepted == 2
            assert s.server.connections == 1  # the kept one
        finally:
            refused.close()
            kept.close()
