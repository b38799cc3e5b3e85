"""The DevicePlugin service's streams: nothing of a stream outlives it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
from grpclib.server import Server
from support.grpcstubs import StubModules
from support.nodes import gpu, node
from support.waiting import eventually

from gpuagent.domain.serving import ResourceView
from gpuagent.domain.store import DeviceStore
from gpuagent.kubelet.plugin import DevicePluginService


def _waiters() -> list[asyncio.Task[object]]:
    """Pending tasks waiting for a newer snapshot (a stream's waiter, whatever its name)."""
    return [
        task
        for task in asyncio.all_tasks()
        if not task.done() and "wait_newer" in getattr(task.get_coro(), "__qualname__", "")
    ]


async def test_the_streams_waiter_is_gone_right_after_the_client_leaves(
    short_tmp_path: Path, grpc_stubs: StubModules
) -> None:
    store = DeviceStore(node(gpu(0), gpu(1)))
    service = DevicePluginService(store, ResourceView(store), "nvidia.com/gpu", asyncio.Event())
    socket = short_tmp_path / "plugin.sock"
    server = Server([service])
    await server.start(path=str(socket))
    opened = asyncio.Event()
    loop = asyncio.get_running_loop()

    def kubelet_reads_one_list_then_leaves() -> int:
        # Its own connection (not grpcio's shared pool), closed on the way out: the client leaves.
        options = [("grpc.use_local_subchannel_pool", 1)]
        with grpc.insecure_channel(f"unix:{socket}", options=options) as channel:
            stub = grpc_stubs.dp_grpc.DevicePluginStub(channel)
            call = stub.ListAndWatch(grpc_stubs.dp_pb2.Empty())
            first = next(call)
            loop.call_soon_threadsafe(opened.set)
            call.cancel()
            return len(first.devices)

    try:
        client = asyncio.create_task(asyncio.to_thread(kubelet_reads_one_list_then_leaves))
        await opened.wait()
        # While the stream is open, its waiter waits for the next snapshot.
        await eventually(_waiters, what="the stream's waiter")
        assert await client == 2
        await eventually(lambda: service.open_streams == 0, what="the stream closing")
        await asyncio.sleep(0)  # one turn of the loop for the cancelled waiter to finish
        # No store change since: on the old code the waiter stayed pending until the next one.
        assert _waiters() == []
        assert [t for t in asyncio.all_tasks() if t.get_name().startswith("list-and-watch")] == []
    finally:
        server.close()
        await server.wait_closed()
