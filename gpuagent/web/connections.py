"""Connection-level guards of the HTTP server, so that no client can starve the kubelet's probes.

* :class:`FirstBytes` — a connection that sends nothing within a short deadline is closed (an
  idle squatter costs seconds, not aiohttp's one-minute keep-alive); it also knows when its
  client last sent anything, so that at the limit the quietest connection can make room
  (:func:`evict_quietest`); and it can be retired (:meth:`FirstBytes.retire`): closed once
  the response in progress, if any, is written, and no request taken on it meanwhile;
* :class:`ProbesOnly` — a connection over the server's limit is not refused outright: a probe
  (``GET /health``, ``/healthz`` or ``/readyz``) on it is answered from the probes, anything
  else gets ``503``, and the connection is closed. However many connections others hold, the
  DaemonSet's probes get their answer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol, cast

__all__ = ["MAX_REQUEST_LINE", "FirstBytes", "ProbesOnly", "evict_quietest"]

MAX_REQUEST_LINE = 8192
# What the app itself answers: when OK, and before the reason when not.
_OK = {"/health": "OK", "/healthz": "ok\n", "/readyz": "ready\n"}
_NOT_OK = {"/health": "KO: "}
_PATHS = {path.encode() for path in _OK}

Probe = Callable[[], str | None]


class ConnectionHandler(Protocol):
    """What :class:`FirstBytes` needs of the protocol it wraps (aiohttp's ``RequestHandler``)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None: ...
    def data_received(self, data: bytes) -> None: ...
    def eof_received(self) -> bool | None: ...
    def pause_writing(self) -> None: ...
    def resume_writing(self) -> None: ...
    def connection_lost(self, exc: Exception | None) -> None: ...
    def close(self) -> None: ...  # take no further request; close after the one in progress
    async def shutdown(self, timeout: float | None, /) -> None: ...  # noqa: ASYNC109  (aiohttp's)


class FirstBytes(asyncio.Protocol):
    """``inner`` (aiohttp's protocol for one connection), closed unless bytes arrive within
    ``deadline`` seconds of the connection opening. ``accepted_in``: the server's count of
    changes of trust when it accepted the connection (read back when the connection is made).

    ``on_made`` is called when the connection is made (after its TLS handshake), ``on_lost``
    when it is lost; a connection whose handshake fails has neither (asyncio and uvloop tell
    the protocol nothing of it)."""

    def __init__(self, inner: ConnectionHandler, deadline: float, *, accepted_in: int = 0) -> None:
        self._inner = inner
        self._deadline = deadline
        self._timer: asyncio.TimerHandle | None = None
        self._transport: asyncio.Transport | None = None
        self.expired = False
        #: no request is to be answered on it any more (:meth:`retire`)
        self.retired = False
        self.last_heard = 0.0  # loop time of the client's last bytes (or of the connection)
        self.accepted_in = accepted_in
        self.on_made: Callable[[FirstBytes], None] | None = None
        self.on_lost: Callable[[FirstBytes], None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        loop = asyncio.get_running_loop()
        self.last_heard = loop.time()
        self._timer = loop.call_later(self._deadline, self._expire)
        if self.on_made is not None:
            self.on_made(self)
        self._inner.connection_made(transport)
        if self.retired:  # (by ``on_made``): it never takes a request
            self.close()

    def data_received(self, data: bytes) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.last_heard = asyncio.get_running_loop().time()
        self._inner.data_received(data)

    def close(self) -> None:
        """Close the connection (a response being written is cut short)."""
        if self._transport is not None and not self._transport.is_closing():
            self._transport.close()

    def retire(self) -> None:
        """Take no further request on this connection, from now on: aiohttp parses no more of
        its bytes, and the server answers none of the requests already parsed (it checks
        :attr:`retired` before any handler runs). :meth:`drain` then closes it."""
        self.retired = True
        if self._transport is not None:
            self._inner.close()

    async def drain(self, seconds: float) -> None:
        """Close a retired connection: at once if idle, else once the response in progress is
        written (for ``seconds`` at most: then it is cut short)."""
        if self._transport is not None:
            await self._inner.shutdown(seconds)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.on_lost is not None:
            self.on_lost(self)
        self._inner.connection_lost(exc)

    def _expire(self) -> None:
        self._timer = None
        self.expired = True
        if self._transport is not None:
            self._transport.close()


def evict_quietest(connections: set[FirstBytes], quiet_for: float) -> bool:
    """Close the connection whose client has been quiet longest, if for at least ``quiet_for``
    seconds (an idle keep-alive, or a reader far slower than any scrape); ``False`` if none."""
    if not connections:
        return False
    quietest = min(connections, key=lambda c: c.last_heard)
    if asyncio.get_running_loop().time() - quietest.last_heard < quiet_for:
        return False
    connections.discard(quietest)
    quietest.close()
    return True


class ProbesOnly(asyncio.Protocol):
    """A connection over the limit: answers one probe request, or ``503``, then closes.

    It reads at most :data:`MAX_REQUEST_LINE` bytes for at most ``deadline`` seconds (the request
    line is all it looks at), so it costs nothing a client could pile up.
    """

    def __init__(self, probes: dict[str, Probe], deadline: float) -> None:
        self._probes = probes
        self._deadline = deadline
        self._buffer = b""
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)
        self._timer = asyncio.get_running_loop().call_later(self._deadline, self._transport.abort)

    def data_received(self, data: bytes) -> None:
        if self._transport is None or self._transport.is_closing():
            return
        self._buffer += data
        line, found, _ = self._buffer.partition(b"\r\n")
        if not found and len(self._buffer) < MAX_REQUEST_LINE:
            return
        parts = line.split(b" ")
        probe = None
        if found and len(parts) == 3 and parts[0] == b"GET":
            probe = self._probes.get(parts[1].decode("latin-1")) if parts[1] in _PATHS else None
        if probe is None:
            self._answer(503, "too many connections\n")
            return
        path = parts[1].decode("latin-1")
        problem = probe()
        if problem is None:
            self._answer(200, _OK[path])
        else:
            self._answer(503, f"{_NOT_OK.get(path, '')}{problem}\n")

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _answer(self, status: int, text: str) -> None:
        assert self._transport is not None
        reason = "OK" if status == 200 else "Service Unavailable"
        body = text.encode()
        self._transport.write(
            f"HTTP/1.1 {status} {reason}\r\nContent-Type: text/plain; charset=utf-8\r\n"
            f"Content-Length: {len(body)}\r\nX-Content-Type-Options: nosniff\r\n"
            "Connection: close\r\n\r\n".encode()
            + body
        )
        self._transport.close()
