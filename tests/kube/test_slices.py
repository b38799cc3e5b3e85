"""The ResourceSlice publisher against the API-server stand-in (every write validated), timed by a
clock the test moves: how many requests a storm, a throttle, a conflict and an outage cost, and
when each goes out (the pacing rules of gpuagent/domain/pacing.py)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from support.clock import ManualClock
from support.fake_apiserver import RESOURCE, FakeApiServer
from support.kubehealth import ApiRig, Writers
from support.noderig import NODE, storm_xid, with_health
from support.synthetic import synthetic_snapshot

from gpuagent.domain.devices import Condition, GpuHealth
from gpuagent.domain.dra import DraGpus, dra_devices
from gpuagent.domain.snapshot import Snapshot
from gpuagent.kube.client import KubeApi, load_config
from gpuagent.kube.slices import SlicePublisher
from gpuagent.state.counters import ApiReach
from gpuagent.state.store import DeviceStore

DRIVER = "gpu.nvidia.com"
XID_79 = GpuHealth((Condition("xid", "79"),))


@dataclass
class Rig(ApiRig[SlicePublisher]):
    draws: list[float]

    @property
    def publisher(self) -> SlicePublisher:
        return self.follower

    def writes(self, since: int = 0) -> list[tuple[str, str]]:
        # As the stand-in records them: by the call, or by the method when it answered 429.
        verbs = ("CREATE", "REPLACE", "DELETE", "POST", "PUT")
        return [r for r in self.requests(since) if r[0] in verbs]

    def lists(self, since: int = 0) -> int:
        return sum(1 for verb, _ in self.requests(since) if verb == "LIST")

    def tainted(self) -> set[str]:
        """The published devices with a taint."""
        return {name for name, d in self.server.devices().items() if d.get("taints")}

    def wanted_tainted(self) -> set[str]:
        """The devices the store's GPUs say should carry a taint."""
        return {d.name for d in devices(self.store.snapshot) if d.taints}

    async def until(self, at: float) -> None:
        """Let the publisher's time run to ``at`` (absolute, on its clock)."""
        await self.settle(at - self.clock.now())


def devices(snapshot: Snapshot) -> Any:
    return dra_devices(snapshot, DraGpus(all=True))


def health(gpu: int, state: GpuHealth) -> Callable[[Snapshot], Snapshot]:
    return lambda s: with_health(s, gpu, state)


@pytest.fixture
def make_rig(apiserver: FakeApiServer, tmp_path: Path, writers: Writers) -> Callable[..., Any]:
    """A publisher of an 8-GPU node's devices (every GPU through DRA) against ``apiserver``,
    its random draws taken from ``draws`` (cycled)."""

    async def make(draws: tuple[float, ...] = (0.5,)) -> Rig:
        store = DeviceStore(synthetic_snapshot(8))
        clock = ManualClock()
        drawn: list[float] = []
        cycle: Iterator[float] = itertools.cycle(draws)

        def draw() -> float:
            drawn.append(next(cycle))
            return drawn[-1]

        api = KubeApi(load_config(apiserver.kubeconfig(tmp_path / "kubeconfig")), timeout=5.0)
        publisher = SlicePublisher(
            store, devices, api, node=NODE, driver=DRIVER, clock=clock, draw=draw
        )
        writers.start(api, publisher.run(), "slices-under-test")
        rig = Rig(apiserver, store, clock, publisher, drawn)
        await rig.settle(0.2)  # the first publication, at once
        return rig

    return make


async def test_start_lists_once_then_creates(make_rig: Callable[..., Any]) -> None:
    rig: Rig = await make_rig()
    assert rig.requests() == [
        ("GET", f"/api/v1/nodes/{NODE}"),
        ("LIST", RESOURCE + f"/resourceslices?fieldSelector=spec.nodeName%3D{NODE}%2C"
                            f"spec.driver%3D{DRIVER}"),
        ("CREATE", RESOURCE + "/resourceslices"),
    ]  # fmt: skip
    assert len(rig.server.devices()) == 8
    assert rig.publisher.up
    assert rig.server.invalid == []


