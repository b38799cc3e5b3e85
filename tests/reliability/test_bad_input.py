"""Bad input over every surface: each gets a clear error and the agent keeps serving."""

from __future__ import annotations

import asyncio
import os
import socket
import stat
from pathlib import Path
from typing import Any

import aiohttp
import grpc
from e2e.agentrun import RunningAgent, registered_agent, running_agent
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.fake_kubelet import FakeKubelet

from gpuagent.app.agent import Agent
from gpuagent.app.parts.http import Http
from gpuagent.config import load_settings
from gpuagent.gpu.sim import SimDriver, installed, node_from_count

SharedAgent = tuple[RunningAgent, FakeKubelet, asyncio.AbstractEventLoop]
"""The ``shared_agent`` fixture: the agent, its kubelet stand-in and the agent's loop."""


def fuzzed(examples: int) -> settings:
    """Hypothesis settings for a test of ``examples`` inputs against the shared agent (no
    deadline: the agent answers on its own loop; the fixture is shared on purpose)."""
    return settings(
        max_examples=examples,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )


T = 10.0
SOCKET = "nvidia-gpu.sock"


async def serving(run: RunningAgent, kubelet: FakeKubelet) -> None:
    """The agent still answers the kubelet and HTTP after whatever a test did to it."""
    uuid = run.uuids[0]
    response = await asyncio.to_thread(kubelet.allocate, [uuid])
    assert dict(response.container_responses[0].envs) == {"NVIDIA_VISIBLE_DEVICES": uuid}
    assert (await run.get("/healthz"))[0] == 200
    assert run.agent.liveness() is None


async def test_ten_thousand_unknown_ids_get_a_bounded_invalid_argument(
    fake_kubelet: FakeKubelet, device_plugin_dir: Path
) -> None:
    async with registered_agent(fake_kubelet, device_plugin_dir) as run:
        ids = [f"GPU-bogus-{i:05d}" for i in range(10_000)]
        code, details = await asyncio.to_thread(fake_kubelet.allocate_error, ids)
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert "GPU-bogus-00000" in details
        assert "truncated" in details
        assert len(details) < 2048
        await serving(run, fake_kubelet)


async def test_oversized_id_is_refused(fake_kubelet: FakeKubelet, device_plugin_dir: Path) -> None:
    async with registered_agent(fake_kubelet, device_plugin_dir) as run:
        code, _ = await asyncio.to_thread(fake_kubelet.allocate_error, ["X" * 1_000_000])
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        await serving(run, fake_kubelet)


async def test_empty_and_duplicate_requests(
    fake_kubelet: FakeKubelet, device_plugin_dir: Path
) -> None:
    async with registered_agent(fake_kubelet, device_plugin_dir) as run:
        uuid = run.uuids[0]
        for ids in ([], [uuid, uuid]):
            code, _ = await asyncio.to_thread(fake_kubelet.allocate_error, ids)
            assert code == grpc.StatusCode.INVALID_ARGUMENT
        # A request with no container requests at all.
        stub = fake_kubelet.latest().stub
        pb = fake_kubelet.stubs.dp_pb2

        def call() -> Any:
            try:
                stub.Allocate(pb.AllocateRequest(), timeout=T)
            except grpc.RpcError as error:
                return error.code()
            return None

        assert await asyncio.to_thread(call) == grpc.StatusCode.INVALID_ARGUMENT
        await serving(run, fake_kubelet)


@fuzzed(40)
@given(ids=st.lists(st.text(max_size=80), max_size=12))
def test_arbitrary_allocate_requests_never_break_the_plugin(
    shared_agent: SharedAgent, ids: list[str]
) -> None:
    run, kubelet, _ = shared_agent
    uuids = set(run.uuids)
    valid = bool(ids) and set(ids) <= uuids and len(set(ids)) == len(ids)
    if valid:
        assert kubelet.allocate(ids).container_responses
    else:
        code, _ = kubelet.allocate_error(ids)
        assert code == grpc.StatusCode.INVALID_ARGUMENT


