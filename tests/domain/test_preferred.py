"""GetPreferredAllocation: topology search on asymmetric nodes, replica and MIG placement."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.nodes import gpu, gpu_uuid, island_node, link, mig, mig_uuid, node

from gpuagent.domain.devices import P2PLevel
from gpuagent.domain.preferred import (
    PairScores,
    SharedAllocationPolicy,
    _Search,
    best_gpu_set,
    preferred_allocation,
)
from gpuagent.domain.resources import MigStrategy, Resource, ResourceSettings, build_resources
from gpuagent.domain.snapshot import Snapshot
from gpuagent.domain.timeslicing import ReplicaRule, TimeSlicing

SYS, NODE_, HB, MULTI, SW = (
    P2PLevel.SYSTEM,
    P2PLevel.NODE,
    P2PLevel.HOSTBRIDGE,
    P2PLevel.MULTIPLE,
    P2PLevel.SINGLE,
)
DISTRIBUTED, PACKED = SharedAllocationPolicy.DISTRIBUTED, SharedAllocationPolicy.PACKED


def full(snapshot: Snapshot) -> Resource:
    (resource,) = build_resources(snapshot).resources
    return resource


def ask(
    snapshot: Snapshot,
    available: Sequence[int] | None,
    must: Sequence[int],
    size: int,
) -> list[int]:
    """Preferred GPUs by index, asking in UUIDs as the kubelet does."""
    resource = full(snapshot)
    avail = [gpu_uuid(g.index) for g in snapshot.gpus] if available is None else available
    ids = [gpu_uuid(i) if isinstance(i, int) else i for i in avail]
    got = preferred_allocation(
        resource, PairScores.of(snapshot), ids, [gpu_uuid(i) for i in must], size
    )
    by_uuid = {d.uuid: d.gpu for d in resource.devices}
    return [by_uuid[i] for i in got]


# ----- pair scores ------------------------------------------------------------------------------
def test_pair_scores_follow_nvidia() -> None:
    snapshot = node(
        gpu(0, numa=0), gpu(1, numa=0), gpu(2, numa=1), gpu(3),
        links=[link(0, 1, 4, NODE_), link(0, 2, 0, SYS), link(1, 2, 2, None), link(2, 3, 0, SW)],
    )  # fmt: skip
    scores = PairScores.of(snapshot)
    assert scores.score(0, 1) == 420  # 4 NVLinks + same CPU
    assert scores.score(1, 0) == 420
    assert scores.score(0, 2) == 10  # across CPUs
    assert scores.score(1, 2) == 210  # 2 NVLinks, P2P level unknown: NUMA says across
    assert scores.score(2, 3) == 50  # one PCIe switch
    assert scores.score(0, 3) == 0  # no link, no NUMA node: the worst
    assert scores.score(0, 0) == 0
    assert scores.score(0, 9) == 0  # a GPU lost since discovery


def test_missing_pairs_score_by_numa_node() -> None:
    scores = PairScores.of(node(gpu(0, numa=0), gpu(1, numa=0), gpu(2, numa=1)))
    assert (scores.score(0, 1), scores.score(0, 2)) == (20, 10)


# ----- asymmetric topologies ----------------------------------------------------------------------
def islands() -> Snapshot:
    """Two NVLink islands of four (4 links per pair), one per NUMA node; PCIe across."""
    gpus = [gpu(i, numa=i // 4) for i in range(8)]
    links = [
        link(a, b, 4, NODE_) if a // 4 == b // 4 else link(a, b, 0, SYS)
        for a, b in itertools.combinations(range(8), 2)
    ]
    return node(*gpus, links=links)


def pcie_only() -> Snapshot:
    """No NVLink: 0-1 and 2-3 behind one switch each, the switches on one host bridge."""
    links = [link(0, 1, 0, SW), link(2, 3, 0, SW)] + [
        link(a, b, 0, HB) for a in (0, 1) for b in (2, 3)
    ]
    return node(*(gpu(i, numa=0) for i in range(4)), links=links)


def numa_split() -> Snapshot:
    """No topology at all: NUMA nodes alternate 0, 1, 0, 1."""
    return node(*(gpu(i, numa=i % 2) for i in range(4)))


def nvlink_across_numa() -> Snapshot:
    """GPU 0's NVLink peer is GPU 2 across the SMP link; GPU 1 shares its NUMA node via PCIe."""
    return node(
        gpu(0, numa=0), gpu(1, numa=0), gpu(2, numa=1), gpu(3, numa=1),
        links=[link(0, 2, 2, SYS), link(0, 1, 0, NODE_), link(1, 3, 0, SYS),
               link(0, 3, 0, SYS), link(1, 2, 0, SYS), link(2, 3, 0, NODE_)],
    )  # fmt: skip