async def test_a_fault_after_a_quiet_spell_taints_at_once(make_rig: Callable[..., Any]) -> None:
    rig: Rig = await make_rig()
    await rig.settle(600.0)  # a quiet spell
    start = len(rig.requests())
    changed = rig.clock.now()
    await rig.change(lambda s: with_health(s, 3, XID_79))
    await rig.until(changed + 0.15)
    assert rig.requests(start) == []  # gathering what the fault changes together
    await rig.until(changed + 0.25)
    assert rig.tainted() == rig.wanted_tainted()
    assert len(rig.tainted()) == 1
    assert rig.writes(start) == [("REPLACE", RESOURCE + "/resourceslices/" + _slice(rig))]
    assert rig.lists(start) == 0  # the slice's resourceVersion is known: no LIST per write


async def test_a_fault_5_s_after_a_write_is_in_the_slice_within_a_second(
    make_rig: Callable[..., Any],
) -> None:
    """Whatever was written before (here the publication at start, 5 s earlier), a GPU's change
    of health is not held by the 30 s window: tainted 0.2 s after the fault."""
    rig: Rig = await make_rig()
    written = rig.clock.now()
    start = len(rig.requests())
    await rig.until(written + 5.0)
    await rig.change(health(3, XID_79))
    await rig.until(written + 6.0)
    assert rig.tainted() == rig.wanted_tainted() == {"gpu-3"}
    assert rig.writes(start) == [("REPLACE", RESOURCE + "/resourceslices/" + _slice(rig))]
    # A second GPU 5 s after that write, and its recovery a minute later: each at once too.
    await rig.until(written + 11.0)
    await rig.change(health(5, XID_79))
    await rig.until(written + 12.0)
    assert rig.tainted() == {"gpu-3", "gpu-5"}
    await rig.until(written + 75.0)
    await rig.change(health(5, GpuHealth()))
    await rig.until(written + 76.0)
    assert rig.tainted() == {"gpu-3"}
    assert len(rig.writes(start)) == 3
    assert rig.server.invalid == []


async def test_a_storm_of_1000_xids_is_one_update(make_rig: Callable[..., Any]) -> None:
    """1,000 XIDs of mixed codes in 60 s on one GPU, starting 5 s after a write: the first
    taints the GPU at once; the rest change no taint (one per cause, its value fixed while the
    cause holds), so nothing more is written."""
    rig: Rig = await make_rig()
    await rig.until(rig.clock.now() + 5.0)
    start, began = len(rig.requests()), rig.clock.now()
    codes = itertools.cycle([79, 48, 94, 79, 119, 62, 95, 48])
    for n in range(1000):
        await rig.change(storm_xid(3, next(codes)))
        await rig.settle(0.06)
        if n == 15:  # a second after the first XID
            assert rig.tainted() == {"gpu-3"}
    await rig.until(began + 120.0)
    assert len(rig.writes(start)) == 1
    assert rig.lists(start) == 0
    assert rig.tainted() == rig.wanted_tainted() == {"gpu-3"}
    assert rig.server.invalid == []


async def test_a_flapping_gpu_is_slowed_and_another_gpus_fault_is_not(
    make_rig: Callable[..., Any],
) -> None:
    rig: Rig = await make_rig()
    await rig.settle(600.0)
    start, t0 = len(rig.requests()), rig.clock.now()
    await rig.change(health(2, XID_79))  # GPU 2 fails: at once
    await rig.until(t0 + 1.0)
    assert rig.tainted() == {"gpu-2"}
    await rig.until(t0 + 5.0)
    await rig.change(health(2, GpuHealth()))  # and recovers 5 s later: it flaps, merged
    await rig.until(t0 + 10.0)
    await rig.change(health(5, XID_79))  # GPU 5 fails meanwhile: news, at once
    await rig.until(t0 + 11.0)
    assert rig.tainted() == {"gpu-5"}  # GPU 2's recovery went with it
    await rig.until(t0 + 12.0)
    await rig.change(health(2, XID_79))  # GPU 2 again: merged into the window after GPU 5's
    await rig.until(t0 + 40.0)
    assert rig.tainted() == {"gpu-5"}
    await rig.until(t0 + 40.3)
    assert rig.tainted() == rig.wanted_tainted() == {"gpu-2", "gpu-5"}
    assert len(rig.writes(start)) == 3
    assert rig.server.invalid == []


