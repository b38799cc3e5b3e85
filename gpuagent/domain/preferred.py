"""``GetPreferredAllocation``: which devices to advise, from the cached topology, in milliseconds.

**Full GPUs.** Pairs are scored as NVIDIA's go-gpuallocator scores them (§3.8 of the reference):
100 per direct NVLink plus the PCIe path — 60 same board, 50 one switch, 40 several switches,
30 host bridge, 20 same NUMA node, 10 across NUMA nodes. A pair the topology does not cover (a
GPU lost since discovery, a driver without P2P data) scores by NUMA node alone, or 0 — the worst
link — when that is unknown too. A set's score is the sum over its pairs.

NVIDIA enumerates every partition of the available GPUs to pick the best set "for the node as a
whole" (16 to 30 s per call for 8 GPUs, their #774). Here the chosen set ``S`` (must-include plus
the picks) maximises ``10 * score(S) - cut(S)``, where ``cut(S)`` sums the pair scores between
``S`` and the available GPUs left over: among sets nearly as good for this request it takes the
one that leaves the rest of the node best connected — a 2-GPU request takes the two GPUs of a
partly used NVLink island rather than break up a whole one the next 4-GPU request needs. The
objective is quadratic in the picks, so it is searched exactly: a beam search finds a strong set,
then branch and bound (with that set as the bound) proves it optimal or finds the optimum, within
a fixed budget of search nodes. Ties go to the lowest GPU indexes. Deterministic, pure.

**Replicas and MIG devices.** NVIDIA's placement policies over the physical GPUs:
``distributed`` takes the GPU with the fewest allocated devices of the resource, ``packed`` the
one with the most (devices of the resource not in ``available`` count as allocated); ties go to
the GPU this request has taken fewest from, then to the best link to GPUs already chosen, then
to the lowest index.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType

from gpuagent.domain.devices import Device, NodeState, P2PLevel
from gpuagent.domain.resources import Resource

__all__ = [
    "LINK_SCORES",
    "NVLINK_SCORE",
    "PairScores",
    "SharedAllocationPolicy",
    "best_gpu_set",
    "preferred_allocation",
]

NVLINK_SCORE = 100
LINK_SCORES: Mapping[P2PLevel, int] = MappingProxyType(
    {
        P2PLevel.SYSTEM: 10,  # P2PLinkCrossCPU
        P2PLevel.NODE: 20,  # P2PLinkSameCPU
        P2PLevel.HOSTBRIDGE: 30,
        P2PLevel.MULTIPLE: 40,
        P2PLevel.SINGLE: 50,
        P2PLevel.INTERNAL: 60,  # P2PLinkSameBoard
    }
)
# Weights of the objective: EDGE * score(S) - CUT * cut(S). The request's own links weigh ten times
# as much as what it leaves behind.
EDGE_WEIGHT = 10
CUT_WEIGHT = 1
BEAM_WIDTH = 32
NODE_BUDGET = 4000  # branch-and-bound nodes; beyond it the best set found so far stands


class SharedAllocationPolicy(StrEnum):
    """Placement of replicas and MIG devices (``--shared-devices-allocation-policy``)."""

    DISTRIBUTED = "distributed"
    PACKED = "packed"


def _frozen_pairs() -> Mapping[tuple[int, int], int]:
    return MappingProxyType({})


@dataclass(frozen=True, slots=True)
class PairScores:
    """A score for every pair of GPUs (by index), from a snapshot's topology and NUMA nodes.

    Built once per topology (it changes only at discovery) and asked per request.
    """

    numa: Mapping[int, int | None] = field(default_factory=lambda: MappingProxyType({}))
    links: Mapping[tuple[int, int], int] = field(default_factory=_frozen_pairs)

    @classmethod
    def of(cls, snapshot: NodeState) -> PairScores:
        numa = {gpu.index: gpu.numa_node for gpu in snapshot.gpus}
        links: dict[tuple[int, int], int] = {}
        for link in snapshot.topology.links:
            a, b = min(link.a, link.b), max(link.a, link.b)
            pcie = LINK_SCORES[link.p2p] if link.p2p is not None else None
            if pcie is None:
                pcie = _numa_score(numa.get(a), numa.get(b))
            links[a, b] = NVLINK_SCORE * max(link.nvlinks, 0) + pcie
        return cls(numa=MappingProxyType(numa), links=MappingProxyType(links))

    def score(self, a: int, b: int) -> int:
        if a == b:
            return 0
        key = (a, b) if a < b else (b, a)
        found = self.links.get(key)
        if found is not None:
            return found
        return _numa_score(self.numa.get(a), self.numa.get(b))


def _numa_score(a: int | None, b: int | None) -> int:
    if a is None or b is None:
        return 0
    return LINK_SCORES[P2PLevel.NODE] if a == b else LINK_SCORES[P2PLevel.SYSTEM]


def preferred_allocation(
    resource: Resource,
    scores: PairScores,
    available: Sequence[str],
    must_include: Sequence[str],
    size: int,
    *,
    policy: SharedAllocationPolicy = SharedAllocationPolicy.DISTRIBUTED,
) -> list[str]:
    """Advice for the kubelet: ``size`` IDs from ``available`` including ``must_include``.

    Never raises: IDs the resource does not know are skipped (a must-include ID is kept as
    given), and the answer is shorter than ``size`` when too few devices are available. The
    must-include IDs come first, then the picks in device order.
    """
    must = list(dict.fromkeys(must_include))
    if size <= len(must):
        return must
    taken = set(must)
    candidates = [
        device
        for i in dict.fromkeys(available)
        if i not in taken and (device := resource.device(i)) is not None
    ]
    need = size - len(must)
    position = {d.id: n for n, d in enumerate(resource.devices)}
    if len(candidates) <= need:
        return must + [d.id for d in sorted(candidates, key=lambda d: position[d.id])]
    fixed = [device for i in must if (device := resource.device(i)) is not None]
    if any(d.is_replica or d.is_mig for d in (*candidates, *fixed)):
        picks = _place_shared(resource, scores, candidates, fixed, need=need, policy=policy)
    else:
        by_gpu = {d.gpu: d for d in candidates}
        chosen = best_gpu_set(scores, sorted(by_gpu), [d.gpu for d in fixed], need)
        picks = [by_gpu[g] for g in chosen]
    return must + [d.id for d in sorted(picks, key=lambda d: position[d.id])]


def best_gpu_set(
    scores: PairScores,
    candidates: Sequence[int],
    fixed: Sequence[int],
    need: int,
    *,
    beam_width: int = BEAM_WIDTH,
    node_budget: int = NODE_BUDGET,
) -> list[int]:
    """``need`` GPUs from ``candidates`` to join ``fixed``, best by the module's objective.

    Returns GPU indexes in ascending order; all of ``candidates`` when ``need`` covers them.
    """
    cands = sorted(dict.fromkeys(c for c in candidates if c not in set(fixed)))
    if need <= 0:
        return []
    if len(cands) <= need:
        return cands
    search = _Search(scores, cands, fixed)
    incumbent, value = search.beam(need, beam_width)
    incumbent, value = search.improve(incumbent, value)
    best = search.branch_and_bound(need, incumbent, value, node_budget)
    return [cands[i] for i in best]


class _Search:
    """The objective over candidate positions 0..n-1 (candidates in index order).

    value(T) = K * (sum of w(i, j) over pairs in T) + (sum of a(i) over T) + a constant, with
    K = EDGE + 2 * CUT and a(i) = (EDGE + CUT) * w(i, fixed) - CUT * w(i, candidates): the
    expansion of EDGE * score(fixed + T) - CUT * cut(fixed + T, candidates - T).
    """

    def __init__(self, scores: PairScores, cands: Sequence[int], fixed: Sequence[int]) -> None:
        n = len(cands)
        self.n = n
        self.k = EDGE_WEIGHT + 2 * CUT_WEIGHT
        self.w = [[scores.score(a, b) for b in cands] for a in cands]
        self.kw = [[self.k * x for x in row] for row in self.w]
        self.a = [
            (EDGE_WEIGHT + CUT_WEIGHT) * sum(scores.score(c, f) for f in fixed)
            - CUT_WEIGHT * sum(self.w[i])
            for i, c in enumerate(cands)
        ]
        # The largest pair weight among positions >= i, for the bound on pairs still to pick.
        self.suffix_max = [0] * (n + 1)
        for i in range(n - 1, -1, -1):
            row_max = max(self.kw[i][i + 1 :], default=0)
            self.suffix_max[i] = max(self.suffix_max[i + 1], row_max)

    def value(self, chosen: Sequence[int]) -> int:
        total = sum(self.a[i] for i in chosen)
        for x, i in enumerate(chosen):
            row = self.kw[i]
            total += sum(row[j] for j in chosen[x + 1 :])
        return total

    def gains(self, chosen: Sequence[int]) -> list[int]:
        gains = list(self.a)
        for i in chosen:
            row = self.kw[i]
            gains = [g + x for g, x in zip(gains, row, strict=True)]
        return gains

    def beam(self, need: int, width: int) -> tuple[tuple[int, ...], int]:
        """A strong set, built one GPU at a time keeping the ``width`` best partial sets."""
        states: list[tuple[int, tuple[int, ...], list[int]]] = [(0, (), list(self.a))]
        for _ in range(need):
            children: dict[tuple[int, ...], tuple[int, int, int]] = {}
            for s, (value, chosen, gains) in enumerate(states):
                members = set(chosen)
                for v in range(self.n):
                    if v not in members:
                        key = tuple(sorted((*chosen, v)))
                        if key not in children:
                            children[key] = (value + gains[v], s, v)
            best = heapq.nsmallest(width, children.items(), key=lambda kv: (-kv[1][0], kv[0]))
            states = [
                (value, key, [g + x for g, x in zip(states[s][2], self.kw[v], strict=True)])
                for key, (value, s, v) in best
            ]
        value, chosen, _ = states[0]
        return chosen, value

    def improve(self, chosen: tuple[int, ...], value: int) -> tuple[tuple[int, ...], int]:
        """Swap one member for one outsider while that strictly helps (a local optimum)."""
        members = list(chosen)
        gains = self.gains(members)
        while True:
            best_delta, best_swap = 0, None
            inside = set(members)
            for t in members:
                for c in range(self.n):
                    if c in inside:
                        continue
                    # value(T - t + c) - value(T): c joins T - t, t leaves T.
                    delta = gains[c] - self.kw[t][c] - gains[t]
                    if delta > best_delta:
                        best_delta, best_swap = delta, (t, c)
            if best_swap is None:
                return tuple(sorted(members)), value
            t, c = best_swap
            members[members.index(t)] = c
            value += best_delta
            gains = [g - xt + xc for g, xt, xc in zip(gains, self.kw[t], self.kw[c], strict=True)]

    def branch_and_bound(
        self, need: int, incumbent: tuple[int, ...], value: int, budget: int
    ) -> tuple[int, ...]:
        """The lowest-indexed optimal set, or the best seen once ``budget`` nodes are spent.

        Sets are visited in lexicographic order; the search starts just below the incumbent's
        value, so the first set reaching it is the lowest-indexed optimum, and only strictly
        better sets replace it after that.
        """
        best_value = value - 1
        best: tuple[int, ...] = incumbent
        found = False
        nodes = 0
        n, kw, suffix_max = self.n, self.kw, self.suffix_max

        def visit(start: int, chosen: list[int], current: int, gains: list[int]) -> None:
            nonlocal best_value, best, found, nodes
            left = need - len(chosen)
            if left == 0:
                if current > best_value:
                    best_value, best, found = current, tuple(chosen), True
                return
            nodes += 1
            if nodes > budget:
                return
            top = heapq.nlargest(left, gains[start:])
            bound = current + sum(top) + suffix_max[start] * (left * (left - 1) // 2)
            if bound <= best_value:
                return
            for v in range(start, n - left + 1):
                if nodes > budget:
                    return
                after = [g + x for g, x in zip(gains, kw[v], strict=True)]
                chosen.append(v)
                visit(v + 1, chosen, current + gains[v], after)
                chosen.pop()

        visit(0, [], 0, list(self.a))
        return best if found else incumbent


def _place_shared(
    resource: Resource,
    scores: PairScores,
    candidates: Sequence[Device],
    fixed: Sequence[Device],
    *,
    need: int,
    policy: SharedAllocationPolicy,
) -> list[Device]:
    """NVIDIA's greedy replica/MIG placement over physical GPUs, with topology tie-breaks."""
    total: dict[int, int] = {}
    for device in resource.devices:
        total[device.gpu] = total.get(device.gpu, 0) + 1
    queues: dict[int, list[Device]] = {}
    for device in candidates:
        queues.setdefault(device.gpu, []).append(device)
    position = {d.id: n for n, d in enumerate(resource.devices)}
    for queue in queues.values():
        queue.sort(key=lambda d: position[d.id], reverse=True)  # pop() takes the first
    allocated = {g: total.get(g, 0) - len(q) for g, q in queues.items()}
    picked = dict.fromkeys(queues, 0)
    affinity = dict.fromkeys(queues, 0)
    chosen_gpus: set[int] = set()

    def choose(gpu: int) -> None:
        if gpu not in chosen_gpus:
            chosen_gpus.add(gpu)
            for other in affinity:
                affinity[other] += scores.score(other, gpu)

    for device in fixed:
        if device.gpu in picked:
            picked[device.gpu] += 1
        choose(device.gpu)
    sign = 1 if policy is SharedAllocationPolicy.DISTRIBUTED else -1
    out: list[Device] = []
    for _ in range(need):
        gpu = min(
            (g for g, q in queues.items() if q),
            key=lambda g: (sign * allocated[g], picked[g], -affinity[g], g),
        )
        out.append(queues[gpu].pop())
        allocated[gpu] += 1
        picked[gpu] += 1
        choose(gpu)
    return out
