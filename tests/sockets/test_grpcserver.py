"""The plugin endpoint closes promptly while a client still holds an idle connection.

On CPython >= 3.12 ``asyncio.Server.wait_closed()`` waits for every client connection, and
grpclib's ``Server.close()`` leaves idle HTTP/2 connections open, so without
``GrpcServer.drop_connections`` the asyncio loop waits out ``close_timeout`` (uvloop does not).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from grpclib.client import Channel
from structlog.testing import capture_logs

from gpuagent._proto import v1beta1 as pb
from gpuagent.domain.serving import ResourceView
from gpuagent.kubelet.plugin import DevicePluginService
from gpuagent.kubelet.registration import PluginEndpoint, Timing
from gpuagent.state.store import DeviceStore


async def test_close_does_not_wait_for_an_idle_client(short_tmp_path: Path) -> None:
    store = DeviceStore()
    service = DevicePluginService(store, ResourceView(store), "nvidia.com/gpu", asyncio.Event())
    socket_path = short_tmp_path / "plugin.sock"
    endpoint = PluginEndpoint(
        service,
        store,
        socket_path=socket_path,
        kubelet_socket=short_tmp_path / "kubelet.sock",
        resource_name="nvidia.com/gpu",
        timing=Timing(close_timeout=5.0),
    )
    await endpoint._serve()
    channel = Channel(path=str(socket_path))
    try:
        await pb.DevicePluginStub(channel).get_device_plugin_options(pb.Empty())
        with capture_logs() as logs:
            await endpoint._close_server()
        # Closed because the connection was dropped, not because close_timeout ran out.
        assert [e["event"] for e in logs if e["log_level"] == "warning"] == []
        assert not socket_path.exists()
    finally:
        channel.close()
