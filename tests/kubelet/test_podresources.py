"""The pod-resources client against a grpcio stand-in of the kubelet's pod-resources server."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
from support.clock import ManualClock
from support.fake_podresources import Claimed, FakePodResources, Held
from support.grpcstubs import StubModules
from support.synthetic import gpu_uuid, mig_uuid, synthetic_snapshot
from support.tasks import running
from support.waiting import eventually

from gpuagent.domain.attribution import Target, attributions, by_device
from gpuagent.domain.devices import Attribution, PodRef
from gpuagent.domain.snapshot import Snapshot
from gpuagent.kubelet.podresources import MAX_RESPONSE_BYTES, PodResourcesClient
from gpuagent.state.store import DeviceStore

GPU = "nvidia.com/gpu"
T = 10.0


@pytest.fixture
def socket_path(short_tmp_path: Path) -> Path:
    return short_tmp_path / "pod-resources" / "kubelet.sock"


@pytest.fixture
def kubelet(socket_path: Path, grpc_stubs: StubModules) -> Iterator[FakePodResources]:
    with FakePodResources(socket_path, grpc_stubs) as fake:
        yield fake


def mapping(snapshot: Snapshot) -> dict[str, tuple[PodRef, ...]]:
    """The snapshot's pods of the resources a default plan serves, by device ID."""
    return dict(by_device(snapshot.pods.allocated, (GPU,)))


def counts(store: DeviceStore) -> tuple[int, int, bool]:
    """(requests, errors, socket present) as the client counted them."""
    stats = store.counters.read().pod_resources
    assert stats is not None
    return stats.requests, stats.errors, stats.socket_present


@contextlib.asynccontextmanager
async def connected(
    socket_path: Path, gpus: int = 1, *, max_response_bytes: int = MAX_RESPONSE_BYTES
) -> AsyncIterator[tuple[DeviceStore, PodResourcesClient]]:
    """A store of ``gpus`` synthetic GPUs and a client of ``socket_path`` for it (closed after)."""
    store = DeviceStore(synthetic_snapshot(gpus))
    client = PodResourcesClient(store, socket_path, max_response_bytes=max_response_bytes)
    try:
        yield store, client
    finally:
        client.close()


def held(pod: str, *ids: str, resource: str = GPU, container: str = "main") -> Held:
    return Held("ns", pod, container, resource, ids)


async def test_list_maps_served_devices(kubelet: FakePodResources, socket_path: Path) -> None:
    kubelet.set([
        held("a", gpu_uuid(0)),
        held("b", gpu_uuid(1) + "::0", gpu_uuid(1) + "::1"),
        held("c", "fpga-0", resource="example.com/fpga"),
        held("m", mig_uuid(2, 7), resource="nvidia.com/mig-1g.10gb"),
    ])  # fmt: skip
    async with connected(socket_path, 2) as (store, client):
        assert await client.refresh() is True
        pods = store.snapshot.pods
        assert mapping(store.snapshot) == {
            gpu_uuid(0): (PodRef("ns", "a", "main"),),
            gpu_uuid(1) + "::0": (PodRef("ns", "b", "main"),),
            gpu_uuid(1) + "::1": (PodRef("ns", "b", "main"),),
            mig_uuid(2, 7): (PodRef("ns", "m", "main"),),
        }
        assert pods.refreshed_at is not None
        assert pods.error == ""
        found = attributions(store.snapshot, mapping(store.snapshot))
        assert found[Target(1)] == (PodRef("ns", "b", "main"),)
        assert await client.refresh() is False  # nothing changed
        assert counts(store)[:2] == (2, 0)
        assert kubelet.calls == 2


async def test_list_keeps_claimed_devices_apart(
    kubelet: FakePodResources, socket_path: Path
) -> None:
    """A container's ResourceClaim devices (``dynamic_resources``) are kept under their driver's
    ``dra:`` name: never taken for a device-plugin resource's devices."""
    kubelet.set([
        held("a", gpu_uuid(0)),
        Claimed("ns", "b", "main", "gpus", "gpu.nvidia.com", "node-1", "gpu-1"),
        Claimed("ns", "b", "main", "nics", "net.example.com", "node-1", "nic-0"),
    ])  # fmt: skip
    async with connected(socket_path, 2) as (store, client):
        assert await client.refresh() is True
        claimed = [a for a in store.snapshot.pods.allocated if a.pod == "b"]
        assert [(a.resource, a.device_ids) for a in claimed] == [
            ("dra:gpu.nvidia.com", ("gpu-1",)),
            ("dra:net.example.com", ("nic-0",)),
        ]
        assert mapping(store.snapshot) == {gpu_uuid(0): (PodRef("ns", "a", "main"),)}
        kubelet.set([held("a", gpu_uuid(0))])  # the claim released: a change
        assert await client.refresh() is True