async def test_a_flapping_storm_is_two_updates_a_minute_and_no_list(
    make_rig: Callable[..., Any],
) -> None:
    """3,000 faults and recoveries in 3 minutes over the 8 GPUs (each a change of a device's
    taints): the first fault of each GPU goes out at once (two updates in the first half second,
    the settling gathers four GPUs each), then every GPU flaps, merged 30 s at a time."""
    rig: Rig = await make_rig()
    await rig.settle(600.0)
    start, began = len(rig.requests()), rig.clock.now()
    by_minute: list[int] = []
    for n in range(3000):
        gpu, failing = n % 8, n % 16 < 8
        await rig.change(health(gpu, XID_79 if failing else GpuHealth()))
        await rig.settle(0.06)
        if n % 1000 == 999:
            by_minute.append(len(rig.writes(start)) - sum(by_minute))
    assert rig.clock.now() == pytest.approx(began + 180.0)
    assert by_minute == [3, 2, 2]  # news at 0.2 and 0.44 s, then windows at 30.44 s, 60.44 s…
    assert rig.lists(start) == 0
    # Its last change (GPU 0 recovers) goes out with the next window, once.
    await rig.change(health(0, GpuHealth()))
    await rig.settle(30.0)
    assert len(rig.writes(start)) == 8
    published = rig.publisher.published or ()
    assert [(d.name, d.taints) for d in published] == [
        (d.name, d.taints) for d in devices(rig.store.snapshot)
    ]
    assert rig.tainted() == rig.wanted_tainted()
    assert rig.server.invalid == []


async def test_eight_gpus_failing_spend_the_budget_and_the_ninth_cause_waits_for_a_token(
    make_rig: Callable[..., Any],
) -> None:
    """The budget of early writes is the node's GPU count (8), two back a minute: eight faults
    2 s apart go out at once; a ninth cause (GPU 0 lost, 1 s later) waits for the first token
    to come back, 30 s after the first was spent, sooner than the window would."""
    rig: Rig = await make_rig()
    await rig.settle(600.0)
    start, t0 = len(rig.requests()), rig.clock.now()
    for gpu in range(8):
        await rig.until(t0 + 2.0 * gpu)
        await rig.change(health(gpu, XID_79))
        await rig.until(t0 + 2.0 * gpu + 1.0)
        assert len(rig.writes(start)) == gpu + 1
    lost = GpuHealth((Condition("xid", "79"), Condition("lost")))
    await rig.until(t0 + 15.5)
    await rig.change(health(0, lost))
    await rig.until(t0 + 30.1)
    assert len(rig.writes(start)) == 8
    await rig.until(t0 + 30.3)  # the first token, spent at 0.2 s, is back
    assert len(rig.writes(start)) == 9
    assert rig.tainted() == rig.wanted_tainted()


async def test_an_outage_shows_at_the_first_failed_write(make_rig: Callable[..., Any]) -> None:
    """The API server gone 5 s after a write: the fault's write fails 0.2 s after the fault, and
    the store's counters say so (gpuagent_dra_api_up 0) then, not when the window would end."""
    rig: Rig = await make_rig()
    counters = rig.store.counters
    assert counters.api_reach()["resource_slices"] == ApiReach(up=True)
    await rig.until(rig.clock.now() + 5.0)
    await rig.server.stop()
    fault = rig.clock.now()
    await rig.change(health(1, XID_79))
    await rig.until(fault + 1.0)
    reach = counters.api_reach()["resource_slices"]
    assert (reach.up, reach.backing_off) == (False, True)
    assert reach.error.startswith("API server unreachable: ")
    assert not rig.publisher.up
    await rig.server.start()
    await rig.settle(1.0)  # the next try (full jitter of 0.5 s)
    assert counters.api_reach()["resource_slices"] == ApiReach(up=True)
    assert rig.tainted() == {"gpu-1"}


async def test_a_refused_node_read_is_tried_again_rarely(
    apiserver: FakeApiServer, make_rig: Callable[..., Any]
) -> None:
    """The Node not readable (403: no RBAC for it; a wrong node name, 404): the slices, which
    need its UID, wait with it, tried again every 10 minutes, never in a loop."""
    node = ("GET", f"/api/v1/nodes/{NODE}")
    apiserver.refuse.add(f"GET nodes/{NODE}")
    rig: Rig = await make_rig()
    assert rig.requests() == [node]
    assert not rig.publisher.up
    assert rig.publisher.error.startswith("API server: ")
    await rig.settle(599.0)
    assert rig.requests() == [node]
    apiserver.refuse.clear()
    await rig.settle(1.0)
    assert [verb for verb, _ in rig.requests()] == ["GET", "GET", "LIST", "CREATE"]
    assert rig.publisher.up


