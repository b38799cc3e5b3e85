"""The node-health writer against the API-server stand-in (every write validated against the
Kubernetes schemas and the API server's rules), timed by a clock the test moves: what is written,
when, and how many requests it takes — at rest, in a storm, through an outage, when refused."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest
from structlog.testing import capture_logs
from support.fake_apiserver import KUBELET_CONDITIONS, FakeApiServer
from support.noderig import NODE, Rig, last_xid, storm_xid
from support.synthetic import gpu_uuid

from gpuagent.domain.devices import Condition
from gpuagent.domain.readiness import readiness
from gpuagent.state.counters import ApiReach


# ----- helpers -----------------------------------------------------------------------------------
def gpu_healthy(server: FakeApiServer) -> dict[str, Any]:
    condition = server.condition()
    assert condition is not None
    return condition


async def wrote(rig: Rig) -> None:
    """Let the writer's first batch after a change go (0.2 s of its time: well under 2 s)."""
    await rig.settle(0.2)


def kubelet_untouched(server: FakeApiServer) -> bool:
    return server.kubelet_conditions() == [dict(c) for c in KUBELET_CONDITIONS]


# ----- the condition -----------------------------------------------------------------------------
async def test_a_healthy_node_gets_one_true_condition_in_three_requests(
    make_rig: Callable[..., Any],
) -> None:
    rig: Rig = await make_rig()
    assert rig.requests() == []  # nothing before the first batch is due
    await wrote(rig)
    assert rig.requests() == [
        ("GET", "/apis/events.k8s.io/v1"),
        ("GET", f"/api/v1/nodes/{NODE}"),
        ("PATCH", f"/api/v1/nodes/{NODE}/status"),
    ]
    condition = gpu_healthy(rig.server)
    assert condition == {
        "type": "GPUHealthy", "status": "True", "reason": "AllGPUsHealthy",
        "message": "All 8 GPUs are healthy",
        "lastHeartbeatTime": "2026-01-01T00:00:00Z", "lastTransitionTime": "2026-01-01T00:00:00Z",
    }  # fmt: skip
    assert kubelet_untouched(rig.server)
    assert rig.server.invalid == []


async def test_at_rest_a_node_writes_at_most_twice_an_hour(make_rig: Callable[..., Any]) -> None:
    rig: Rig = await make_rig()
    await wrote(rig)
    start = len(rig.requests())
    beats: list[float] = []
    for minute in range(180):  # three hours; the poller's changes wake the writer meanwhile
        await rig.change(last_xid(minute))
        before = len(rig.requests())
        await rig.settle(60.0)
        if len(rig.requests()) > before:
            beats.append(rig.clock.now())
    heartbeats = rig.requests(start)
    assert heartbeats == [("PATCH", f"/api/v1/nodes/{NODE}/status")] * len(beats)
    assert len(beats) == 5  # every 30-33 minutes
    assert all(b - a >= 1800 for a, b in itertools.pairwise([0.0, *beats]))
    condition = gpu_healthy(rig.server)
    assert condition["lastTransitionTime"] == "2026-01-01T00:00:00Z"  # no transition
    assert condition["lastHeartbeatTime"] > "2026-01-01T00:30:00Z"