async def test_garbage_and_half_open_connections_on_the_plugin_socket(
    fake_kubelet: FakeKubelet, device_plugin_dir: Path
) -> None:
    async with registered_agent(fake_kubelet, device_plugin_dir) as run:
        path = str(device_plugin_dir / SOCKET)

        def abuse() -> list[socket.socket]:
            held = []
            for payload in (b"\x00" * 64, os.urandom(4096), b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"):
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.connect(path)
                s.sendall(payload)
                s.close()
            for _ in range(20):  # half-open: connect, say nothing, keep the connection
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.connect(path)
                held.append(s)
            return held

        held = await asyncio.to_thread(abuse)
        try:
            await serving(run, fake_kubelet)
            loop = asyncio.get_running_loop()
            started = loop.time()
            await run.shutdown()
            assert loop.time() - started < 2.0  # idle connections do not hold up shutdown
        finally:
            for s in held:
                s.close()


async def test_plugin_socket_is_not_world_writable(
    fake_kubelet: FakeKubelet, device_plugin_dir: Path
) -> None:
    async with running_agent(device_plugin_dir):
        await asyncio.to_thread(fake_kubelet.wait_for_registrations, 1, T)
        mode = (device_plugin_dir / SOCKET).stat().st_mode
        assert stat.S_ISSOCK(mode)
        assert not mode & stat.S_IWOTH
        assert not mode & stat.S_IROTH


async def test_malformed_http(device_plugin_dir: Path) -> None:
    async with running_agent(device_plugin_dir, ("--simulate", "2")) as run:
        host, port = "127.0.0.1", int(run.base_url.rsplit(":", 1)[1])

        async def raw(request: bytes) -> bytes:
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(request)
            await writer.drain()
            data = await asyncio.wait_for(reader.read(65536), T)
            writer.close()
            await writer.wait_closed()
            return data

        huge = b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n"
        assert (await raw(huge)).split(b" ", 2)[1] == b"400"
        assert (await raw(b"NONSENSE\r\n\r\n")).split(b" ", 2)[1] == b"400"
        odd = b"GET /metrics HTTP/1.1\r\nHost: x\r\nAccept: application/x-nonsense;q=7\r\n\r\n"
        response = await raw(odd)
        assert response.startswith(b"HTTP/1.1 200")
        assert b"version=0.0.4" in response
        # A client that starts a body and stalls does not block anyone else.
        _, writer = await asyncio.open_connection(host, port)
        writer.write(b'POST /sim/faults HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{"gpu":')
        await writer.drain()
        try:
            status, _ = await asyncio.wait_for(run.get("/healthz"), 2)
            assert status == 200
        finally:
            writer.close()
        big = {"gpu": 0, "fault": "xid", "xid": 79, "pad": "x" * 200_000}
        async with run.http.post(run.base_url + "/sim/faults", json=big) as too_big:
            assert too_big.status == 413
        assert run.sim.describe()[0]["xid_count"] == 0


async def test_sim_endpoints_are_absent_outside_simulation(
    device_plugin_dir: Path, tmp_path: Path
) -> None:
    """Without --simulate, /sim/* does not exist even though a driver answers."""
    settings = load_settings(
        ["--socket-dir", str(device_plugin_dir), "--metrics-address", "127.0.0.1:0"], {}
    )
    with installed(SimDriver(node_from_count(1))):
        agent = Agent(settings, simulator=None, node_name="h", sysfs_root=tmp_path)
        stop = asyncio.Event()
        task = asyncio.create_task(agent.run(stop))
        try:
            await asyncio.wait_for(agent.started.wait(), T)
            async with aiohttp.ClientSession() as http:
                base = f"http://127.0.0.1:{agent.part(Http).port}"
                async with http.get(base + "/sim/gpus") as response:
                    assert response.status == 404
                async with http.post(base + "/sim/faults", json={"gpu": 0, "fault": "lost"}) as r:
                    assert r.status in (404, 405)
                async with http.get(base + "/metrics") as response:
                    assert "gpuagent_gpus 1" in await response.text()
        finally:
            stop.set()
            await asyncio.wait_for(task, T)


@fuzzed(40)
@given(
    available=st.lists(st.text(max_size=60), max_size=12),
    must=st.lists(st.text(max_size=60), max_size=4),
    size=st.integers(min_value=-5, max_value=20),
)
def test_arbitrary_preferred_allocation_requests_are_answered(
    shared_agent: SharedAgent,
    available: list[str],
    must: list[str],
    size: int,
) -> None:
    """GetPreferredAllocation is advice: whatever the request, an answer and never an error."""
    run, kubelet, _ = shared_agent
    uuids = run.uuids
    chosen = kubelet.preferred([*available, *uuids[:2]], must, size)
    assert set(chosen) <= {*available, *uuids[:2], *must}
    assert len(chosen) == len(set(chosen))
    assert set(must) <= set(chosen) or size <= 0 or len(set(must)) > size


@fuzzed(20)
@given(ids=st.lists(st.text(max_size=80), max_size=8))
def test_arbitrary_pre_start_requests_are_answered(
    shared_agent: SharedAgent, ids: list[str]
) -> None:
    _, kubelet, _ = shared_agent
    assert kubelet.pre_start(ids).ByteSize() == 0