async def test_socket_absent_keeps_mapping_and_logs_once(
    kubelet: FakePodResources, socket_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    kubelet.set([held("a", gpu_uuid(0))])
    async with connected(socket_path) as (store, client):
        await client.refresh()
        refreshed = store.snapshot.pods.refreshed_at
        kubelet.stop()
        assert not kubelet.running
        for _ in range(3):
            assert await client.refresh() is False
        pods = store.snapshot.pods
        assert pods.refreshed_at == refreshed
        assert gpu_uuid(0) in mapping(store.snapshot)
        assert "socket absent" in pods.error
        assert counts(store) == (1, 3, False)
        assert capsys.readouterr().out.count("socket absent") == 1
        kubelet.set([held("b", gpu_uuid(0))])
        kubelet.start()
        assert await client.refresh() is True
        assert store.snapshot.pods.error == ""
        assert mapping(store.snapshot)[gpu_uuid(0)] == (PodRef("ns", "b", "main"),)
        assert "works again" in capsys.readouterr().out


async def test_never_present_socket_is_not_an_error_loop(socket_path: Path) -> None:
    store = DeviceStore(synthetic_snapshot(1))
    clock = ManualClock()
    client = PodResourcesClient(store, socket_path, interval=0.05, clock=clock)
    async with running(client.run()):
        await eventually(lambda: clock.waiting == 1)
        await clock.advance(0.3)
    # One look at start and one per interval: no tight loop, no crash; no pod labels.
    requests, errors, present = counts(store)
    assert (requests, errors, present) == (0, 7, False)
    assert store.snapshot.pods.allocated == ()
    assert store.snapshot.pods.refreshed_at is None


async def test_kubelet_restart_reconnects(kubelet: FakePodResources, socket_path: Path) -> None:
    kubelet.set([held("a", gpu_uuid(0))])
    async with connected(socket_path) as (store, client):
        await client.refresh()
        kubelet.restart()  # a new socket file, the old connection is gone
        kubelet.set([held("z", gpu_uuid(0))])
        assert await client.refresh() is True
        assert mapping(store.snapshot)[gpu_uuid(0)] == (PodRef("ns", "z", "main"),)
        assert counts(store)[1] == 0


async def test_error_status_keeps_mapping(kubelet: FakePodResources, socket_path: Path) -> None:
    kubelet.set([held("a", gpu_uuid(0))])
    async with connected(socket_path) as (store, client):
        await client.refresh()
        kubelet.fail_with(grpc.StatusCode.RESOURCE_EXHAUSTED)
        assert await client.refresh() is False
        assert "RESOURCE_EXHAUSTED" in store.snapshot.pods.error
        assert gpu_uuid(0) in mapping(store.snapshot)
        kubelet.fail_with(None)
        await client.refresh()
        assert store.snapshot.pods.error == ""


async def test_response_larger_than_4_mib(kubelet: FakePodResources, socket_path: Path) -> None:
    kubelet.set([held("a", gpu_uuid(0))])
    kubelet.padding = 6 * 1024 * 1024
    async with connected(socket_path) as (store, client):
        assert await client.refresh() is True
        assert mapping(store.snapshot) == {gpu_uuid(0): (PodRef("ns", "a", "main"),)}


async def test_response_over_the_bound_is_an_error(
    kubelet: FakePodResources, socket_path: Path
) -> None:
    kubelet.padding = 64 * 1024
    async with connected(socket_path, max_response_bytes=16 * 1024) as (store, client):
        assert await client.refresh() is False
        assert "exceeds" in store.snapshot.pods.error


async def test_allocate_refreshes_without_waiting_for_the_timer(
    kubelet: FakePodResources, socket_path: Path
) -> None:
    store = DeviceStore(synthetic_snapshot(2))
    clock = ManualClock()
    client = PodResourcesClient(store, socket_path, interval=3600, debounce=0.02, clock=clock)
    async with running(client.run()):
        await eventually(lambda: kubelet.calls == 1 and clock.waiting == 1)
        kubelet.set([held("new", gpu_uuid(1))])
        store.allocated()
        await eventually(lambda: clock.waiting == 1)  # gathering a burst (debounce)
        await clock.advance(0.02)
        assert kubelet.calls == 2
        assert gpu_uuid(1) in mapping(store.snapshot)
        assert clock.now() < 3600  # the backstop timer had nothing to do with it


async def test_allocate_follow_ups_until_the_kubelet_records_it(
    kubelet: FakePodResources, socket_path: Path
) -> None:
    store = DeviceStore(synthetic_snapshot(2))
    clock = ManualClock()
    client = PodResourcesClient(
        store, socket_path, interval=3600, debounce=0.01, follow_ups=(0.05, 0.1, 0.2),
        clock=clock,
    )  # fmt: skip
    async with running(client.run()):
        await eventually(lambda: kubelet.calls == 1 and clock.waiting == 1)
        store.allocated()  # the kubelet has not recorded the allocation yet
        await eventually(lambda: clock.waiting == 1)
        await clock.advance(0.01)  # the burst is over: List, unchanged, so follow-ups
        assert kubelet.calls == 2
        await clock.advance(0.05)  # first follow-up: still nothing recorded
        assert kubelet.calls == 3
        kubelet.set([held("late", gpu_uuid(0))])
        await clock.advance(0.1)  # second follow-up sees it
        assert kubelet.calls == 4
        assert gpu_uuid(0) in mapping(store.snapshot)
        await clock.advance(3000)  # follow-ups stop once the mapping changed
        assert kubelet.calls == 4


async def test_a_burst_of_allocates_is_one_list(
    kubelet: FakePodResources, socket_path: Path
) -> None:
    kubelet.set([held("a", gpu_uuid(0))])
    store = DeviceStore(synthetic_snapshot(2))
    clock = ManualClock()
    client = PodResourcesClient(
        store, socket_path, interval=3600, debounce=0.05, follow_ups=(), clock=clock
    )
    async with running(client.run()):
        await eventually(lambda: kubelet.calls == 1 and clock.waiting == 1)
        kubelet.set([held("a", gpu_uuid(0)), held("b", gpu_uuid(1))])
        for _ in range(20):  # a burst: no time passes between allocations
            store.allocated()
            await asyncio.sleep(0)
        await eventually(lambda: clock.waiting == 1)
        await clock.advance(0.05)
        assert gpu_uuid(1) in mapping(store.snapshot)
        await clock.advance(3000)
        assert kubelet.calls == 2


async def test_calls_at_rest_follow_the_interval(
    kubelet: FakePodResources, socket_path: Path
) -> None:
    store = DeviceStore(synthetic_snapshot(1))
    clock = ManualClock()
    client = PodResourcesClient(store, socket_path, interval=0.1, clock=clock)
    async with running(client.run()):
        await eventually(lambda: kubelet.calls == 1 and clock.waiting == 1)
        await clock.advance(1.0)
        assert kubelet.calls == 1 + 10  # one per interval, never a tight loop


async def test_default_interval_means_one_call_at_start(
    kubelet: FakePodResources, socket_path: Path
) -> None:
    store = DeviceStore(synthetic_snapshot(1))
    clock = ManualClock()
    client = PodResourcesClient(store, socket_path, clock=clock)  # 30 s backstop
    async with running(client.run()):
        await eventually(lambda: kubelet.calls == 1 and clock.waiting == 1)
        await clock.advance(29.9)
        assert kubelet.calls == 1  # ≤ 2 per minute at rest
        await clock.advance(0.1)
        assert kubelet.calls == 2


async def test_mapping_survives_in_snapshot_equality() -> None:
    # The store bumps its version only on change; a repeated failure changes nothing.
    store = DeviceStore(synthetic_snapshot(1))
    client = PodResourcesClient(store, Path("/nonexistent/kubelet.sock"))
    await client.refresh()
    version = store.snapshot.version
    await client.refresh()
    assert store.snapshot.version == version
    assert isinstance(store.snapshot.pods, Attribution)