async def test_xid_79_on_gpu_3_is_on_the_node_and_its_pod_within_a_fraction_of_a_second(
    make_rig: Callable[..., Any],
) -> None:
    rig: Rig = await make_rig()
    await wrote(rig)
    start = len(rig.requests())
    await rig.clock.advance(100.0)
    await rig.fail(3, Condition("xid", "79"), Condition("recovery_action", "gpu_reset"))
    assert rig.requests(start) == []  # gathered for 0.2 s first
    await wrote(rig)
    condition = gpu_healthy(rig.server)
    assert (condition["status"], condition["reason"]) == ("False", "XidError")
    assert condition["message"] == (
        f"1 of 8 GPUs unhealthy. GPU 3 ({gpu_uuid(3)}): XID 79, GPU has fallen off the bus "
        "(recommended action: restart the node); the driver's recovery action: reset the GPU; "
        "unhealthy since 2026-01-01T00:01:40Z."
    )
    assert condition["lastTransitionTime"] == "2026-01-01T00:01:40Z"
    (node_event,) = rig.server.node_events()
    assert node_event["reason"] == "GPUUnhealthy"
    assert node_event["type"] == "Warning"
    assert node_event["regarding"] == {"apiVersion": "v1", "kind": "Node", "name": NODE,
                                       "uid": rig.server.node_uid}  # fmt: skip
    assert node_event["metadata"]["namespace"] == "default"
    assert "XID 79, GPU has fallen off the bus" in node_event["note"]
    pod = next(a.pod for a in rig.store.snapshot.pods.allocated if gpu_uuid(3) in a.device_ids[0])
    (pod_event,) = rig.server.pod_events("team-a", pod)
    assert pod_event["note"].startswith(
        f"GPU 3 ({gpu_uuid(3)}) allocated to this pod (container main) failed: XID 79, GPU has "
        "fallen off the bus (recommended action: restart the node)"
    )
    assert len(rig.server.events) == 2
    assert len(rig.requests(start)) == 3  # the condition and two events
    assert kubelet_untouched(rig.server)
    assert rig.server.invalid == []

    # Recovery: True again and one Normal event at once, though GPU 3 changed less than a minute
    # ago (a flap): the GPU's first recovery event is news.
    await rig.heal(3)
    await wrote(rig)
    condition = gpu_healthy(rig.server)
    assert (condition["status"], condition["reason"]) == ("True", "AllGPUsHealthy")
    recovered = rig.server.node_events()[-1]
    assert (recovered["reason"], recovered["type"]) == ("GPURecovered", "Normal")
    assert len(rig.server.events) == 3
    assert kubelet_untouched(rig.server)


async def test_with_events_off_a_failing_gpu_is_in_the_condition_and_no_event_is_made(
    make_rig: Callable[..., Any],
) -> None:
    """``--events=false`` (RBAC without events, say): the condition alone, no discovery."""
    rig: Rig = await make_rig(events=False)
    await wrote(rig)
    await rig.clock.advance(100.0)
    await rig.fail(3, Condition("xid", "79"))
    await wrote(rig)
    assert gpu_healthy(rig.server)["reason"] == "XidError"
    assert not rig.server.events
    assert [path for _, path in rig.requests()] == [
        f"/api/v1/nodes/{NODE}", f"/api/v1/nodes/{NODE}/status", f"/api/v1/nodes/{NODE}/status",
    ]  # fmt: skip


def pod_of(rig: Rig, gpu: int) -> str:
    """The synthetic pod holding GPU ``gpu`` (namespace team-a)."""
    return next(
        a.pod for a in rig.store.snapshot.pods.allocated if gpu_uuid(gpu) in a.device_ids[0]
    )


def note(rig: Rig) -> str:
    """What /readyz says beside its verdict, from the store as the writer left it."""
    return readiness(rig.store.snapshot, api=rig.store.counters.api_reach()).note


def told(rig: Rig, gpu: int) -> bool:
    """GPU ``gpu`` is unhealthy in the condition, and its Node and pod events are written."""
    condition = gpu_healthy(rig.server)
    on_node = [e for e in rig.server.node_events() if f"GPU {gpu} (" in e["note"]]
    return (
        f"GPU {gpu} ({gpu_uuid(gpu)})" in condition["message"]
        and any(e["reason"] == "GPUUnhealthy" for e in on_node)
        and len(rig.server.pod_events("team-a", pod_of(rig, gpu))) == 1
    )


async def test_a_fault_5_s_after_a_write_is_in_the_condition_and_events_within_a_second(
    make_rig: Callable[..., Any],
) -> None:
    """Whatever was written before (the condition at start, 5 s earlier), a GPU's change of
    health is not held by the 30 s window: the condition and both events 0.2 s after it."""
    rig: Rig = await make_rig()
    await wrote(rig)
    written = rig.clock.now()
    await rig.settle(5.0)
    await rig.fail(3, Condition("xid", "79"), Condition("recovery_action", "gpu_reset"))
    await rig.settle(1.0)
    assert gpu_healthy(rig.server)["status"] == "False"
    assert told(rig, 3)
    # Another GPU 5 s after that write: at once too.
    await rig.settle(4.0)
    await rig.fail(6, Condition("ecc_dbe"))
    await rig.settle(1.0)
    assert told(rig, 6)
    assert rig.clock.now() - written == 11.0
    assert rig.server.invalid == []


