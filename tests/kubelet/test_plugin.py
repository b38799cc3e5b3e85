"""The DevicePlugin service: nothing of a stream outlives it; Allocate answers from a cache that
follows health and the plan."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
from grpclib import GRPCError
from grpclib.const import Status
from support.grpcstubs import StubModules
from support.nodes import gpu, gpu_uuid, node
from support.waiting import eventually

from gpuagent._proto import v1beta1 as pb
from gpuagent.domain.containers import ContainerSettings, DeviceListStrategy
from gpuagent.domain.devices import Telemetry
from gpuagent.domain.serving import ResourceView
from gpuagent.kubelet.answers import MAX_CACHED_RESPONSES, ResponseCodec
from gpuagent.kubelet.plugin import DevicePluginService
from gpuagent.sockets.grpcserver import GrpcServer
from gpuagent.state.store import DeviceStore


def _event_waits() -> list[asyncio.Task[object]]:
    """Pending tasks waiting for an event (a stream's wait for the agent's stop)."""
    return [
        task
        for task in asyncio.all_tasks()
        if not task.done() and getattr(task.get_coro(), "__qualname__", "") == "Event.wait"
    ]


async def test_the_streams_waiter_is_gone_right_after_the_client_leaves(
    short_tmp_path: Path, grpc_stubs: StubModules
) -> None:
    store = DeviceStore(node(gpu(0), gpu(1)))
    service = DevicePluginService(store, ResourceView(), "nvidia.com/gpu", asyncio.Event())
    socket = short_tmp_path / "plugin.sock"
    server = GrpcServer([service])
    await server.start(path=str(socket))
    opened = asyncio.Event()
    leave = threading.Event()
    loop = asyncio.get_running_loop()

    def kubelet_reads_one_list_then_leaves() -> int:
        # Its own connection (not grpcio's shared pool), closed on the way out: the client leaves.
        options = [("grpc.use_local_subchannel_pool", 1)]
        with grpc.insecure_channel(f"unix:{socket}", options=options) as channel:
            stub = grpc_stubs.dp_grpc.DevicePluginStub(channel)
            call = stub.ListAndWatch(grpc_stubs.dp_pb2.Empty())
            first = next(call)
            loop.call_soon_threadsafe(opened.set)
            leave.wait(30)
            call.cancel()
            return len(first.devices)

    try:
        client = asyncio.create_task(asyncio.to_thread(kubelet_reads_one_list_then_leaves))
        await opened.wait()
        try:
            # While the stream is open, its watch waits for the next snapshot or the agent's
            # stop.
            await eventually(lambda: store.waiting == 1, what="the stream's watch waiting")
            assert len(_event_waits()) == 1
        finally:
            leave.set()
        assert await client == 2
        await eventually(lambda: service.open_streams == 0, what="the stream closing")
        await asyncio.sleep(0)  # one turn of the loop for the cancelled wait to finish
        # No store change since: an older stream's waiter stayed pending until the next one.
        assert store.waiting == 0
        assert _event_waits() == []
    finally:
        server.close()
        await server.wait_closed()
        # grpclib leaves the client's connection open; a loop closed with it open fails (uvloop:
        # EBUSY) when grpcio's own close of the channel has not reached the socket yet.
        server.drop_connections()


# ----- Allocate responses, cached per request ----------------------------------------------------


def _service(store: DeviceStore) -> DevicePluginService:
    return DevicePluginService(store, ResourceView(), "nvidia.com/gpu", asyncio.Event())


def _request(*ids: str) -> pb.AllocateRequest:
    return pb.AllocateRequest(
        container_requests=[pb.ContainerAllocateRequest(devices_ids=list(ids))]
    )


def _envs(response: pb.AllocateResponse) -> dict[str, str]:
    return dict(response.container_responses[0].envs)


async def test_a_repeated_request_is_answered_from_its_encoded_response() -> None:
    store = DeviceStore(node(gpu(0), gpu(1)))
    service = _service(store)
    codec = ResponseCodec(service.encoded)
    first = await service.allocate(_request(gpu_uuid(0)))
    again = await service.allocate(_request(gpu_uuid(0)))
    assert again is first
    assert codec.encode(again, pb.AllocateResponse) == bytes(first)
    other = await service.allocate(_request(gpu_uuid(1)))
    assert _envs(other)["NVIDIA_VISIBLE_DEVICES"] == gpu_uuid(1)
    assert codec.encode(pb.AllocateResponse(), pb.AllocateResponse) == b""  # not cached: encoded
    # Telemetry alone (every poll) changes no response.
    store.update(lambda s: replace(s, gpus=tuple(replace(g, telemetry=Telemetry(temperature_c=70))
                                                 for g in s.gpus)))  # fmt: skip
    assert await service.allocate(_request(gpu_uuid(0))) is first
    assert store.counters.read().allocations == 4


async def test_a_device_turning_unhealthy_is_refused_though_its_answer_was_cached() -> None:
    store = DeviceStore(node(gpu(0), gpu(1)))
    service = _service(store)
    await service.allocate(_request(gpu_uuid(0)))
    store.update(lambda s: replace(s, gpus=(gpu(0, healthy=False), s.gpus[1])))
    with pytest.raises(GRPCError) as refused:
        await service.allocate(_request(gpu_uuid(0)))
    assert refused.value.status == Status.FAILED_PRECONDITION


async def test_a_reloaded_plan_changes_the_cached_answer() -> None:
    store = DeviceStore(node(gpu(0)))
    service = _service(store)
    before = await service.allocate(_request(gpu_uuid(0)))
    assert "NVIDIA_VISIBLE_DEVICES" in _envs(before)
    plan = store.plan
    containers = ContainerSettings(strategies=(DeviceListStrategy.VOLUME_MOUNTS,))
    store.publish(replace(plan, serving=replace(plan.serving, containers=containers)))
    after = await service.allocate(_request(gpu_uuid(0)))
    assert after is not before
    assert _envs(after)["NVIDIA_VISIBLE_DEVICES"] == "/var/run/nvidia-container-devices"


async def test_the_cache_is_bounded() -> None:
    store = DeviceStore(node(*(gpu(i) for i in range(9))))
    service = _service(store)
    ids = [gpu_uuid(i) for i in range(9)]
    for size in range(1, 10):
        for start in range(9):
            for _ in range(2):
                await service.allocate(_request(*(ids[(start + k) % 9] for k in range(size))))
    assert len(service._answers._responses) <= MAX_CACHED_RESPONSES
    assert len(service._answers._encoded) == len(service._answers._responses)
