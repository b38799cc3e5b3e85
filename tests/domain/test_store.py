"""The device store: versions, change detection and watchers."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from gpuagent.domain.devices import Snapshot
from gpuagent.domain.store import DeviceStore


def test_update_bumps_version_only_on_change() -> None:
    store = DeviceStore()
    first = store.update(lambda s: replace(s, discovered=True))
    assert first.version == 1
    again = store.update(lambda s: replace(s, discovered=True))
    assert again is first


def test_snapshots_are_immutable_values() -> None:
    store = DeviceStore()
    before = store.snapshot
    store.update(lambda s: replace(s, registered=True))
    assert before.registered is False
    assert store.snapshot.registered is True


async def test_watchers_wake_on_change() -> None:
    store = DeviceStore()
    waiters = [asyncio.create_task(store.wait_newer(0)) for _ in range(3)]
    await asyncio.sleep(0)
    assert not any(w.done() for w in waiters)
    store.update(lambda s: replace(s, registered=True))
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