async def test_a_storm_of_1000_xids_is_out_at_once_then_two_updates_a_minute(
    make_rig: Callable[..., Any],
) -> None:
    """1,000 XIDs of mixed codes over a minute on GPU 3, 5 s after a write: the first is on the
    node and its pod within a second; every later XID changes no cause (only the message's
    evidence), so it is merged: at most two condition updates in the minute, and no more events."""
    rig: Rig = await make_rig()
    await wrote(rig)
    await rig.settle(5.0)
    start, began = len(rig.requests()), rig.clock.now()
    codes = itertools.cycle([79, 48, 13, 94, 79, 119, 13, 48])
    for i in range(1000):
        rig.store.update(storm_xid(3, next(codes)))
        await rig.settle(0.06)
        if i == 15:  # a second in
            assert told(rig, 3)
    patches = [r for r in rig.requests(start) if r == ("PATCH", f"/api/v1/nodes/{NODE}/status")]
    assert rig.clock.now() - began == pytest.approx(60.0)
    assert len(patches) <= 2
    assert len(rig.server.events) == 2  # the Node's and the pod's
    await rig.settle(120.0)
    assert "XID 48" in gpu_healthy(rig.server)["message"]  # the last XID's evidence, merged
    assert rig.server.invalid == []


async def test_a_flapping_gpu_is_slowed_and_another_gpus_fault_is_not(
    make_rig: Callable[..., Any],
) -> None:
    rig: Rig = await make_rig()
    await wrote(rig)
    await rig.clock.advance(100.0)
    await rig.fail(2, Condition("lost"))  # at once
    await rig.settle(1.0)
    assert told(rig, 2)
    await rig.settle(4.0)
    await rig.heal(2)  # 5 s later: it flaps, merged into the window
    await rig.settle(5.0)
    await rig.fail(5, Condition("ecc_dbe"))  # GPU 5 meanwhile: at once, and the recovery with it
    await rig.settle(1.0)
    assert told(rig, 5)
    recovered = [e for e in rig.server.node_events() if e["reason"] == "GPURecovered"]
    assert len(recovered) == 1
    await rig.settle(1.0)
    await rig.fail(2, Condition("lost"))  # GPU 2 again: merged, 30 s after GPU 5's write
    await rig.settle(27.5)
    assert f"GPU 2 ({gpu_uuid(2)})" not in gpu_healthy(rig.server)["message"]
    await rig.settle(1.0)
    assert f"GPU 2 ({gpu_uuid(2)})" in gpu_healthy(rig.server)["message"]
    assert rig.server.invalid == []


async def test_an_outage_shows_at_the_first_failed_write(make_rig: Callable[..., Any]) -> None:
    """The API server gone 5 s after a write: the fault's batch fails 0.2 s after the fault and
    the store's counters say so then (gpuagent_kube_backing_off, /readyz), not a window later."""
    rig: Rig = await make_rig()
    await wrote(rig)
    counters = rig.store.counters
    assert counters.api_reach()["node_health"] == ApiReach(up=True)
    await rig.settle(5.0)
    await rig.server.stop()
    await rig.fail(4, Condition("xid", "79"))
    await rig.settle(1.0)
    reach = counters.api_reach()["node_health"]
    assert (reach.up, reach.backing_off) == (False, True)
    assert reach.error.startswith("API server unreachable: ")
    assert note(rig) == f"node health not written: {reach.error}; retrying\n"
    await rig.server.start()
    await rig.settle(1.0)  # the next try (full jitter of 0.5 s)
    assert counters.api_reach()["node_health"] == ApiReach(up=True)
    assert note(rig) == ""
    assert told(rig, 4)


async def test_a_storm_of_1000_xids_in_10_seconds_makes_at_most_20_requests(
    make_rig: Callable[..., Any],
) -> None:
    rig: Rig = await make_rig()
    await wrote(rig)
    await rig.clock.advance(100.0)
    start = len(rig.requests())
    codes = itertools.cycle([79, 48, 13, 94, 79, 119, 13, 48])
    for i in range(1000):  # one XID every 10 ms, on GPU 3 and now and then on GPU 5
        index = 5 if i % 97 == 0 else 3
        rig.store.update(storm_xid(index, next(codes)))
        if i % 10 == 9:
            await rig.settle(0.1)
    await rig.settle(120.0)  # and everything merged since has gone out
    requests = rig.requests(start)
    assert len(requests) <= 20, requests
    assert gpu_healthy(rig.server)["status"] == "False"
    notes = [e["note"] for e in rig.server.node_events()]
    assert [n.split(" is ")[0] for n in notes] == [
        f"GPU 3 ({gpu_uuid(3)})",
        f"GPU 5 ({gpu_uuid(5)})",
    ]
    assert rig.server.invalid == []
    assert kubelet_untouched(rig.server)


