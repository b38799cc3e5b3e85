"""The device store: versions, change detection, the plan in the snapshot, and watches."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
from support.clock import ManualClock
from support.nodes import gpu, node
from support.waiting import eventually

from gpuagent.domain.devices import Registration, Telemetry
from gpuagent.domain.plan import Plan
from gpuagent.domain.preferred import SharedAllocationPolicy
from gpuagent.domain.serving import ServingPolicy
from gpuagent.domain.snapshot import Snapshot
from gpuagent.state.counters import ApiReach
from gpuagent.state.store import DeviceStore, Keyed, per_snapshot

GPU = "nvidia.com/gpu"


def test_update_bumps_version_only_on_change() -> None:
    store = DeviceStore()
    first = store.update(lambda s: replace(s, discovered=True))
    assert first.version == 1
    again = store.update(lambda s: replace(s, discovered=True))
    assert again is first


def test_snapshots_are_immutable_values() -> None:
    store = DeviceStore()
    before = store.snapshot
    store.set_registration(GPU, Registration(registered=True))
    assert before.registered is False
    assert store.snapshot.registered is True


def test_registered_means_every_resource_served_is() -> None:
    store = DeviceStore()
    states = [store.snapshot.registered]  # nothing served yet
    store.set_registration(GPU, Registration(registered=True))
    store.set_registration("nvidia.com/mig-1g.10gb", Registration(error="kubelet unreachable"))
    states.append(store.snapshot.registered)
    store.set_registration("nvidia.com/mig-1g.10gb", None)  # withdrawn
    states.append(store.snapshot.registered)
    assert states == [False, False, True]
    assert set(store.snapshot.registrations) == {GPU}


def test_an_allocation_is_news_for_its_reader_not_a_new_snapshot() -> None:
    """An Allocate answered wakes the pod-resources client (the flag it waits on and clears),
    and no consumer of the node's state: the version stays."""
    store = DeviceStore()
    version = store.snapshot.version
    store.allocated()
    assert store.allocations.is_set()
    assert store.snapshot.version == version
    store.allocations.clear()  # (its one reader, once it has looked)
    assert not store.allocations.is_set()


def test_dras_status_is_kept_by_its_owners() -> None:
    """The DRA plugin's registration and the devices published, each said by its owner; the
    registration says DRA is on."""
    store = DeviceStore()
    said = [(store.snapshot.dra_registration, store.snapshot.dra_published)]
    store.set_dra_registration(Registration())
    said.append((store.snapshot.dra_registration, store.snapshot.dra_published))
    store.set_dra_published(frozenset({"gpu-1"}))
    store.set_dra_registration(Registration(registered=True))
    said.append((store.snapshot.dra_registration, store.snapshot.dra_published))
    assert said == [
        (None, None),
        (Registration(), None),
        (Registration(registered=True), frozenset({"gpu-1"})),
    ]


def test_publish_bumps_the_generation_only_for_a_different_plan() -> None:
    store = DeviceStore()
    version = store.snapshot.version
    assert store.publish(Plan()) is None
    assert (store.plan.generation, store.snapshot.version) == (0, version)
    shared = Plan(serving=ServingPolicy(shared_allocation=SharedAllocationPolicy.PACKED))
    published = store.publish(shared)
    assert published is store.plan
    assert store.plan.generation == 1
    assert store.plan.serving == shared.serving
    assert store.snapshot.plan is published  # the plan is read from the snapshot, one version
    assert store.snapshot.version == version + 1
    assert store.publish(replace(shared, generation=7)) is None  # generations aside, equal


def test_counters_are_read_as_one_copy() -> None:
    store = DeviceStore()
    store.counters.allocated()
    store.counters.nvml_call("init", 0.5, failed=False)
    store.counters.nvml_call("init", 0.25, failed=True)
    store.counters.reloaded("invalid")
    read = store.counters.read()
    assert read.allocations == 1
    assert [(c.call, c.count, c.seconds, c.errors) for c in read.nvml] == [("init", 2, 0.75, 1)]
    assert read.reloads.invalid == 1
    assert read.reloads.last_successful is False
    store.counters.reloaded("unchanged")
    assert store.counters.read().reloads.last_successful is True


