"""A served socket's lifecycle: served on its path, closed promptly, and nothing left behind.

On CPython >= 3.12 ``asyncio.Server.wait_closed()`` waits for every client connection, and
grpclib's ``Server.close()`` leaves idle HTTP/2 connections open, so without
``GrpcServer.drop_connections`` the asyncio loop waits out the close timeout (uvloop does not).
"""

from __future__ import annotations

import asyncio
import contextlib
import stat
from pathlib import Path

from grpclib.client import Channel
from support.waiting import eventually

from gpuagent._proto import v1beta1 as pb
from gpuagent.domain.serving import ResourceView
from gpuagent.kubelet.plugin import DevicePluginService
from gpuagent.sockets.grpcserver import SOCKET_MODE, ServedSocket
from gpuagent.state.store import DeviceStore

MAX_TURNS = 50  # more turns of the loop than any serve takes


def _service() -> DevicePluginService:
    store = DeviceStore()
    return DevicePluginService(store, ResourceView(), "nvidia.com/gpu", asyncio.Event())


def _bound(path: Path) -> bool:
    """Whether a socket of this process's network namespace is bound to ``path`` (listening or
    not, its file there or not)."""
    lines = Path("/proc/net/unix").read_text().splitlines()[1:]
    return any(line.split()[7:] == [str(path)] for line in lines)


async def test_close_does_not_wait_for_an_idle_client(short_tmp_path: Path) -> None:
    path = short_tmp_path / "plugin.sock"
    served = await ServedSocket.serve([_service()], path)
    assert stat.S_IMODE(path.stat().st_mode) == SOCKET_MODE
    channel = Channel(path=str(path))
    try:
        await pb.DevicePluginStub(channel).get_device_plugin_options(pb.Empty())
        # Closed because the connection was dropped, not because the timeout ran out.
        assert await served.close(within=5.0)
        assert not path.exists()
        assert not _bound(path)
    finally:
        channel.close()


async def test_a_stale_socket_is_replaced_and_a_taken_path_left_to_its_owner(
    short_tmp_path: Path,
) -> None:
    path = short_tmp_path / "sub" / "plugin.sock"
    first = await ServedSocket.serve([_service()], path)
    second = await ServedSocket.serve([_service()], path)  # as a restarted agent does
    assert not first.ours
    assert second.ours
    assert await first.close(within=5.0)
    assert path.exists(), "the socket of the server that replaced it was removed"
    assert await second.close(within=5.0)
    assert not path.exists()


async def test_a_serve_cancelled_at_any_turn_leaves_nothing_listening(
    short_tmp_path: Path,
) -> None:
    """asyncio binds, listens, then yields once inside create_unix_server: a serve cancelled
    there used to leave a listening socket nobody would close, and its file. Cancelled after
    each number of turns of the loop until it has served, a serve leaves either a server to
    close or nothing at all."""
    path = short_tmp_path / "plugin.sock"
    outcomes = []
    for turns in range(MAX_TURNS):
        task = asyncio.create_task(ServedSocket.serve([_service()], path))
        for _ in range(turns):
            await asyncio.sleep(0)
        served = None
        if task.cancel():
            with contextlib.suppress(asyncio.CancelledError):
                served = await task
        else:
            served = task.result()
        if served is not None:
            outcomes.append("served")
            assert await served.close(within=5.0)
            break
        outcomes.append("cancelled")
        await eventually(
            lambda: not _bound(path) and not path.exists(),
            what=f"no socket left after a cancel at turn {turns}",
        )
    assert outcomes[-1] == "served", f"not served within {MAX_TURNS} turns"
    assert "cancelled" in outcomes
    assert not _bound(path)