async def test_a_flapping_gpu_is_one_event_series_not_one_event_each_time(
    make_rig: Callable[..., Any],
) -> None:
    rig: Rig = await make_rig()
    await wrote(rig)
    for _ in range(6):
        await rig.fail(2, Condition("lost"))
        await rig.settle(20.0)
        await rig.heal(2)
        await rig.settle(20.0)
    await rig.settle(300.0)  # a series is brought up to date at most every 5 minutes
    unhealthy = [e for e in rig.server.node_events() if e["reason"] == "GPUUnhealthy"]
    recovered = [e for e in rig.server.node_events() if e["reason"] == "GPURecovered"]
    assert len(unhealthy) == len(recovered) == 1
    assert unhealthy[0]["series"]["count"] == recovered[0]["series"]["count"] == 6
    assert rig.server.invalid == []


# ----- an outage ---------------------------------------------------------------------------------
async def test_through_an_outage_only_the_latest_state_is_kept_and_written_once(
    make_rig: Callable[..., Any],
) -> None:
    rig: Rig = await make_rig()
    await wrote(rig)
    await rig.clock.advance(100.0)
    await rig.server.stop()
    with capture_logs() as logs:
        for index in range(8):  # every GPU fails, one after another, then four recover
            await rig.fail(index, Condition("xid", "79"))
            await rig.settle(30.0)
        for index in range(4):
            await rig.heal(index)
            await rig.settle(30.0)
        await rig.settle(600.0)
    outage = len(rig.requests())
    paused = [e for e in logs if e["event"] == "API writes paused; retrying"]
    assert len(paused) == 1  # said once, not on every retry
    assert rig.writer.pacer.failures >= 10
    # Memory stays bounded: one desired state per object, events pending at most 8 + 8 + 4.
    assert len(rig.writer.model.events) == 20
    await rig.server.start()
    await rig.settle(60.0)  # the next retry (full jitter, at most a minute away) catches up
    after = rig.requests(outage)
    assert after.count(("PATCH", f"/api/v1/nodes/{NODE}/status")) == 1
    assert sum(1 for verb, _ in after if verb == "POST") == 20  # 8+4 on the node, 8 on pods
    assert len(after) == 21
    condition = gpu_healthy(rig.server)
    assert condition["message"].startswith("4 of 8 GPUs unhealthy.")
    assert rig.server.invalid == []


async def test_an_outage_retries_with_jitter_never_faster_than_backoff(
    make_rig: Callable[..., Any],
) -> None:
    rig: Rig = await make_rig()
    await wrote(rig)
    await rig.server.stop()
    await rig.fail(1, Condition("lost"))
    start = len(rig.requests())
    for _ in range(60):  # ten minutes down
        await rig.settle(10.0)
    # The server was down: nothing reached it; the writer tried again with backoff.
    assert rig.requests(start) == []
    counts = rig.writer.pacer.counts.counts
    tries = sum(n for (obj, result), n in counts.items() if result == "unreachable")
    # Ceilings 0.5 .. 60 s, draws 0.1-0.9: seven tries on the way up to the ceiling, then about
    # one every 30 s (the fault is news: the backoff paces it, not the window).
    assert 8 <= tries <= 30


async def test_a_heartbeat_due_while_the_server_is_down_is_paced_too(
    make_rig: Callable[..., Any],
) -> None:
    rig: Rig = await make_rig()
    await wrote(rig)
    await rig.server.stop()
    for minute in range(60):  # an hour down; the heartbeat falls due half-way
        await rig.change(last_xid(minute))
        await rig.settle(60.0)
    counts = rig.writer.pacer.counts.counts
    tries = counts.get(("node_condition", "unreachable"), 0)
    assert 20 <= tries <= 90  # about one every 30 s for the half hour it was due
    await rig.server.start()
    start = len(rig.requests())
    await rig.settle(60.0)
    assert rig.requests(start) == [("PATCH", f"/api/v1/nodes/{NODE}/status")]