def chain() -> Snapshot:
    """NVLink chain 0-1-2-3 (4 links each hop); other pairs PCIe, one NUMA node."""
    links = [link(0, 1, 4, NODE_), link(1, 2, 4, NODE_), link(2, 3, 4, NODE_)]
    links += [link(a, b, 0, NODE_) for a, b in ((0, 2), (0, 3), (1, 3))]
    return node(*(gpu(i, numa=0) for i in range(4)), links=links)


@pytest.mark.parametrize(
    ("snapshot", "available", "must", "size", "expected"),
    [
        pytest.param(islands(), None, [], 4, [0, 1, 2, 3], id="islands-whole-island"),
        pytest.param(islands(), None, [], 2, [0, 1], id="islands-pair-lowest"),
        pytest.param(
            islands(), [0, 1, 2, 3, 4, 5], [], 2, [4, 5],
            id="islands-take-the-broken-island-keep-the-whole-one",
        ),
        pytest.param(islands(), None, [5], 2, [5, 4], id="islands-must-include-peer"),
        pytest.param(islands(), None, [5], 4, [5, 4, 6, 7], id="islands-must-include-island"),
        pytest.param(islands(), None, [], 5, [0, 1, 2, 3, 4], id="islands-spill-over"),
        pytest.param(
            islands(), [0, 2, 4, 5, 6], [], 2, [0, 2],
            id="islands-take-the-pair-leave-the-three-together",
        ),
        pytest.param(islands(), None, [1, 6], 3, [1, 6, 0], id="islands-two-musts-lowest"),
        pytest.param(pcie_only(), None, [], 2, [0, 1], id="pcie-switch-pair"),
        pytest.param(pcie_only(), None, [2], 2, [2, 3], id="pcie-must-include-switch-peer"),
        pytest.param(pcie_only(), [0, 2, 3], [], 2, [2, 3], id="pcie-switch-pair-left"),
        pytest.param(numa_split(), None, [], 2, [0, 2], id="numa-same-node"),
        pytest.param(numa_split(), None, [1], 2, [1, 3], id="numa-must-include"),
        pytest.param(numa_split(), [0, 1, 3], [], 2, [1, 3], id="numa-whole-pair-left"),
        pytest.param(nvlink_across_numa(), None, [0], 2, [0, 2], id="nvlink-beats-numa"),
        pytest.param(chain(), None, [], 2, [0, 1], id="chain-end-pair-not-middle"),
        pytest.param(chain(), [1, 2, 3], [], 2, [1, 2], id="chain-linked-pair"),
        pytest.param(chain(), [0, 2, 3], [], 2, [2, 3], id="chain-linked-pair-left"),
    ],
)  # fmt: skip
def test_chosen_sets(
    snapshot: Snapshot,
    available: list[int] | None,
    must: list[int],
    size: int,
    expected: list[int],
) -> None:
    assert ask(snapshot, available, must, size) == expected


def test_lost_gpu_is_not_in_available_and_breaks_nothing() -> None:
    """A GPU lost after discovery: unhealthy, absent from available, still in the topology."""
    snapshot = islands()
    lost = node(*(g if g.index != 1 else gpu(1, numa=0, healthy=False) for g in snapshot.gpus),
                links=snapshot.topology.links)  # fmt: skip
    assert ask(lost, [0, 2, 3, 4, 5, 6, 7], [], 3) == [0, 2, 3]


def test_gpu_missing_from_topology_scores_as_the_worst_link() -> None:
    snapshot = islands()
    partial = node(*snapshot.gpus, gpu(8), links=snapshot.topology.links)
    assert ask(partial, [0, 1, 8], [8], 2) == [8, 0]  # every pair with 8 is unknown: lowest


@pytest.mark.parametrize(
    ("available", "must", "size", "expected"),
    [
        pytest.param([0, 1, 2], [], 0, [], id="size-zero"),
        pytest.param([0, 1, 2], [], -1, [], id="size-negative"),
        pytest.param([0, 1], [2, 0], 1, [2, 0], id="must-include-larger-than-size"),
        pytest.param([3, 1], [], 5, [1, 3], id="fewer-available-than-size"),
        pytest.param([], [], 2, [], id="nothing-available"),
        pytest.param(["GPU-gone", 2, "junk"], [], 1, [2], id="unknown-ids-skipped"),
        pytest.param([2, 2, 3], [], 2, [2, 3], id="duplicates-in-available"),
    ],
)
def test_never_fails(available: list[int | str], must: list[int], size: int,
                     expected: list[int]) -> None:  # fmt: skip
    snapshot = islands()
    resource = full(snapshot)
    ids = [gpu_uuid(i) if isinstance(i, int) else i for i in available]
    got = preferred_allocation(
        resource, PairScores.of(snapshot), ids, [gpu_uuid(i) for i in must], size
    )
    assert got == [gpu_uuid(i) for i in expected]


