"""A reload of --web-config-file applies whole to the connections accepted after it.

Real handshakes: the agent's listener (the loop's TLS server, asyncio and uvloop) with the web
config's context, and Python's ``ssl`` client in a thread. A reload that removes a client CA
stops trusting it; one that changes ``client_auth_type`` or the TLS versions changes what new
connections are asked; and a session made before the reload is not resumed past it.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import cast

import bcrypt
import pytest
from support.tls import Pki, write_web_config

from gpuagent.web.listener import Listener
from gpuagent.web.webconfig import WebConfigFile

TLS12, TLS13 = ssl.TLSVersion.TLSv1_2, ssl.TLSVersion.TLSv1_3
REQUIRE = "RequireAndVerifyClientCert"


class _Answer(asyncio.Protocol):
    """Says whether the client sent a (verified) certificate and whether its session was
    resumed, then closes (cleanly: TLS 1.2 caches only sessions closed so)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        tls = transport.get_extra_info("ssl_object")
        answer = "cert" if transport.get_extra_info("peercert") else "none"
        answer += " resumed" if tls.session_reused else ""
        cast(asyncio.WriteTransport, transport).write(answer.encode())  # (uvloop's: no subclass)
        transport.close()


@asynccontextmanager
async def listening(web: WebConfigFile) -> AsyncIterator[int]:
    listener = Listener("127.0.0.1", 0, ssl_context=web.ssl_context)
    await listener.serve(_Answer)
    try:
        yield listener.port
    finally:
        listener.close()
        await listener.wait_closed()


class Client:
    """A TLS client trusting ``pki``'s CA (the server's), with ``cert``'s client certificate
    if given; its sessions can be offered again (resumption)."""

    def __init__(self, pki: Pki, cert: Pki | None = None, version: ssl.TLSVersion = TLS13):
        self.context = ssl.create_default_context(cafile=pki.ca_cert)
        self.context.maximum_version = version
        if cert is not None:
            self.context.load_cert_chain(cert.client_cert, cert.client_key)
        self.session: ssl.SSLSession | None = None

    async def connect(self, port: int, *, resume: bool = False) -> str:
        """What the server answered, or ``refused`` when the handshake failed."""
        return await asyncio.to_thread(self._connect, port, self.session if resume else None)

    def _connect(self, port: int, session: ssl.SSLSession | None) -> str:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as raw:
            try:
                with self.context.wrap_socket(
                    raw, server_hostname="localhost", session=session
                ) as tls:
                    answer = b"".join(iter(lambda: tls.recv(64), b"")).decode()
                    self.session = tls.session
            except (ssl.SSLError, ConnectionResetError):
                return "refused"
        # A served connection is always answered; TLS 1.3 refuses a client certificate after
        # the client's side of the handshake is done: the connection then just ends.
        return answer or "refused"


def reload(web: WebConfigFile) -> None:
    assert web.use(web.reread()) is True


async def test_a_client_ca_replaced_is_no_longer_trusted(
    tmp_path: Path, pki: Pki, other: Pki
) -> None:
    web = WebConfigFile(write_web_config(tmp_path, pki, pki, client_auth_type=REQUIRE))
    signed_by_a, signed_by_b = Client(pki, pki), Client(pki, other)
    async with listening(web) as port:
        assert [await signed_by_a.connect(port), await signed_by_b.connect(port)] == [
            "cert",
            "refused",
        ]
        write_web_config(tmp_path, pki, other, client_auth_type=REQUIRE)
        reload(web)
        assert [await signed_by_a.connect(port), await signed_by_b.connect(port)] == [
            "refused",
            "cert",
        ]


async def test_a_client_ca_removed_is_no_longer_trusted(tmp_path: Path, pki: Pki) -> None:
    """``VerifyClientCertIfGiven`` without a CA any more: a certificate the old CA signed is
    refused (it cannot be verified), a client without one still served."""
    web = WebConfigFile(
        write_web_config(tmp_path, pki, pki, client_auth_type="VerifyClientCertIfGiven")
    )
    signed, anonymous = Client(pki, pki), Client(pki)
    async with listening(web) as port:
        assert await signed.connect(port) == "cert"
        write_web_config(tmp_path, pki, None, client_auth_type="VerifyClientCertIfGiven")
        reload(web)
        assert [await signed.connect(port), await anonymous.connect(port)] == ["refused", "none"]