# ----- refusals ----------------------------------------------------------------------------------
async def test_403_on_the_condition_is_said_once_and_the_events_still_go_out(
    make_rig: Callable[..., Any],
) -> None:
    rig: Rig = await make_rig()
    rig.server.refuse.add("PATCH nodes/" + NODE + "/status")
    rig.server.refuse.add(f"PATCH {NODE}/status")
    with capture_logs() as logs:
        await wrote(rig)
        await rig.fail(0, Condition("ecc_dbe"))
        await rig.settle(0.2)
        for _ in range(5):
            await rig.settle(60.0)
    refused = [e for e in logs if e["event"] == "API server refused; trying again rarely"]
    assert len(refused) == 1
    assert refused[0]["object"] == "node_condition"
    assert "403" in refused[0]["error"]
    assert rig.server.condition() is None
    assert [e["reason"] for e in rig.server.node_events()] == ["GPUUnhealthy"]
    patches = [r for r in rig.requests() if r == ("PATCH", f"/api/v1/nodes/{NODE}/status")]
    assert len(patches) == 1  # not again within ten minutes
    rig.server.refuse.clear()
    await rig.settle(600.0)
    assert gpu_healthy(rig.server)["status"] == "False"


async def test_no_such_node_is_said_once_and_tried_again_rarely(
    make_rig: Callable[..., Any],
) -> None:
    rig: Rig = await make_rig()
    rig.server.node_present = False
    with capture_logs() as logs:
        await wrote(rig)
        for _ in range(9):
            await rig.settle(60.0)
    reads = [r for r in rig.requests() if r == ("GET", f"/api/v1/nodes/{NODE}")]
    assert len(reads) == 1
    assert [e["object"] for e in logs if e["event"].startswith("API server refused")] == ["node"]
    rig.server.node_present = True
    await rig.settle(61.0)  # ten minutes after the first try
    assert gpu_healthy(rig.server)["status"] == "True"


async def test_a_429_is_retried_no_sooner_than_its_retry_after(
    make_rig: Callable[..., Any],
) -> None:
    rig: Rig = await make_rig()
    rig.server.throttle, rig.server.retry_after = 1, 5
    await wrote(rig)
    assert rig.server.condition() is None
    await rig.settle(4.9)
    assert rig.server.condition() is None
    await rig.settle(5.0)  # 5 s + jitter (at most 0.5 s after a first failure)
    assert gpu_healthy(rig.server)["status"] == "True"
    assert ("node_condition", "throttled") in rig.writer.pacer.counts.counts


async def test_without_events_k8s_io_events_go_to_the_core_api(
    make_rig: Callable[..., Any],
) -> None:
    rig: Rig = await make_rig()
    rig.server.events_api = False
    await wrote(rig)
    await rig.fail(4, Condition("lost"))
    await rig.settle(30.0)  # the window after the first write
    (event,) = rig.server.node_events()
    assert event["apiVersion"] == "v1"
    assert event["involvedObject"]["name"] == NODE
    assert any(path.startswith("/api/v1/namespaces/default/events") for _, path in rig.requests())
    assert rig.server.invalid == []


async def test_a_restarted_agent_keeps_the_condition_it_finds(
    make_rig: Callable[..., Any], apiserver: FakeApiServer
) -> None:
    first: Rig = await make_rig()
    await wrote(first)
    start = len(apiserver.requests)
    second: Rig = await make_rig()
    await wrote(second)
    assert apiserver.requests[start:] == [
        ("GET", "/apis/events.k8s.io/v1"), ("GET", f"/api/v1/nodes/{NODE}"),
    ]  # fmt: skip


# ----- the taint ---------------------------------------------------------------------------------
async def test_the_taint_follows_a_node_whose_gpus_are_all_unhealthy(
    make_rig: Callable[..., Any],
) -> None:
    rig: Rig = await make_rig(gpus=2, taint=True)
    other = {"key": "example.com/maintenance", "effect": "NoSchedule"}
    rig.server.node_stored()["spec"]["taints"] = [other]
    await wrote(rig)
    await rig.fail(0, Condition("lost"))
    await rig.settle(30.0)
    assert rig.server.node_stored()["spec"]["taints"] == [other]  # one GPU left
    await rig.fail(1, Condition("ecc_dbe"))
    await rig.settle(30.0)
    assert rig.server.node_stored()["spec"]["taints"] == [
        other, {"key": "nvidia.com/gpu-unhealthy", "effect": "NoSchedule"},
    ]  # fmt: skip
    await rig.heal(1)
    await rig.settle(30.0)
    assert rig.server.node_stored()["spec"]["taints"] == [other]
    assert kubelet_untouched(rig.server)
    assert rig.server.invalid == []
