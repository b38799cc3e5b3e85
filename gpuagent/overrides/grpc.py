"""grpclib's and betterproto2's private API, as the agent uses it (see
:mod:`gpuagent.overrides`)."""

from __future__ import annotations

import weakref
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from betterproto2.grpclib.grpclib_server import ServiceBase
from grpclib._typing import IServable
from grpclib.encoding.base import CodecBase
from grpclib.protocol import H2Protocol
from grpclib.server import Server

__all__ = ["ClosingServerStreams", "IServable", "TrackedServer"]


class TrackedServer(Server):
    """grpclib's server, each connection's protocol a ``protocol_class`` and closable at will."""

    protocol_class: type[H2Protocol] = H2Protocol

    def __init__(self, handlers: Sequence[IServable], *, codec: CodecBase | None = None) -> None:
        super().__init__(list(handlers), codec=codec)
        self._protocols: weakref.WeakSet[H2Protocol] = weakref.WeakSet()

    def _protocol_factory(self) -> H2Protocol:
        plain = super()._protocol_factory()
        protocol = self.protocol_class(plain.handler, plain.config, plain.h2_config)
        self._protocols.add(protocol)
        return protocol

    def drop_connections(self) -> None:
        """Close every client connection (after :meth:`close`, whose handlers have finished)."""
        for protocol in list(self._protocols):
            connection = getattr(protocol, "connection", None)
            if connection is not None:
                connection.close()


class ClosingServerStreams(ServiceBase):
    """A betterproto2 service whose server streams are closed when their handler ends."""

    async def _call_rpc_handler_server_stream(
        self, handler: Callable[[Any], AsyncIterator[Any]], stream: Any, request: Any
    ) -> None:
        """betterproto2's streaming loop, with the stream closed when the handler ends."""
        responses = handler(request)
        try:
            async for response in responses:
                await stream.send_message(response)
        finally:
            await responses.aclose()  # type: ignore[attr-defined]