async def test_429_with_retry_after_is_retried_no_sooner(make_rig: Callable[..., Any]) -> None:
    rig: Rig = await make_rig(draws=(0.5,))
    await rig.settle(600.0)
    rig.server.throttle, rig.server.retry_after = 1, 5
    start = len(rig.requests())
    await rig.change(lambda s: with_health(s, 0, XID_79))
    await rig.settle(0.2)
    tried = rig.clock.now()
    assert rig.requests(start) == [("PUT", RESOURCE + "/resourceslices/" + _slice(rig))]  # 429
    assert not rig.publisher.up
    assert rig.tainted() == set()
    # Retry-After: 5, plus the full jitter of a first failure (0.5 x 0.5 s): 5.25 s later.
    await rig.until(tried + 5.2)
    assert len(rig.requests(start)) == 1
    await rig.until(tried + 5.3)
    assert len(rig.writes(start)) == 2
    assert rig.lists(start) == 0
    assert len(rig.tainted()) == 1
    assert rig.publisher.up


async def test_retries_back_off_with_full_jitter(make_rig: Callable[..., Any]) -> None:
    """Each retry after a uniform draw of its ceiling (0.5 s doubling up to 60 s): with draws
    0.9, 0.1, 0.5, 0.7 the tries come 0.45, 0.1, 1.0 and 2.8 s apart, not in lockstep."""
    rig: Rig = await make_rig(draws=(0.9, 0.1, 0.5, 0.7))
    await rig.settle(600.0)
    rig.server.throttle, rig.server.retry_after = 4, 0  # 429 without a Retry-After to honour
    start = len(rig.requests())
    await rig.change(lambda s: with_health(s, 5, XID_79))
    await rig.settle(0.2)
    assert len(rig.writes(start)) == 1
    tried = rig.clock.now()
    for gap, tries in ((0.45, 2), (0.1, 3), (1.0, 4), (2.8, 5)):
        await rig.until(tried + gap - 0.005)
        assert len(rig.writes(start)) == tries - 1, gap
        await rig.until(tried + gap + 0.005)
        assert len(rig.writes(start)) == tries, gap
        tried += gap
    assert rig.draws == [0.9, 0.1, 0.5, 0.7]
    assert len(rig.tainted()) == 1
    assert rig.publisher.up


async def test_a_conflict_lists_again_then_writes(make_rig: Callable[..., Any]) -> None:
    rig: Rig = await make_rig()
    await rig.settle(600.0)
    name = _slice(rig)
    rig.server.slices[name]["metadata"]["resourceVersion"] = "9999"  # someone else wrote it
    start = len(rig.requests())
    await rig.change(lambda s: with_health(s, 1, XID_79))
    await rig.settle(0.2)
    assert [verb for verb, _ in rig.requests(start)] == ["REPLACE"]  # 409
    await rig.settle(0.3)  # the backoff's jitter (0.5 x 0.5 s)
    assert [verb for verb, _ in rig.requests(start)] == ["REPLACE", "LIST", "REPLACE"]
    assert len(rig.tainted()) == 1
    assert rig.publisher.lists == 2


async def test_a_deleted_slice_is_listed_and_created_again(make_rig: Callable[..., Any]) -> None:
    rig: Rig = await make_rig()
    await rig.settle(600.0)
    del rig.server.slices[_slice(rig)]  # someone deleted it
    start = len(rig.requests())
    await rig.change(lambda s: with_health(s, 2, XID_79))
    await rig.settle(0.2)
    await rig.settle(0.3)  # the backoff's jitter (0.5 x 0.5 s)
    assert [verb for verb, _ in rig.requests(start)] == ["REPLACE", "LIST", "CREATE"]
    assert len(rig.server.devices()) == 8
    assert len(rig.tainted()) == 1


async def test_a_restarted_agent_adopts_its_slices_without_a_write(
    make_rig: Callable[..., Any],
) -> None:
    first: Rig = await make_rig()
    writes = len(first.writes())
    second: Rig = await make_rig()
    assert len(second.writes()) == writes
    assert second.publisher.published is not None
    assert second.publisher.up


def _slice(rig: Rig) -> str:
    (name,) = rig.server.slices
    return name
