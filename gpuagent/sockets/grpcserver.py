"""grpclib's server as both of our gRPC sides (the device plugin, the DRA plugin) serve it, on a
Unix socket, from bind to close.

Two things are added to :class:`grpclib.server.Server` (through
:class:`~gpuagent.overrides.grpc.TrackedServer`, which reaches into grpclib):

* **Corked writes.** grpclib writes a unary response's headers, message and trailers separately,
  so each call cost three system calls and woke the client three times; corked, the writes of one
  turn of the event loop leave as one, at the end of the turn.
* **Dropping client connections.** ``Server.close()`` stops listening and cancels handlers but
  leaves HTTP/2 connections open; :meth:`ServedSocket.close` drops them, so a dead kubelet's
  connections, or ours at shutdown, do not linger.

:class:`ServedSocket` is the one lifecycle of a served socket: its directory made, a stale socket
at its path removed, the server started and the socket made ``0660``; then closed, its handlers
given a turn to finish, its connections dropped, and the socket file removed if it is still ours
(another plugin may have taken the path). A serve cancelled while the server binds leaves nothing
listening and no socket file: the bind is let finish, then undone.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from grpclib.encoding.base import CodecBase
from grpclib.protocol import H2Protocol

from gpuagent.overrides.grpc import IServable, TrackedServer

__all__ = ["SOCKET_MODE", "GrpcServer", "ServedSocket", "SocketId", "socket_id"]

# Only the kubelet (root) and the agent itself need a socket; never world-writable.
SOCKET_MODE = 0o660


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


class GrpcServer(TrackedServer):
    """grpclib's server with corked writes and a way to drop its client connections."""

    protocol_class = _CorkedProtocol


# A socket file's identity. The inode number alone is not enough: a deleted socket's inode is
# often reused at once by the socket that replaces it; the change time tells them apart.
SocketId = tuple[int, int, int]


def socket_id(path: Path) -> SocketId | None:
    """The identity of the Unix socket at ``path``, or ``None`` if there is none."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_ctime_ns) if stat.S_ISSOCK(st.st_mode) else None


@dataclass(slots=True)
class ServedSocket:
    """A :class:`GrpcServer` serving on the Unix socket ``path`` (``identity``: the socket it
    bound), from :meth:`serve` to :meth:`close`."""

    server: GrpcServer
    path: Path
    identity: SocketId | None

    @classmethod
    async def serve(
        cls, handlers: Sequence[IServable], path: Path, *, codec: CodecBase | None = None
    ) -> ServedSocket:
        """Serve ``handlers`` on ``path``; raises :class:`OSError` when the socket cannot be
        served there (a directory that cannot be made, a path too long, …)."""
        _make_way(path)
        server = GrpcServer(handlers, codec=codec)
        await _start(server, path)
        try:
            os.chmod(path, SOCKET_MODE)
        except OSError:
            _undo(server, path)
            raise
        return cls(server, path, socket_id(path))

    @property
    def ours(self) -> bool:
        """Whether the socket at the path is still the one this server bound."""
        return self.identity is not None and socket_id(self.path) == self.identity

    async def close(self, within: float) -> bool:
        """Stop serving and remove the socket file if it is still ours; ``False`` when the
        server did not finish closing ``within`` seconds."""
        server = self.server
        server.close()
        # Let cancelled handlers finish (streams send their status), then drop the connections:
        # Python >= 3.12's wait_closed() waits for every client to go.
        await asyncio.sleep(0)
        server.drop_connections()
        closed = True
        try:
            # Not wait_for: on Python 3.11 it can swallow a cancellation that arrives as the
            # server closes, and the owner would then outlive the agent's shutdown.
            async with asyncio.timeout(within):
                await server.wait_closed()
        except TimeoutError:
            closed = False
        finally:
            # Removed even when a cancellation cuts the wait short (the owner's shutdown).
            # Our own socket only: after a takeover the path is another plugin's.
            with contextlib.suppress(FileNotFoundError):
                if self.ours:
                    self.path.unlink()
        return closed


def _make_way(path: Path) -> None:
    """The socket's directory made, a stale socket from an earlier run removed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


async def _start(server: GrpcServer, path: Path) -> None:
    """``server.start()`` on ``path``. Cancelled meanwhile (asyncio's ``create_unix_server``
    yields once after it has bound and listens), the start still finishes, and is undone."""
    starting = asyncio.ensure_future(server.start(path=str(path)))
    try:
        await asyncio.shield(starting)
    except asyncio.CancelledError:
        starting.add_done_callback(lambda done: _undo(server, path) if _started(done) else None)
        raise


def _started(start: asyncio.Future[Any]) -> bool:
    return not start.cancelled() and start.exception() is None


def _undo(server: GrpcServer, path: Path) -> None:
    """Stop a server nobody will close, and remove the socket it bound."""
    server.close()
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