def test_unknown_must_include_is_kept_as_given() -> None:
    snapshot = islands()
    got = preferred_allocation(
        full(snapshot), PairScores.of(snapshot), [gpu_uuid(4)], ["GPU-gone"], 2
    )
    assert got == ["GPU-gone", gpu_uuid(4)]


# ----- replicas and MIG -----------------------------------------------------------------------
def replicated(snapshot: Snapshot, replicas: int) -> Resource:
    sharing = TimeSlicing(resources=(ReplicaRule("gpu", replicas),))
    (resource,) = build_resources(snapshot, ResourceSettings(time_slicing=sharing)).resources
    return resource


def r(g: int, n: int) -> str:
    return f"{gpu_uuid(g)}::{n}"


TWO = node(gpu(0, numa=0), gpu(1, numa=0))
FOUR = node(
    *(gpu(i, numa=i // 2) for i in range(4)),
    links=[link(2, 3, 6, NODE_), link(0, 1, 2, NODE_)]
    + [link(a, b, 0, SYS) for a in (0, 1) for b in (2, 3)],
)


@pytest.mark.parametrize(
    ("snapshot", "available", "must", "size", "policy", "expected"),
    [
        pytest.param(
            TWO, [r(0, 2), r(0, 3), r(1, 0), r(1, 1), r(1, 2), r(1, 3)], [], 2, DISTRIBUTED,
            [r(1, 0), r(1, 1)], id="distributed-least-allocated-gpu",
        ),
        pytest.param(
            TWO, [r(0, 2), r(0, 3), r(1, 0), r(1, 1), r(1, 2), r(1, 3)], [], 2, PACKED,
            [r(0, 2), r(0, 3)], id="packed-most-allocated-gpu",
        ),
        pytest.param(
            TWO, [r(0, n) for n in range(4)] + [r(1, n) for n in range(4)], [], 2, DISTRIBUTED,
            [r(0, 0), r(1, 0)], id="distributed-spreads-ties",
        ),
        pytest.param(
            TWO, [r(0, n) for n in range(4)] + [r(1, n) for n in range(4)], [], 3, PACKED,
            [r(0, 0), r(0, 1), r(0, 2)], id="packed-stays-on-one-gpu",
        ),
        pytest.param(
            FOUR, [r(g, n) for g in range(4) for n in range(2)], [r(2, 0)], 2, DISTRIBUTED,
            [r(2, 0), r(3, 0)], id="distributed-tie-broken-by-nvlink-to-must-include",
        ),
        pytest.param(
            FOUR, [r(g, n) for g in range(4) for n in range(2)], [r(0, 1)], 2, DISTRIBUTED,
            [r(0, 1), r(1, 0)], id="distributed-tie-broken-by-nvlink-other-island",
        ),
        pytest.param(
            FOUR, [r(g, n) for g in range(4) for n in range(2)], [r(0, 1)], 2, PACKED,
            [r(0, 1), r(0, 0)], id="packed-must-include-counts-as-allocated",
        ),
    ],
)  # fmt: skip
def test_replica_placement(
    snapshot: Snapshot,
    available: list[str],
    must: list[str],
    size: int,
    policy: SharedAllocationPolicy,
    expected: list[str],
) -> None:
    resource = replicated(snapshot, 4 if snapshot is TWO else 2)
    got = preferred_allocation(
        resource, PairScores.of(snapshot), available, must, size, policy=policy
    )
    assert got == expected


MIG_NODE = node(
    gpu(0, numa=0, migs=[mig(0, 7), mig(0, 8), mig(0, 9)]),
    gpu(1, numa=0, migs=[mig(1, 7), mig(1, 8), mig(1, 9)]),
)


@pytest.mark.parametrize(
    ("policy", "size", "expected"),
    [
        (DISTRIBUTED, 1, [mig_uuid(1, 8)]),
        (DISTRIBUTED, 2, [mig_uuid(0, 9), mig_uuid(1, 8)]),
        (DISTRIBUTED, 3, [mig_uuid(0, 9), mig_uuid(1, 8), mig_uuid(1, 9)]),
        (PACKED, 1, [mig_uuid(0, 9)]),
        (PACKED, 2, [mig_uuid(0, 9), mig_uuid(1, 8)]),
    ],
)
def test_mig_placement(policy: SharedAllocationPolicy, size: int, expected: list[str]) -> None:
    """GPU 0 has two of its three 1g devices allocated, GPU 1 one."""
    (resource,) = build_resources(
        MIG_NODE, ResourceSettings(mig_strategy=MigStrategy.MIXED)
    ).resources
    available = [mig_uuid(0, 9), mig_uuid(1, 8), mig_uuid(1, 9)]
    got = preferred_allocation(
        resource, PairScores.of(MIG_NODE), available, [], size, policy=policy
    )
    assert got == expected


# ----- exactness and properties ----------------------------------------------------------------
def brute_force(scores: PairScores, cands: list[int], fixed: list[int], need: int) -> list[int]:
    """The lowest-indexed set of maximum value, by trying every set."""
    search = _Search(scores, cands, fixed)
    best = max(
        itertools.combinations(range(len(cands)), need),
        key=lambda combo: (search.value(combo), [-i for i in combo]),
    )
    return [cands[i] for i in best]


@st.composite
def topologies(draw: st.DrawFn, max_gpus: int = 9) -> Snapshot:
    n = draw(st.integers(1, max_gpus))
    gpus = [gpu(i, numa=draw(st.sampled_from([None, 0, 1]))) for i in range(n)]
    links = []
    for a, b in itertools.combinations(range(n), 2):
        if draw(st.booleans()):
            links.append(
                link(a, b, draw(st.integers(0, 18)), draw(st.sampled_from([None, *P2PLevel])))
            )
    return node(*gpus, links=links)


@settings(max_examples=150, deadline=None)
@given(data=st.data(), snapshot=topologies())
def test_search_finds_the_lowest_indexed_optimum(data: st.DataObject, snapshot: Snapshot) -> None:
    n = len(snapshot.gpus)
    fixed = data.draw(st.lists(st.integers(0, n - 1), unique=True, max_size=2))
    cands = [i for i in range(n) if i not in fixed]
    if not cands:
        return
    need = data.draw(st.integers(1, len(cands)))
    scores = PairScores.of(snapshot)
    expected = brute_force(scores, cands, fixed, need) if need < len(cands) else cands
    assert best_gpu_set(scores, cands, fixed, need) == expected


@st.composite
def requests(draw: st.DrawFn) -> tuple[Snapshot, Resource, list[str], list[str], int]:
    snapshot = draw(topologies(max_gpus=10))
    replicas = draw(st.sampled_from([0, 0, 2, 3]))
    resource = replicated(snapshot, replicas) if replicas else full(snapshot)
    ids = list(resource.ids)
    available = draw(st.lists(st.sampled_from([*ids, "GPU-junk", "x::1"]), max_size=len(ids) + 2))
    known = [i for i in dict.fromkeys(available) if i in ids]
    must = draw(st.lists(st.sampled_from(known), unique=True, max_size=3)) if known else []
    size = draw(st.integers(-1, len(ids) + 2))
    return snapshot, resource, available, must, size


@settings(max_examples=300, deadline=None)
@given(
    request=requests(),
    policy=st.sampled_from(list(SharedAllocationPolicy)),
    shuffle=st.randoms(use_true_random=False),
)
def test_preferred_properties(
    request: tuple[Snapshot, Resource, list[str], list[str], int],
    policy: SharedAllocationPolicy,
    shuffle: object,
) -> None:
    snapshot, resource, available, must, size = request
    scores = PairScores.of(snapshot)
    got = preferred_allocation(resource, scores, available, must, size, policy=policy)
    known = {i for i in available if resource.device(i) is not None} | set(must)
    assert got[: len(must)] == must  # must-include first, all of it
    assert len(got) == len(set(got))
    assert set(got) <= known  # only available (or must-include) IDs
    assert len(got) == max(len(must), min(size, len(known)))
    # Deterministic, whatever the order the kubelet lists available devices in.
    again = list(available)
    shuffle.shuffle(again)  # type: ignore[attr-defined]
    assert preferred_allocation(resource, scores, again, must, size, policy=policy) == got


def test_island_node_shape() -> None:
    snapshot = island_node(16)
    assert len(snapshot.gpus) == 16
    assert len(snapshot.topology.links) == 16 * 15 // 2
    assert {g.numa_node for g in snapshot.gpus} == {0, 1}
