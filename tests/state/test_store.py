"""The device store: versions, change detection and watchers."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from gpuagent.domain.devices import Registration
from gpuagent.domain.plan import Plan
from gpuagent.domain.preferred import SharedAllocationPolicy
from gpuagent.domain.serving import ServingPolicy
from gpuagent.domain.snapshot import Snapshot
from gpuagent.state.store import DeviceStore

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


async def test_watchers_wake_on_change() -> None:
    store = DeviceStore()
    waiters = [asyncio.create_task(store.wait_newer(0)) for _ in range(3)]
    await asyncio.sleep(0)
    assert not any(w.done() for w in waiters)
    store.update(lambda s: replace(s, discovered=True))
    results = await asyncio.gather(*waiters)
    assert {r.version for r in results} == {1}


async def test_wait_newer_returns_at_once_when_already_newer() -> None:
    store = DeviceStore(Snapshot(version=5))
    assert (await store.wait_newer(3)).version == 5


async def test_unchanged_update_does_not_wake_watchers() -> None:
    store = DeviceStore()
    waiter = asyncio.create_task(store.wait_newer(0))
    store.update(lambda s: s)
    await asyncio.sleep(0)
    assert not waiter.done()
    waiter.cancel()
