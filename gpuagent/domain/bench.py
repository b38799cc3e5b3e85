"""Synthetic nodes and a timing loop for ``GetPreferredAllocation`` (for ``scripts/bench``).

Pure and seeded: the same arguments replay the same requests. Timings use ``perf_counter``.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass

from gpuagent.domain.devices import Gpu, Link, P2PLevel, Snapshot, Topology
from gpuagent.domain.preferred import PairScores, SharedAllocationPolicy, preferred_allocation
from gpuagent.domain.resources import (
    ReplicaRule,
    ResourceSettings,
    TimeSlicing,
    build_resources,
)

__all__ = ["PreferredTiming", "bench_preferred", "island_node"]


def island_node(gpus: int, *, islands: int = 2, seed: int = 0) -> Snapshot:
    """``gpus`` GPUs in NVLink islands, one per NUMA node, with uneven link counts.

    Within an island every pair has 2 to 6 NVLinks (seeded), so scores differ and the search
    cannot prune on ties; across islands the GPUs share only the SMP interconnect.
    """
    rng = random.Random(seed)
    per_island = max(1, gpus // islands)
    island = [min(i // per_island, islands - 1) for i in range(gpus)]
    devices = tuple(
        Gpu(
            index=i,
            uuid=f"GPU-{i:08x}-0000-4000-8000-{i:012x}",
            minor=i,
            name="NVIDIA H100 80GB HBM3",
            memory_mib=81559,
            pci_bus_id=f"00000000:{0x18 + i:02x}:00.0",
            numa_node=island[i],
        )
        for i in range(gpus)
    )
    links = []
    for a in range(gpus):
        for b in range(a + 1, gpus):
            same = island[a] == island[b]
            links.append(
                Link(
                    a,
                    b,
                    p2p=P2PLevel.NODE if same else P2PLevel.SYSTEM,
                    nvlinks=rng.randint(2, 6) if same else 0,
                )
            )
    return Snapshot(gpus=devices, topology=Topology(links=tuple(links)))


@dataclass(frozen=True, slots=True)
class PreferredTiming:
    """Milliseconds per ``preferred_allocation`` call over a seeded mix of requests."""

    gpus: int
    replicas: int
    calls: int
    p50_ms: float
    p99_ms: float
    max_ms: float


def bench_preferred(
    gpus: int = 8,
    *,
    replicas: int = 0,
    calls: int = 500,
    seed: int = 0,
    policy: SharedAllocationPolicy = SharedAllocationPolicy.DISTRIBUTED,
) -> PreferredTiming:
    """Time ``preferred_allocation`` as the kubelet would call it on an :func:`island_node`.

    Each call takes a random share of the node as already allocated, a random size up to what
    is left (at least half the time half the node or more, the expensive case) and up to two
    must-include devices. With ``replicas`` every GPU is time-sliced that many times.
    """
    snapshot = island_node(gpus, seed=seed)
    sharing = TimeSlicing(resources=(ReplicaRule("nvidia.com/gpu", replicas),) if replicas else ())
    (resource,) = build_resources(snapshot, ResourceSettings(time_slicing=sharing)).resources
    scores = PairScores.of(snapshot)
    rng = random.Random(seed)
    ids = list(resource.ids)
    samples: list[float] = []
    for _ in range(calls):
        free = [i for i in ids if rng.random() > 0.25] or ids[:1]
        must = rng.sample(free, k=min(len(free), rng.randint(0, 2)))
        if rng.random() < 0.5:
            size = rng.randint(max(1, len(free) // 2), len(free))
        else:
            size = rng.randint(1, len(free))
        size = min(size, gpus) if replicas else size
        started = time.perf_counter()
        preferred_allocation(resource, scores, free, must, max(size, len(must)), policy=policy)
        samples.append(time.perf_counter() - started)
    samples.sort()
    return PreferredTiming(
        gpus=gpus,
        replicas=replicas,
        calls=calls,
        p50_ms=statistics.median(samples) * 1000,
        p99_ms=samples[min(len(samples) - 1, round(0.99 * (len(samples) - 1)))] * 1000,
        max_ms=samples[-1] * 1000,
    )
