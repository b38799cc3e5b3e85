"""The accountant: readings in the store → cgroups → CRI names → Snapshot.usage."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from support.cgroups import Layout, cgroup_file, write_proc
from support.fake_cri import FakeCri, RuntimeContainer
from support.grpcstubs import CriStubs
from support.synthetic import gpu_uuid, pods_by_device, synthetic_snapshot
from support.tasks import running
from support.waiting import eventually

from gpuagent.domain.devices import PodRef
from gpuagent.domain.snapshot import Snapshot
from gpuagent.domain.usage import GpuProcess, ProcessReading, ProcessSample
from gpuagent.runtime.accountant import Accountant
from gpuagent.runtime.cri import CriClient
from gpuagent.runtime.loglinks import LogLinks
from gpuagent.runtime.procfs import ProcReader
from gpuagent.state.store import DeviceStore

GIB = 1024**3
LAYOUT = Layout("containerd", "systemd", 2)


def cid(n: int) -> str:
    return f"{n:064x}"


def uid(n: int) -> str:
    return f"{n:08x}-0000-4000-8000-{n:012x}"


@pytest.fixture
def runtime(short_tmp_path: Path, cri_stubs: CriStubs) -> Iterator[FakeCri]:
    with FakeCri(short_tmp_path / "cri.sock", cri_stubs) as fake:
        fake.set(
            [
                RuntimeContainer(cid(1), "team-a", "a", "main", pod_uid=uid(1)),
                RuntimeContainer(cid(2), "team-b", "b", "main", pod_uid=uid(2)),
            ]
        )
        yield fake


@pytest.fixture
def proc(tmp_path: Path) -> Path:
    return write_proc(
        tmp_path / "proc",
        {
            100: cgroup_file(LAYOUT, uid(1), cid(1)),
            200: cgroup_file(LAYOUT, uid(2), cid(2)),
        },
    )


def with_reading(snapshot: Snapshot, reading: ProcessReading | None) -> Snapshot:
    gpus = (replace(snapshot.gpus[0], processes=reading), *snapshot.gpus[1:])
    return replace(snapshot, gpus=gpus)


async def settle(accountant: Accountant, updates: int) -> None:
    await eventually(lambda: accountant.updates >= updates, what=f"{updates} accountant updates")


async def test_usage_follows_readings_without_cri_calls_at_rest(
    runtime: FakeCri, proc: Path, short_tmp_path: Path
) -> None:
    held = {gpu_uuid(0) + "::0": (PodRef("team-a", "a", "main"),)}
    base = replace(synthetic_snapshot(2), pods=pods_by_device(held))
    store = DeviceStore(base)
    accountant = Accountant(store, ProcReader(proc), CriClient(short_tmp_path / "cri.sock"))
    reading = ProcessReading(
        processes=(GpuProcess(100, 2 * GIB), GpuProcess(200, GIB)),
        samples=(ProcessSample(100, 40), ProcessSample(200, 20)),
    )
    async with running(accountant.run()):
        store.update(lambda s: with_reading(s, reading))
        await settle(accountant, 1)
        usage = store.snapshot.usage
        got = {(u.namespace, u.pod): u for u in usage.containers}
        assert got[("team-a", "a")].memory_bytes == 2 * GIB
        assert got[("team-a", "a")].sm_ratio == pytest.approx(0.4)
        assert got[("team-b", "b")].unallocated
        calls = runtime.calls
        # Polls at rest: new readings of the same processes, no runtime call.
        for n in range(2, 7):
            again = replace(reading, samples=(ProcessSample(100, 40 + n),))
            store.update(lambda s, r=again: with_reading(s, r))  # type: ignore[misc]
            await settle(accountant, n)
        assert runtime.calls == calls == 1
        # The process exits: gone at the next poll; the holder remains with zero use.
        store.update(lambda s: with_reading(s, ProcessReading(samples=())))
        await settle(accountant, 7)
        (left,) = store.snapshot.usage.containers
        assert (left.pod, left.processes, left.memory_bytes) == ("a", 0, 0)


async def test_names_from_the_log_links_first_and_the_cri_only_for_the_rest(
    runtime: FakeCri, proc: Path, short_tmp_path: Path, tmp_path: Path
) -> None:
    """The kubelet's log links name container 1; the CRI is asked only for container 2, which
    has no link (and its answer for 1 would not override the link's)."""
    links_dir = tmp_path / "containers"
    links_dir.mkdir()
    (links_dir / f"a_team-a_from-link-{cid(1)}.log").symlink_to("/var/log/pods/x/0.log")
    links = LogLinks(links_dir)
    store = DeviceStore(synthetic_snapshot(1))
    cri = CriClient(short_tmp_path / "cri.sock")
    accountant = Accountant(store, ProcReader(proc), cri, links)
    reading = ProcessReading(processes=(GpuProcess(100, GIB), GpuProcess(200, GIB)), samples=())
    async with running(accountant.run()):
        store.update(lambda s: with_reading(s, reading))
        await settle(accountant, 1)
    names = {(u.namespace, u.pod, u.container) for u in store.snapshot.usage.containers}
    assert names == {("team-a", "a", "from-link"), ("team-b", "b", "main")}
    assert (links.listings, runtime.calls) == (1, 1)


async def test_only_the_log_links_when_they_name_every_container(
    runtime: FakeCri, proc: Path, short_tmp_path: Path, tmp_path: Path
) -> None:
    links_dir = tmp_path / "containers"
    links_dir.mkdir()
    for n, pod in ((1, "a"), (2, "b")):
        (links_dir / f"{pod}_ns_main-{cid(n)}.log").symlink_to("/var/log/pods/x/0.log")
    store = DeviceStore(synthetic_snapshot(1))
    accountant = Accountant(
        store, ProcReader(proc), CriClient(short_tmp_path / "cri.sock"), LogLinks(links_dir)
    )
    reading = ProcessReading(processes=(GpuProcess(100, GIB), GpuProcess(200, GIB)), samples=())
    async with running(accountant.run()):
        store.update(lambda s: with_reading(s, reading))
        await settle(accountant, 1)
    assert {u.pod for u in store.snapshot.usage.containers} == {"a", "b"}
    assert runtime.calls == 0
    counters = store.counters.read()
    assert counters.log_links is not None
    assert (counters.log_links.listings, counters.log_links.containers) == (1, 2)
    assert counters.cri is not None
    assert counters.cri.requests == 0
