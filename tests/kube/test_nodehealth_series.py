"""Event series in a flapping storm, against the API-server stand-in on a clock the test moves:
a repeat of an event already written is folded into its series and the series is brought up to
date at a bounded cadence (and once more when the storm is over, with its true count), while an
event never written before still goes out at once."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest
from support.noderig import NODE, WALL0, Rig, with_health
from support.synthetic import gpu_uuid

from gpuagent.domain.devices import Condition, GpuHealth
from gpuagent.domain.nodehealth.events import micro_time
from gpuagent.domain.snapshot import Snapshot

#: At most one update of a series this often (the writer's default).
SERIES_INTERVAL = 300.0


def pod_of(rig: Rig, gpu: int) -> str:
    return next(
        a.pod for a in rig.store.snapshot.pods.allocated if gpu_uuid(gpu) in a.device_ids[0]
    )


def unhealthy(rig: Rig, on: str, gpu: int, code: str = "") -> list[dict[str, Any]]:
    """GPU ``gpu``'s GPUUnhealthy events on the Node or on its pod (those naming XID ``code``)."""
    events = (
        rig.server.node_events()
        if on == "node"
        else rig.server.pod_events("team-a", pod_of(rig, gpu))
    )
    return [
        e for e in events
        if e["reason"] == "GPUUnhealthy" and f"GPU {gpu} (" in e["note"]
        and (not code or f"XID {code}," in e["note"])
    ]  # fmt: skip


def event_path(event: dict[str, Any]) -> tuple[str, str]:
    meta = event["metadata"]
    return ("PATCH", f"/apis/events.k8s.io/v1/namespaces/{meta['namespace']}/events/{meta['name']}")


async def flap(rig: Rig, gpu: int, code: str, times: int) -> float:
    """GPU ``gpu`` fails with XID ``code`` and recovers 10 s later, every 20 s, ``times`` times;
    the clock time of its last failure."""
    last = rig.clock.now()
    for _ in range(times):
        last = rig.clock.now()
        await rig.fail(gpu, Condition("xid", code))
        await rig.settle(10.0)
        await rig.heal(gpu)
        await rig.settle(10.0)
    return last


@pytest.mark.parametrize("on", ["node", "pod"])
async def test_a_flapping_gpus_series_is_updated_at_most_every_5_minutes_and_ends_true(
    make_rig: Callable[..., Any], on: str
) -> None:
    """GPU 2 fails and recovers every 20 s for 20 minutes (60 times, one XID code): its event on
    the Node and on its pod is created at once, then its series is patched at most once every
    5 minutes (main: every 30 s window, 40 times), lagging meanwhile; once the storm is over the
    next update writes the true count and the time of the last failure."""
    rig: Rig = await make_rig()
    await rig.settle(0.2)
    await rig.clock.advance(100.0)
    start = len(rig.requests())
    await rig.fail(2, Condition("xid", "79"))
    await rig.settle(0.2)
    (event,) = unhealthy(rig, on, 2)  # the first, at once
    assert "series" not in event
    await rig.settle(9.8)
    await rig.heal(2)
    await rig.settle(10.0)
    last = await flap(rig, 2, "79", 59)
    (event,) = unhealthy(rig, on, 2)
    patches = rig.requests(start).count(event_path(event))
    assert 1 <= patches <= (rig.clock.now() - 100.0) // SERIES_INTERVAL
    assert event["series"]["count"] < 60  # lags while the storm goes on
    await rig.settle(SERIES_INTERVAL)  # the storm over: the final count, once
    (event,) = unhealthy(rig, on, 2)
    assert event["series"] == {"count": 60, "lastObservedTime": micro_time(WALL0 + last)}
    assert rig.requests(start).count(event_path(event)) == patches + 1
    await rig.settle(3 * SERIES_INTERVAL)
    assert rig.requests(start).count(event_path(event)) == patches + 1  # nothing more to say
    assert rig.server.invalid == []


async def test_a_new_xid_code_on_a_flapping_gpu_is_written_at_once(
    make_rig: Callable[..., Any],
) -> None:
    """GPU 2 flaps with XID 79 (its changes merged into the 30 s window); a window has just
    gone out when it fails with XID 48, never seen on it: that event, on the Node and on the pod,
    is news and goes out within a second (main: with the next window, 30 s later)."""
    rig: Rig = await make_rig()
    await rig.settle(0.2)
    await rig.clock.advance(100.0)
    await flap(rig, 2, "79", 3)
    before = len(rig.requests())
    while len(rig.requests()) == before:  # the window with GPU 2's recovery
        await rig.settle(0.5)
    await rig.fail(2, Condition("xid", "48"))
    await rig.settle(1.0)
    assert len(unhealthy(rig, "node", 2, "48")) == 1
    assert len(unhealthy(rig, "pod", 2, "48")) == 1
    assert rig.server.invalid == []


async def test_every_gpu_flapping_costs_at_most_16_series_updates_a_minute(
    make_rig: Callable[..., Any],
) -> None:
    """Every GPU fails and recovers, each with three XID codes in turn: 8 GPUs x 7 series (3 on
    the Node, 3 on the pod, the recovery). After the first minute (the creates) the node makes at
    most 16 series updates a minute besides two condition updates, however many series grew;
    once the storm is over every series ends with its true count."""
    rig: Rig = await make_rig()
    await rig.settle(0.2)
    await rig.clock.advance(100.0)
    codes = itertools.cycle(["79", "48", "94"])
    failures: dict[tuple[int, str], int] = {}
    per_minute: list[list[tuple[str, str]]] = []
    for _minute in range(15):
        start = len(rig.requests())
        for _ in range(6):  # every 10 s: all fail, then all recover 5 s later
            code = next(codes)
            for gpu in range(8):
                rig.store.update(_failed(gpu, code))
                failures[(gpu, code)] = failures.get((gpu, code), 0) + 1
            await rig.settle(5.0)
            for gpu in range(8):
                rig.store.update(_healed(gpu))
            await rig.settle(5.0)
        per_minute.append(rig.requests(start))
    condition = ("PATCH", f"/api/v1/nodes/{NODE}/status")
    for requests in per_minute[1:]:
        assert requests.count(condition) <= 2
        assert len([r for r in requests if r != condition]) <= 16
    await rig.settle(20 * 60.0)
    for (gpu, code), count in failures.items():
        for on in ("node", "pod"):
            (event,) = unhealthy(rig, on, gpu, code)
            assert event["series"]["count"] == count
    assert rig.server.invalid == []


def _failed(gpu: int, code: str) -> Callable[[Snapshot], Snapshot]:
    return lambda s: with_health(s, gpu, GpuHealth((Condition("xid", code),)))


def _healed(gpu: int) -> Callable[[Snapshot], Snapshot]:
    return lambda s: with_health(s, gpu, GpuHealth())
