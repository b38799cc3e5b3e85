"""DRA's device-health stream on a clock the test moves: the full list at once, again on every
change, and again every ``resend_s`` while nothing changes (so the kubelet's timeout never
fires); ended when the agent stops."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from support.clock import ManualClock
from support.nodes import gpu, node
from support.waiting import eventually

from gpuagent.domain.devices import Condition, GpuHealth
from gpuagent.domain.dra import DraGpus, dra_devices
from gpuagent.dra.health import DeviceHealthStreams, HealthList
from gpuagent.dra.service import DraConfig
from gpuagent.state.store import DeviceStore


async def test_the_list_is_sent_on_each_change_and_again_every_resend_s() -> None:
    clock = ManualClock()
    store = DeviceStore(node(gpu(0), gpu(1)))
    stopping = asyncio.Event()
    streams = DeviceHealthStreams(
        store,
        lambda s: dra_devices(s, DraGpus(all=True)),
        DraConfig("gpu.nvidia.com", "node"),
        stopping,
        resend_s=20.0,
        waits=clock,
    )
    sent: list[tuple[float, HealthList]] = []

    async def kubelet() -> None:
        async for devices in streams.updates():
            sent.append((clock.now(), devices))

    task = asyncio.create_task(kubelet())
    await eventually(lambda: clock.waiting == 1, what="the stream waiting")
    healthy = sent[0][1]
    assert [at for at, _ in sent] == [0.0]
    assert all(ok for _, ok, _ in healthy)

    await clock.advance(19.0)
    assert len(sent) == 1
    await clock.advance(1.0)
    assert sent[1] == (20.0, healthy)  # unchanged: sent again when the kubelet would time out

    await clock.advance(5.0)
    failed = GpuHealth((Condition("xid", "79"),))
    store.update(lambda s: replace(s, gpus=(replace(s.gpus[0], health=failed), s.gpus[1])))
    await eventually(lambda: len(sent) == 3, what="the change sent")
    assert sent[2][0] == 25.0
    assert [ok for _, ok, _ in sent[2][1]] == [False, True]
    await clock.advance(19.0)
    assert len(sent) == 3  # the resend counts from the last list sent
    await clock.advance(1.0)
    assert sent[3] == (45.0, sent[2][1])

    stopping.set()
    await asyncio.wait_for(task, 10)  # a deadline for a broken build: the event ends it
    assert (clock.waiting, store.waiting, streams.open_streams) == (0, 0, 0)