def test_api_writers_say_whether_they_reach_the_api_server() -> None:
    """Each API writer puts what its last calls found into the counters; /metrics and /readyz
    read it there (nothing calls back into the writer)."""
    store = DeviceStore()
    assert dict(store.counters.read().api) == {}
    down = ApiReach(up=False, backing_off=True, error="API server unreachable: refused")
    store.counters.api_reached("node_health", down)
    store.counters.api_reached("resource_slices", ApiReach(up=True))
    assert store.counters.read().api["node_health"] == down
    seen = store.counters.api_reach()
    store.counters.api_reached("node_health", ApiReach(up=True))
    assert seen["node_health"] == down  # a copy: what was said then
    assert store.counters.api_reach()["node_health"] == ApiReach(up=True)


def test_an_unchanged_plan_is_not_compared_by_value(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every update compares the whole snapshot: the plan, the same object from one snapshot to
    the next, by identity first."""
    packed = ServingPolicy(shared_allocation=SharedAllocationPolicy.PACKED)
    store = DeviceStore(plan=Plan(serving=packed))
    compared: list[object] = []
    by_value = Plan.__eq__

    def counting(self: Plan, other: object) -> bool:
        compared.append(other)
        return by_value(self, other)

    monkeypatch.setattr(Plan, "__eq__", counting)
    store.update(lambda s: replace(s, discovered=True))
    store.update(lambda s: replace(s, discovered=True))  # unchanged: compared, not stored
    assert compared == []
    assert store.snapshot.version == 1


# ----- watches -----------------------------------------------------------------------------------


async def test_a_watch_gives_its_projection_at_once_then_only_its_changes() -> None:
    store = DeviceStore(node(gpu(0)))
    seen: list[int] = []

    def health(snapshot: Snapshot) -> tuple[bool, ...]:
        seen.append(snapshot.version)
        return tuple(g.health.healthy for g in snapshot.gpus)

    watch = store.watch(health)
    assert watch.version == -1
    assert await anext(watch) == (True,)  # the current snapshot's, at once
    assert watch.version == store.snapshot.version
    waiting = asyncio.create_task(anext(watch))
    await eventually(lambda: store.waiting == 1, what="the watch waiting")
    store.update(lambda s: _with_reading(s, 40.0))  # a new version, the same projection
    await eventually(lambda: seen[-1] == store.snapshot.version, what="the reading projected")
    assert not waiting.done()
    assert watch.version == store.snapshot.version  # looked at, though nothing was given
    store.update(lambda s: _with_reading(s, 41.0))
    store.update(lambda s: _with_reading(s, 42.0))  # two versions before the watch's turn
    store.update(lambda s: replace(s, gpus=(gpu(0, healthy=False),)))
    assert await waiting == (False,)
    assert seen == [1, 2, 5]  # the latest version only


async def test_one_change_wakes_every_watch_and_no_change_wakes_none() -> None:
    store = DeviceStore()
    watches = [store.watch(lambda s: s.discovered) for _ in range(3)]
    for watch in watches:
        await anext(watch)
    waiting = [asyncio.create_task(anext(watch)) for watch in watches]
    await eventually(lambda: store.waiting == 3, what="three watches waiting")
    store.update(lambda s: s)  # nothing changes: no new version, nobody woken
    assert store.waiting == 3
    store.update(lambda s: replace(s, discovered=True))
    assert store.waiting == 0
    assert await asyncio.gather(*waiting) == [True, True, True]


async def test_a_slow_consumer_sees_the_latest_projection_not_a_queue() -> None:
    store = DeviceStore()
    projected: list[int] = []

    def count(snapshot: Snapshot) -> int:
        projected.append(snapshot.version)
        return len(snapshot.registrations)

    watch = store.watch(count)
    assert await anext(watch) == 0
    for n in range(5):  # while the consumer is busy elsewhere
        store.set_registration(f"r{n}", Registration())
    assert await anext(watch) == 5
    assert projected == [0, 5]


async def test_nothing_waits_after_a_consumer_stops_or_is_cancelled() -> None:
    store = DeviceStore()
    async for _ in store.watch(lambda s: s.discovered):
        break  # nothing waits between two values
    assert store.waiting == 0
    watch = store.watch(lambda s: s.discovered)
    await anext(watch)
    waiting = asyncio.create_task(anext(watch))
    await eventually(lambda: store.waiting == 1, what="the watch waiting")
    waiting.cancel()
    await asyncio.wait({waiting})
    assert store.waiting == 0
    # A cancelled wait (asyncio.timeout's, too) leaves the watch usable.
    store.update(lambda s: replace(s, discovered=True))
    assert await anext(watch) is True


async def test_a_watch_until_an_event_ends_when_it_is_set() -> None:
    store = DeviceStore()
    stopping = asyncio.Event()
    stopping.set()
    given = [v async for v in store.watch(lambda s: s.discovered, until=stopping)]
    assert given == [False]  # the first value anyway, then the end
    stopping.clear()
    watch = store.watch(lambda s: s.discovered, until=stopping)
    await anext(watch)
    ended = asyncio.create_task(anext(watch))
    await eventually(lambda: store.waiting == 1, what="the watch waiting")
    stopping.set()
    with pytest.raises(StopAsyncIteration):
        await ended
    assert store.waiting == 0  # and its wait for the event is gone (no task left behind)


async def test_a_watch_with_a_deadline_gives_the_value_as_it_is_when_the_deadline_comes() -> None:
    clock = ManualClock()
    store = DeviceStore()
    watch = store.watch(lambda s: s.discovered, clock=clock)
    await anext(watch)
    given: list[tuple[float, bool]] = []

    async def follow() -> None:  # as a consumer does: each value, then a deadline 10 s on
        while True:
            given.append((clock.now(), await watch.next(clock.now() + 10.0)))

    task = asyncio.create_task(follow())
    try:
        await eventually(lambda: clock.waiting == 1, what="the watch waiting for its deadline")
        store.update(lambda s: replace(s, gpus=(gpu(0),)))  # a change its projection misses
        await clock.advance(9.0)
        assert given == []
        await clock.advance(1.0)
        assert given == [(0.0, False)]  # unchanged, given at the deadline
        store.update(lambda s: replace(s, discovered=True))
        await eventually(lambda: len(given) == 2, what="the change")
        assert given[1] == (10.0, True)
    finally:
        task.cancel()
        await asyncio.wait({task})
    assert (clock.waiting, store.waiting) == (0, 0)
    assert await watch.next(5.0) is True  # a deadline already past: at once, nothing waits


async def test_a_change_before_the_deadline_is_given_at_once_and_the_wait_ends() -> None:
    clock = ManualClock()
    store = DeviceStore()
    watch = store.watch(lambda s: s.discovered, clock=clock)
    await anext(watch)
    waiting = asyncio.create_task(watch.next(3600.0))
    await eventually(lambda: clock.waiting == 1, what="the watch waiting for its deadline")
    store.update(lambda s: replace(s, discovered=True))
    assert await waiting is True
    assert (clock.waiting, store.waiting) == (0, 0)  # no timer left behind


async def test_a_wait_with_a_deadline_cancelled_or_ended_leaves_nothing_waiting() -> None:
    clock = ManualClock()
    store = DeviceStore()
    stopping = asyncio.Event()
    watch = store.watch(lambda s: s.discovered, until=stopping, clock=clock)
    await anext(watch)
    waiting = asyncio.create_task(watch.next(60.0))
    await eventually(lambda: clock.waiting == 1, what="the watch waiting for its deadline")
    waiting.cancel()
    await asyncio.wait({waiting})
    assert (clock.waiting, store.waiting) == (0, 0)
    ended = asyncio.create_task(watch.next(60.0))  # still usable
    await eventually(lambda: clock.waiting == 1, what="the watch waiting again")
    stopping.set()
    with pytest.raises(StopAsyncIteration):
        await ended
    assert (clock.waiting, store.waiting) == (0, 0)


async def test_now_reads_the_current_projection_and_later_values_change_from_it() -> None:
    store = DeviceStore()
    watch = store.watch(lambda s: s.discovered)
    await anext(watch)
    store.update(lambda s: replace(s, discovered=True))
    assert watch.now() is True
    waiting = asyncio.create_task(anext(watch))  # no change from what now() gave: it waits
    await eventually(lambda: store.waiting == 1, what="the watch waiting")
    waiting.cancel()
    await asyncio.wait({waiting})


def test_a_derivation_per_snapshot_runs_once_for_each_snapshot() -> None:
    store = DeviceStore()
    derived: list[int] = []

    def version(snapshot: Snapshot) -> int:
        derived.append(snapshot.version)
        return snapshot.version

    shared = per_snapshot(version)
    assert [shared(store.snapshot), shared(store.snapshot)] == [0, 0]  # two consumers, once
    store.update(lambda s: replace(s, discovered=True))
    assert shared(store.snapshot) == 1
    assert derived == [0, 1]


def test_a_keyed_projection_compares_by_its_key_alone() -> None:
    assert Keyed(1, "a") == Keyed(1, "b")
    assert Keyed(1, "a") != Keyed(2, "a")


def _with_reading(snapshot: Snapshot, temperature: float) -> Snapshot:
    gpus = tuple(replace(g, telemetry=Telemetry(temperature_c=temperature)) for g in snapshot.gpus)
    return replace(snapshot, gpus=gpus)