async def test_client_auth_type_lowered_and_raised_again(tmp_path: Path, pki: Pki) -> None:
    web = WebConfigFile(write_web_config(tmp_path, pki, pki, client_auth_type=REQUIRE))
    signed, anonymous = Client(pki, pki), Client(pki)
    async with listening(web) as port:
        assert [await signed.connect(port), await anonymous.connect(port)] == ["cert", "refused"]
        write_web_config(tmp_path, pki, pki, client_auth_type="VerifyClientCertIfGiven")
        reload(web)
        assert [await signed.connect(port), await anonymous.connect(port)] == ["cert", "none"]
        write_web_config(tmp_path, pki, pki, client_auth_type=REQUIRE)
        reload(web)
        assert [await signed.connect(port), await anonymous.connect(port)] == ["cert", "refused"]


async def test_the_server_certificate_and_versions_follow_a_reload(
    tmp_path: Path, pki: Pki, other: Pki
) -> None:
    web = WebConfigFile(write_web_config(tmp_path, pki))
    old, new, old_tls12 = Client(pki), Client(other), Client(pki, version=TLS12)
    async with listening(web) as port:
        assert [await old.connect(port), await new.connect(port)] == ["none", "refused"]
        assert await old_tls12.connect(port) == "none"
        write_web_config(tmp_path, other, min_version="TLS13")
        reload(web)
        assert [await old.connect(port), await new.connect(port)] == ["refused", "none"]
        assert await Client(other, version=TLS12).connect(port) == "refused"


@pytest.mark.parametrize("version", [TLS12, TLS13], ids=["TLS12", "TLS13"])
async def test_a_session_from_before_the_reload_is_not_resumed(
    tmp_path: Path, pki: Pki, other: Pki, version: ssl.TLSVersion
) -> None:
    """The session a client certificate signed by the removed CA was verified in would carry
    that verification past the reload; it is refused, a new handshake decides."""
    web = WebConfigFile(write_web_config(tmp_path, pki, pki, client_auth_type=REQUIRE))
    signed_by_a = Client(pki, pki, version)
    async with listening(web) as port:
        assert await signed_by_a.connect(port) == "cert"
        assert await signed_by_a.connect(port, resume=True) == "cert resumed"
        write_web_config(tmp_path, pki, other, client_auth_type=REQUIRE)
        reload(web)
        assert await signed_by_a.connect(port, resume=True) == "refused"
        assert await Client(pki, other, version).connect(port) == "cert"


@pytest.mark.parametrize("version", [TLS12, TLS13], ids=["TLS12", "TLS13"])
async def test_a_session_without_a_certificate_is_not_resumed_once_one_is_required(
    tmp_path: Path, pki: Pki, version: ssl.TLSVersion
) -> None:
    web = WebConfigFile(write_web_config(tmp_path, pki, pki))
    anonymous = Client(pki, None, version)
    async with listening(web) as port:
        assert await anonymous.connect(port) == "none"
        write_web_config(tmp_path, pki, pki, client_auth_type=REQUIRE)
        reload(web)
        assert await anonymous.connect(port, resume=True) == "refused"


async def test_a_renewed_server_certificate_keeps_sessions(tmp_path: Path, pki: Pki) -> None:
    """Who is trusted has not changed: a session verified before is still good (a renewal by
    cert-manager must not fail every client's next resumption). The certificate file is written
    anew (other bytes, the same certificate: what this PKI can sign for the same name)."""
    path = write_web_config(tmp_path, pki, pki, client_auth_type=REQUIRE)
    web = WebConfigFile(path)
    signed = Client(pki, pki)
    async with listening(web) as port:
        assert await signed.connect(port) == "cert"
        certificate = tmp_path / "server.crt"
        certificate.write_bytes(b"# renewed\n" + certificate.read_bytes())
        reload(web)
        assert await signed.connect(port, resume=True) == "cert resumed"


async def test_a_reload_that_leaves_tls_alone_keeps_sessions(tmp_path: Path, pki: Pki) -> None:
    path = write_web_config(tmp_path, pki, pki, client_auth_type=REQUIRE)
    web = WebConfigFile(path)
    signed = Client(pki, pki)
    async with listening(web) as port:
        assert await signed.connect(port) == "cert"
        hashed = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(4)).decode()
        path.write_text(path.read_text() + f"basic_auth_users:\n  prometheus: {hashed}\n")
        reload(web)
        assert await signed.connect(port, resume=True) == "cert resumed"
