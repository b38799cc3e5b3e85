"""The metrics address, bound at once and served later (no aiohttp here: it is cheap to import).

The agent binds its address before anything else starts, so an address that cannot be had is a
configuration error at once (exit code 2), and imports the HTTP application only after the
kubelet has its device plugin. Until :meth:`Listener.serve`, the socket is bound but not
listening: a client is refused, as by an agent that is still starting.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable

__all__ = ["Listener"]


class Listener:
    """A TCP address bound now, served by a protocol factory given later."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        ssl_context: ssl.SSLContext | None = None,
        tls_handshake_timeout: float = 10.0,
    ) -> None:
        self.host = host or None  # None: every interface
        self.port = port
        self.tls = ssl_context is not None
        self._ssl = ssl_context
        self._tls_handshake_timeout = tls_handshake_timeout
        self._server: asyncio.Server | None = None
        self._factory: Callable[[], asyncio.Protocol] | None = None

    async def bind(self) -> None:
        """Bind the address (``port`` becomes the bound port); raises :class:`OSError`."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            self._protocol,
            self.host,
            self.port,
            ssl=self._ssl,
            ssl_handshake_timeout=self._tls_handshake_timeout if self._ssl else None,
            reuse_address=True,
            start_serving=False,
        )
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def serve(self, factory: Callable[[], asyncio.Protocol]) -> None:
        """Listen, answering each connection with a protocol from ``factory``."""
        if self._server is None:
            await self.bind()
        assert self._server is not None
        self._factory = factory
        await self._server.start_serving()

    def close(self) -> None:
        if self._server is not None:
            self._server.close()

    async def wait_closed(self) -> None:
        if self._server is not None:
            await self._server.wait_closed()

    def _protocol(self) -> asyncio.Protocol:
        assert self._factory is not None  # connections are accepted only once served
        return self._factory()
