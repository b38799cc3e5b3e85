"""Reliability: many kubelet restarts, many streams, everything at once — and nothing leaks.

Short by default; ``TESTS_RELIABILITY_SCALE=5`` runs the long form (100 restarts, 1,000
streams, 10 s of mixed load).
"""

from __future__ import annotations

import asyncio
import os
import random
import threading
import time
from pathlib import Path
from typing import Any

import aiohttp
import grpc
from e2e.agentrun import RunningAgent, first_stream, registered_agent
from support.fake_kubelet import FakeKubelet
from support.grpcstubs import StubModules

SCALE = max(1, int(os.environ.get("TESTS_RELIABILITY_SCALE", "1")))
T = 10.0


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def settled(run: RunningAgent, baseline_fds: int, baseline_tasks: int) -> None:
    """Wait (bounded) for connections and tasks to wind down to their baseline."""
    del run  # the agent's own state is checked by the callers; this is about resources
    for _ in range(300):
        if open_fds() <= baseline_fds + 8 and len(asyncio.all_tasks()) <= baseline_tasks + 2:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(
        f"leak: fds {baseline_fds} → {open_fds()}, tasks {baseline_tasks} → "
        f"{len(asyncio.all_tasks())}: {[t.get_name() for t in asyncio.all_tasks()]}"
    )


def healthy_everywhere(update: Any) -> bool:
    return all(d.health == "Healthy" for d in update.devices)


async def test_many_kubelet_restarts(fake_kubelet: FakeKubelet, device_plugin_dir: Path) -> None:
    restarts = 20 * SCALE
    async with registered_agent(fake_kubelet, device_plugin_dir) as run:
        await asyncio.to_thread(fake_kubelet.latest().next_update, T)
        fds, tasks = open_fds(), len(asyncio.all_tasks())
        for n in range(2, restarts + 2):
            await asyncio.to_thread(fake_kubelet.restart)
            await asyncio.to_thread(fake_kubelet.wait_for_registrations, n, T)
        reg = fake_kubelet.latest()
        first = await asyncio.to_thread(reg.next_update, T)
        assert len(first.devices) == 4
        assert healthy_everywhere(first)
        await settled(run, fds, tasks)
        assert run.agent.liveness() is None


async def test_many_streams_opened_and_dropped(
    fake_kubelet: FakeKubelet, device_plugin_dir: Path, grpc_stubs: StubModules
) -> None:
    streams = 200 * SCALE
    async with registered_agent(fake_kubelet, device_plugin_dir) as run:
        fds, tasks = open_fds(), len(asyncio.all_tasks())
        target = f"unix://{device_plugin_dir / 'nvidia-gpu.sock'}"
        pb, rpc = grpc_stubs.dp_pb2, grpc_stubs.dp_grpc

        def churn() -> int:
            seen = 0
            for _ in range(streams // 20):
                with grpc.insecure_channel(target) as channel:
                    stub = rpc.DevicePluginStub(channel)
                    for _ in range(20):
                        call = stub.ListAndWatch(pb.Empty(), timeout=T)
                        first = next(call)
                        seen += len(first.devices) == 4
                        call.cancel()
            return seen

        assert await asyncio.to_thread(churn) == streams // 20 * 20
        await settled(run, fds, tasks)
        # The kubelet's own stream is untouched and still tells the truth.
        await run.fault({"gpu": 0, "fault": "xid", "xid": 79})
        update = await asyncio.to_thread(
            fake_kubelet.latest().wait_until, lambda u: not healthy_everywhere(u), T
        )
        assert [d.health for d in update.devices].count("Unhealthy") == 1


async def test_scrapes_allocations_and_faults_at_once(
    fake_kubelet: FakeKubelet, device_plugin_dir: Path
) -> None:
    seconds = 2.0 * SCALE
    async with registered_agent(fake_kubelet, device_plugin_dir) as run:
        reg = await first_stream(fake_kubelet)
        uuids = run.uuids
        fds, tasks = open_fds(), len(asyncio.all_tasks())
        deadline = time.monotonic() + seconds
        stop = threading.Event()
        counts = {"allocations": 0, "refusals": 0, "scrapes": 0, "faults": 0}
        refusal_codes: set[Any] = set()

        def allocate() -> None:
            rng = random.Random(7)
            while not stop.is_set():
                chosen = rng.sample(uuids, rng.randint(1, 2))
                try:
                    fake_kubelet.allocate(chosen)
                    counts["allocations"] += 1
                except grpc.RpcError as error:
                    refusal_codes.add(error.code())
                    counts["refusals"] += 1

        async def scrape(http: aiohttp.ClientSession) -> None:
            while time.monotonic() < deadline:
                async with http.get(run.base_url + "/metrics") as response:
                    assert response.status == 200
                    assert "gpuagent_gpus 4" in await response.text()
                counts["scrapes"] += 1

        async def faults() -> None:
            rng = random.Random(11)
            while time.monotonic() < deadline:
                gpu = rng.randrange(4)
                body: dict[str, object] = rng.choice(
                    [{"fault": "xid", "xid": 79}, {"fault": "ecc_dbe"}, {"fault": "recover"}]
                )
                status, _ = await run.fault({"gpu": gpu, **body})
                assert status == 200
                counts["faults"] += 1
                await asyncio.sleep(0.01)

        allocator = asyncio.create_task(asyncio.to_thread(allocate))
        try:
            # Scrapers keep their own connections, closed before resources are counted again.
            async with aiohttp.ClientSession() as http:
                await asyncio.gather(scrape(http), scrape(http), faults())
        finally:
            stop.set()
            await allocator
        for gpu in range(4):
            await run.fault({"gpu": gpu, "fault": "recover"})
        final = await asyncio.to_thread(reg.wait_until, healthy_everywhere, T)
        assert {d.ID for d in final.devices} == set(uuids)
        assert all(g.health.healthy for g in run.agent.store.snapshot.gpus)
        assert refusal_codes <= {grpc.StatusCode.FAILED_PRECONDITION}  # unhealthy, nothing else
        assert counts["allocations"] > 0
        assert counts["scrapes"] > 0
        assert counts["faults"] > 0
        await settled(run, fds, tasks)
