"""The agent's own part of an ``Allocate`` in process (one part of ``scripts/bench``; also runs
alone: ``python scripts/bench_answers.py``).

The round trip through the kubelet stand-in (``bench_plugin.py``) repeats a few device sets, so
nearly every call there is answered from the answers kept per device set, and what it measures is
grpclib's and h2's part. Here the device plugin's ``allocate`` is called directly, on 8 simulated
GPUs, for each device set of one to three GPUs (92 of them) as if never asked before (the kept
responses are forgotten before each call, as for a pod whose devices no container had before; the
pieces of their wire form, kept per device set, are not), and for a set asked before. Median of
``passes`` passes over the 92 sets, each call's time averaged within a pass.
"""

from __future__ import annotations

import asyncio
import itertools
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from benchlib import Row, table
from support.nodes import gpu, gpu_uuid, node

from gpuagent import logs
from gpuagent._proto import v1beta1 as pb
from gpuagent.domain.containers import ContainerSettings
from gpuagent.domain.serving import ResourceView
from gpuagent.kubelet.answers import ResponseCodec
from gpuagent.kubelet.plugin import DevicePluginService
from gpuagent.state.store import DeviceStore

__all__ = ["allocate_micros", "rows"]


async def allocate_micros(*, device_specs: bool, fresh: bool, passes: int = 15) -> float:
    """Microseconds per ``allocate`` and the encoding of its answer (median of ``passes``)."""
    store = DeviceStore(node(*(gpu(i) for i in range(8))))
    plan = store.plan
    containers = ContainerSettings(pass_device_specs=device_specs)
    store.publish(replace(plan, serving=replace(plan.serving, containers=containers)))
    service = DevicePluginService(store, ResourceView(), "nvidia.com/gpu", asyncio.Event())
    codec = ResponseCodec(service.encoded)
    sets = [c for k in (1, 2, 3) for c in itertools.combinations(range(8), k)]
    requests = [
        pb.AllocateRequest(
            container_requests=[pb.ContainerAllocateRequest(devices_ids=[gpu_uuid(i) for i in c])]
        )
        for c in sets
    ]
    kept = service._answers  # the bench's look inside: the responses kept are forgotten below
    for request in requests:
        await service.allocate(request)
    timings = []
    for _ in range(passes):
        started = time.perf_counter()
        for request in requests:
            if fresh:
                kept._responses.clear()
                kept._encoded.clear()
            codec.encode(await service.allocate(request), pb.AllocateResponse)
        timings.append((time.perf_counter() - started) / len(requests) * 1e6)
    return statistics.median(timings)


def rows() -> list[Row]:
    logs.configure("json", "warning")  # (an "allocated" line per call would be measured too)
    out = []
    for specs in (False, True):
        shape = "8 GPUs" + (", --pass-device-specs" if specs else "")
        fresh = asyncio.run(allocate_micros(device_specs=specs, fresh=True))
        again = asyncio.run(allocate_micros(device_specs=specs, fresh=False))
        out.append(Row(f"Allocate, agent's part in process: a device set not asked before, {shape}",
                       f"{fresh:.1f} us", "", None))  # fmt: skip
        out.append(Row(f"Allocate, agent's part in process: a device set asked before, {shape}",
                       f"{again:.1f} us", "", None))  # fmt: skip
    return out


if __name__ == "__main__":
    print(table(rows()))
