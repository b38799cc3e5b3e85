"""Timing ``GetPreferredAllocation``'s search on synthetic nodes (one part of ``scripts/bench``).

Seeded: the same arguments replay the same requests. Timings use ``perf_counter``.
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from support.nodes import island_node

from gpuagent.domain.preferred import (
    PairScores,
    SharedAllocationPolicy,
    preferred_allocation,
)
from gpuagent.domain.resources import ResourceSettings, build_resources
from gpuagent.domain.timeslicing import ReplicaRule, TimeSlicing

__all__ = ["PreferredTiming", "bench_preferred"]


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
