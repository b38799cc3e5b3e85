"""The CRI client against a grpcio stand-in of a container runtime's RuntimeService."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
import structlog.testing
from support.clock import FakeClock
from support.fake_cri import FakeCri, RuntimeContainer
from support.grpcstubs import CriStubs

from gpuagent.domain.devices import PodRef
from gpuagent.runtime.cri import CriClient


def cid(n: int) -> str:
    return f"{n:064x}"


TRAINER = RuntimeContainer(cid(1), "team-a", "trainer-0", "main", pod_uid="uid-1")
SIDECAR = RuntimeContainer(cid(2), "team-a", "trainer-0", "sidecar", pod_uid="uid-1")
OUTSIDER = RuntimeContainer(cid(3), "", "", "", kubelet=False, extra_labels={"x": "y"})


@pytest.fixture
def socket_path(short_tmp_path: Path) -> Path:
    return short_tmp_path / "containerd" / "containerd.sock"


@pytest.fixture
def runtime(socket_path: Path, cri_stubs: CriStubs) -> Iterator[FakeCri]:
    with FakeCri(socket_path, cri_stubs) as fake:
        fake.set([TRAINER, SIDECAR, OUTSIDER])
        yield fake


@pytest.fixture
async def cri(socket_path: Path, clock: FakeClock) -> AsyncIterator[CriClient]:
    """A client of ``socket_path``, closed on the test's loop afterwards."""
    cri = CriClient(socket_path, monotonic=clock, min_interval=2.0, retry_interval=30.0)
    yield cri
    cri.close()


async def test_names_from_the_kubelets_labels(
    runtime: FakeCri, cri: CriClient, clock: FakeClock
) -> None:
    names = await cri.resolve({cid(1), cid(2)})
    assert names == {
        cid(1): PodRef("team-a", "trainer-0", "main"),
        cid(2): PodRef("team-a", "trainer-0", "sidecar"),
    }
    assert cid(3) not in names  # not created by the kubelet
    assert runtime.calls == 1


async def test_known_ids_never_refresh(runtime: FakeCri, cri: CriClient, clock: FakeClock) -> None:
    await cri.resolve({cid(1)})
    for _ in range(20):
        clock.now += 60
        await cri.resolve({cid(1), cid(2)})
    assert runtime.calls == 1


async def test_an_unseen_id_refreshes_once_even_if_it_stays_unknown(
    runtime: FakeCri, cri: CriClient, clock: FakeClock
) -> None:
    await cri.resolve({cid(1)})
    clock.now += 5
    new = RuntimeContainer(cid(4), "team-b", "notebook", "jupyter")
    runtime.add(new)
    names = await cri.resolve({cid(1), cid(4)})
    assert names[cid(4)] == PodRef("team-b", "notebook", "jupyter")
    assert runtime.calls == 2
    # An ID the runtime does not list (outside Kubernetes): one refresh, then no more.
    clock.now += 5
    await cri.resolve({cid(1), cid(4), cid(99)})
    for _ in range(5):
        clock.now += 5
        await cri.resolve({cid(1), cid(4), cid(99)})
    assert runtime.calls == 3


async def test_refreshes_are_rate_limited(
    runtime: FakeCri, cri: CriClient, clock: FakeClock
) -> None:
    await cri.resolve({cid(1)})
    runtime.add(RuntimeContainer(cid(5), "ns", "p", "c"))
    assert cid(5) not in await cri.resolve({cid(5)})  # within min_interval: no call
    assert runtime.calls == 1
    clock.now += 2
    assert cid(5) in await cri.resolve({cid(5)})
    assert runtime.calls == 2


async def test_absent_socket_then_the_runtime_appears(
    cri: CriClient, socket_path: Path, cri_stubs: CriStubs, clock: FakeClock
) -> None:
    with structlog.testing.capture_logs() as logs:
        assert await cri.resolve({cid(1)}) == {}
        clock.now += 10
        assert await cri.resolve({cid(1)}) == {}  # waiting for the retry
    assert cri.errors == 1
    assert [e["event"] for e in logs if e["log_level"] == "warning"] == [
        f"CRI socket absent ({socket_path}); containers have no names"
    ]
    with FakeCri(socket_path, cri_stubs) as runtime:
        runtime.set([TRAINER])
        clock.now += 30
        assert cid(1) in await cri.resolve({cid(1)})


async def test_errors_keep_the_last_names_and_a_restarted_runtime_reconnects(
    runtime: FakeCri, cri: CriClient, clock: FakeClock
) -> None:
    await cri.resolve({cid(1)})
    runtime.fail_with(grpc.StatusCode.UNAVAILABLE)
    clock.now += 5
    names = await cri.resolve({cid(1), cid(7)})
    assert names[cid(1)] == PodRef("team-a", "trainer-0", "main")
    assert cri.errors == 1
    runtime.fail_with(None)
    runtime.restart()
    runtime.add(RuntimeContainer(cid(7), "ns", "p7", "c"))
    clock.now += 30
    assert cid(7) in await cri.resolve({cid(1), cid(7)})


async def test_default_socket_is_whichever_exists(
    short_tmp_path: Path, cri_stubs: CriStubs, clock: FakeClock
) -> None:
    containerd = short_tmp_path / "run" / "containerd" / "containerd.sock"
    crio = short_tmp_path / "run" / "crio" / "crio.sock"
    with FakeCri(crio, cri_stubs) as runtime:
        runtime.set([TRAINER])
        cri = CriClient(candidates=(containerd, crio), monotonic=clock)
        try:
            assert cid(1) in await cri.resolve({cid(1)})
            assert cri.socket == crio
        finally:
            cri.close()


async def test_no_socket_at_all_is_no_error(
    short_tmp_path: Path, cri_stubs: CriStubs, clock: FakeClock
) -> None:
    """Neither default socket exists and none is configured (the DaemonSet mounts none): no
    call, no error, no warning — one info line — and a runtime that appears later is used."""
    containerd = short_tmp_path / "run" / "containerd" / "containerd.sock"
    crio = short_tmp_path / "run" / "crio" / "crio.sock"
    cri = CriClient(candidates=(containerd, crio), monotonic=clock, retry_interval=30.0)
    try:
        with structlog.testing.capture_logs() as logs:
            for n in range(5):
                clock.now += 31
                assert await cri.resolve({cid(n)}) == {}
            with FakeCri(containerd, cri_stubs) as runtime:
                runtime.set([TRAINER])
                clock.now += 31
                assert cid(1) in await cri.resolve({cid(1)})
        assert (cri.requests, cri.errors) == (1, 0)
        assert [e["log_level"] for e in logs] == ["info", "info"]
        assert logs[0]["event"] == (
            f"no CRI socket ({containerd} or {crio}): container names from the kubelet's log "
            "links only"
        )
        assert logs[1]["event"] == "CRI ListContainers found"
    finally:
        cri.close()
