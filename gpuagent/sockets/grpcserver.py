"""grpclib's server as both of our gRPC sides (the device plugin, the DRA plugin) serve it.

Two things are added to :class:`grpclib.server.Server`:

* **Corked writes.** grpclib writes a unary response's headers, message and trailers separately,
  so each call cost three system calls and woke the client three times; corked, the writes of one
  turn of the event loop leave as one, at the end of the turn.
* **Dropping client connections.** ``Server.close()`` stops listening and cancels handlers but
  leaves HTTP/2 connections open (grpclib#107: a proper fix needs GOAWAY); a dead kubelet's
  connections, or ours at shutdown, would then linger. :meth:`GrpcServer.drop_connections` closes
  them.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Sequence
from typing import Any, cast

from grpclib._typing import IServable
from grpclib.encoding.base import CodecBase
from grpclib.protocol import H2Protocol
from grpclib.server import Server

__all__ = ["GrpcServer"]


class _CorkedTransport(asyncio.Transport):
    """A transport whose writes within one turn of the event loop leave as one write.

    Only what grpclib's server uses is passed through.
    """

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] = []

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not self._pending:
            self._loop.call_soon(self._flush)
        self._pending.append(bytes(data))

    def _flush(self) -> None:
        data = b"".join(self._pending)
        self._pending.clear()
        if data and not self._transport.is_closing():
            self._transport.write(data)

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def abort(self) -> None:
        self._pending.clear()
        self._transport.abort()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._transport.get_extra_info(name, default)


class _CorkedProtocol(H2Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # (uvloop's transports are not subclasses of asyncio.Transport, but behave as one.)
        plain = cast(asyncio.Transport, transport)
        super().connection_made(_CorkedTransport(plain, asyncio.get_running_loop()))


class GrpcServer(Server):
    """grpclib's server with corked writes and a way to drop its client connections."""

    def __init__(self, handlers: Sequence[IServable], *, codec: CodecBase | None = None) -> None:
        super().__init__(list(handlers), codec=codec)
        self._protocols: weakref.WeakSet[H2Protocol] = weakref.WeakSet()

    def _protocol_factory(self) -> H2Protocol:
        plain = super()._protocol_factory()
        protocol = _CorkedProtocol(plain.handler, plain.config, plain.h2_config)
        self._protocols.add(protocol)
        return protocol

    def drop_connections(self) -> None:
        """Close every client connection (after :meth:`close`, whose handlers have finished)."""
        for protocol in list(self._protocols):
            connection = getattr(protocol, "connection", None)
            if connection is not None:
                connection.close()
