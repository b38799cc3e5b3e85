"""An HTTPS client that keeps its connection, as Prometheus does: Python's ``ssl`` client speaking
HTTP/1.1 on one connection, request after request (each call runs in a thread)."""

from __future__ import annotations

import asyncio
import socket
import ssl
from pathlib import Path

from support.tls import Pki

__all__ = ["KeptConnection"]


class KeptConnection:
    """One HTTPS connection to ``port`` kept alive across requests, trusting the server
    certificates ``ca`` signed and presenting ``cert``'s client certificate if given. An answer
    is the response's status and the start of its body (``200 OK held``), or ``closed``: the
    server ended the connection (or refused the handshake) without answering."""

    def __init__(self, port: int, ca: Path, cert: Pki | None = None) -> None:
        self.context = ssl.create_default_context(cafile=ca)
        if cert is not None:
            self.context.load_cert_chain(cert.client_cert, cert.client_key)
        self._raw = socket.create_connection(("127.0.0.1", port), timeout=30)
        self._tls: ssl.SSLSocket | None = None
        self._buffer = b""

    async def handshake(self) -> None:
        await asyncio.to_thread(self._handshake)

    async def ask(self, path: str = "/metrics", authorization: str | None = None) -> str:
        """``GET path`` on this connection (the handshake first, if not made yet)."""
        return await asyncio.to_thread(self._ask, path, authorization)

    async def send(self, path: str) -> None:
        """Send ``GET path`` and return before its answer (read it with :meth:`answer`)."""
        await asyncio.to_thread(self._send, path, None)

    async def answer(self) -> str:
        return await asyncio.to_thread(self._answer)

    async def closed_by_server(self) -> bool:
        """Whether the server ends the connection without being asked anything."""
        return await asyncio.to_thread(self._read_some) is None

    def close(self) -> None:
        (self._tls or self._raw).close()

    def _handshake(self) -> None:
        if self._tls is None:
            self._tls = self.context.wrap_socket(self._raw, server_hostname="localhost")

    def _ask(self, path: str, authorization: str | None) -> str:
        try:
            self._send(path, authorization)
        except (ssl.SSLError, OSError):
            return "closed"
        return self._answer()

    def _send(self, path: str, authorization: str | None) -> None:
        self._handshake()
        assert self._tls is not None
        header = "" if authorization is None else f"Authorization: {authorization}\r\n"
        self._tls.sendall(f"GET {path} HTTP/1.1\r\nHost: localhost\r\n{header}\r\n".encode())

    def _answer(self) -> str:
        while b"\r\n\r\n" not in self._buffer:
            if self._read_some() is None:
                return "closed"
        head, _, self._buffer = self._buffer.partition(b"\r\n\r\n")
        status, *fields = head.decode("latin-1").split("\r\n")
        lengths = [f.split(":", 1)[1] for f in fields if f.lower().startswith("content-length:")]
        length = int(lengths[0])
        while len(self._buffer) < length:
            if self._read_some() is None:
                return "closed"
        body, self._buffer = self._buffer[:length], self._buffer[length:]
        return f"{status.split(' ', 1)[1]} {body[:40].decode(errors='replace')}"

    def _read_some(self) -> bytes | None:
        """More bytes, or ``None`` when the connection ended (or the handshake was refused)."""
        assert self._tls is not None
        try:
            data = self._tls.recv(65536)
        except TimeoutError:
            raise AssertionError("the server neither answered nor closed the connection") from None
        except (ssl.SSLError, OSError):
            return None
        self._buffer += data
        return data or None
