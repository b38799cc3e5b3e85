"""What Kubernetes is told about a node's GPUs: the view, the condition, the events."""

from __future__ import annotations

from dataclasses import replace

import pytest
from support.synthetic import gpu_uuid, mig_uuid, synthetic_snapshot

from gpuagent.domain.devices import Condition, GpuHealth
from gpuagent.domain.nodehealth import (
    HEALTHY_REASON,
    MAX_LISTED,
    NOTE_LIMIT,
    REASONS,
    NodeHealthModel,
    NodeHealthView,
    condition_patch,
    event_manifest,
    event_name,
    project,
    series_patch,
    worst_reason,
)
from gpuagent.domain.plan import Plan
from gpuagent.domain.snapshot import Snapshot

SERVED = Plan().served_resources
T0 = 1_767_225_600.0  # 2026-01-01T00:00:00Z


def failing(snapshot: Snapshot, index: int, *conditions: Condition) -> Snapshot:
    gpus = tuple(
        replace(g, health=GpuHealth(conditions)) if g.index == index else g for g in snapshot.gpus
    )
    return replace(snapshot, gpus=gpus)


def view_of(snapshot: Snapshot) -> NodeHealthView:
    view = project(snapshot, SERVED)
    assert view is not None
    return view


def test_nothing_is_said_before_the_gpus_are_discovered() -> None:
    assert project(replace(synthetic_snapshot(2), discovered=False), SERVED) is None


def test_a_poll_that_changes_only_readings_leaves_the_view_equal() -> None:
    snapshot = synthetic_snapshot(4, replicas=1)
    moved = replace(snapshot, gpus=tuple(replace(g, last_xid=13) for g in snapshot.gpus))
    assert project(snapshot, SERVED) == project(moved, SERVED)
    assert project(snapshot, SERVED) != project(failing(snapshot, 1, Condition("lost")), SERVED)


def test_a_healthy_node_reads_all_gpus_healthy() -> None:
    model = NodeHealthModel("node-a")
    view = project(synthetic_snapshot(8), SERVED)
    assert view is not None
    assert model.observe(view, T0)
    report = model.condition()
    assert report is not None
    assert (report.status, report.reason, report.message) == (
        "True", HEALTHY_REASON, "All 8 GPUs are healthy",
    )  # fmt: skip
    assert model.pending_events() == []
    assert not model.observe(view, T0 + 5)  # the same view: no change


def test_xid_79_on_gpu_3_names_the_gpu_the_evidence_the_action_and_since_when() -> None:
    snapshot = synthetic_snapshot(8, replicas=1)
    model = NodeHealthModel("node-a")
    model.observe(view_of(snapshot), T0)
    bad = failing(snapshot, 3, Condition("xid", "79"), Condition("recovery_action", "gpu_reset"))
    model.observe(view_of(bad), T0 + 12.5)
    report = model.condition()
    assert report is not None
    assert (report.status, report.reason) == ("False", "XidError")
    assert report.message == (
        f"1 of 8 GPUs unhealthy. GPU 3 ({gpu_uuid(3)}): XID 79, GPU has fallen off the bus "
        "(recommended action: restart the node); the driver's recovery action: reset the GPU; "
        "unhealthy since 2026-01-01T00:00:12Z."
    )
    node_event, pod_event = sorted(model.pending_events(), key=lambda r: r.key.regarding.kind)
    assert (node_event.key.regarding.kind, node_event.key.reason, node_event.type) == (
        "Node", "GPUUnhealthy", "Warning",
    )  # fmt: skip
    assert node_event.key.note.startswith(f"GPU 3 ({gpu_uuid(3)}) is unhealthy: XID 79, GPU has")
    assert pod_event.key.regarding.kind == "Pod"
    assert pod_event.key.regarding.namespace == "team-a"
    assert pod_event.key.note.startswith(
        f"GPU 3 ({gpu_uuid(3)}) allocated to this pod (container main) failed: XID 79"
    )


def test_the_message_keeps_its_text_while_the_facts_stay_the_same() -> None:
    snapshot = failing(synthetic_snapshot(2), 0, Condition("lost"))
    model = NodeHealthModel("node-a")
    model.observe(view_of(snapshot), T0)
    first = model.condition()
    more_xids = replace(snapshot, gpus=tuple(replace(g, last_xid=79) for g in snapshot.gpus))
    model.observe(view_of(more_xids), T0 + 300)
    assert model.condition() == first


@pytest.mark.parametrize(
    ("kinds", "reason"),
    [
        (["xid 79", "recovery_action gpu_reset"], "XidError"),
        (["recovery_action node_reboot"], "RecoveryActionRequired"),
        (["xid 48", "ecc_dbe", "recovery_action gpu_reset"], "DoubleBitECC"),
        (["xid 79", "lost"], "GPULost"),
        (["unresponsive timeout", "ecc_dbe"], "Unresponsive"),
        (["row_remap_pending", "row_remap_failure"], "RowRemapFailure"),
        (["row_remap_pending"], "RowRemapPending"),
        (["discovery NVML_ERROR_UNKNOWN"], "DiscoveryFailed"),
        (["something_new"], "GPUUnhealthy"),
    ],
)
def test_the_worst_cause_names_the_reason(kinds: list[str], reason: str) -> None:
    conditions = tuple(Condition(*k.split(" ", 1)) for k in kinds)
    snapshot = failing(synthetic_snapshot(2), 1, *conditions)
    view = project(snapshot, SERVED)
    assert view is not None
    assert worst_reason(view.faults) == reason


def test_the_worst_cause_wins_across_gpus() -> None:
    snapshot = failing(synthetic_snapshot(4), 0, Condition("xid", "48"))
    snapshot = failing(snapshot, 2, Condition("lost"))
    view = project(snapshot, SERVED)
    assert view is not None
    assert worst_reason(view.faults) == "GPULost"
    assert REASONS[0] == ("lost", "GPULost")


def test_a_mig_instance_is_named_with_its_instances_and_its_holders_only() -> None:
    snapshot = synthetic_snapshot(2, mig=True, replicas=1)
    gpu = snapshot.gpus[1]
    target = gpu.mig_devices[2]
    migs = tuple(
        replace(m, health=GpuHealth((Condition("xid", "46"),))) if m is target else m
        for m in gpu.mig_devices
    )
    snapshot = replace(snapshot, gpus=(snapshot.gpus[0], replace(gpu, mig_devices=migs)))
    model = NodeHealthModel("node-a")
    model.observe(view_of(snapshot), T0)
    report = model.condition()
    assert report is not None
    assert (
        f"GPU 1 ({gpu_uuid(1)}) MIG 1g.10gb (GPU instance {target.gpu_instance_id}, compute "
        f"instance 0, {mig_uuid(1, target.gpu_instance_id)}): XID 46, GPU stopped processing"
    ) in report.message
    assert report.message.startswith("1 of 2 GPUs (14 MIG devices) unhealthy.")
    pods = [r for r in model.pending_events() if r.key.regarding.kind == "Pod"]
    assert len(pods) == 1  # only the pod holding that instance
    assert pods[0].key.regarding.name.startswith(
        f"pod-1-{mig_uuid(1, target.gpu_instance_id)[-4:]}"
    )
    assert not model.taint_wanted()


def test_a_whole_gpu_failing_reaches_every_pod_on_its_mig_devices() -> None:
    snapshot = failing(synthetic_snapshot(1, mig=True, replicas=1), 0, Condition("lost"))
    model = NodeHealthModel("node-a")
    model.observe(view_of(snapshot), T0)
    assert len([r for r in model.pending_events() if r.key.regarding.kind == "Pod"]) == 7
    assert model.taint_wanted()


def test_pod_events_name_the_pod_uid_where_its_processes_gave_it() -> None:
    """``kubectl describe pod`` lists only events whose object names the pod's UID: where the
    accounting learnt it from a process's cgroup the event carries it; elsewhere it cannot."""
    snapshot = failing(synthetic_snapshot(1, replicas=2), 0, Condition("ecc_dbe"))
    holders = sorted({(a.namespace, a.pod) for a in snapshot.pods.allocated})
    (known_ns, known_pod), (other_ns, other_pod) = holders
    uids = ((known_ns, known_pod, "4f1c1a4e-0000-4000-8000-000000000001"), ("x", "y", "z"))
    snapshot = replace(snapshot, usage=replace(snapshot.usage, pod_uids=uids))
    view = view_of(snapshot)
    assert view.pod_uids == uids[:1]  # only the holders' UIDs: other pods do not move the view
    model = NodeHealthModel("node-a")
    model.observe(view, T0)
    refs = {
        r.key.regarding.name: r.key.regarding.reference()
        for r in model.pending_events()
        if r.key.regarding.kind == "Pod"
    }
    assert refs[known_pod] == {
        "apiVersion": "v1", "kind": "Pod", "name": known_pod, "namespace": known_ns,
        "uid": "4f1c1a4e-0000-4000-8000-000000000001",
    }  # fmt: skip
    assert refs[other_pod] == {
        "apiVersion": "v1", "kind": "Pod", "name": other_pod, "namespace": other_ns,
    }  # fmt: skip


def test_a_holder_attributed_after_the_failure_is_told_once_per_episode() -> None:
    """Attribution lags a poll: a pod named as the failed GPU's holder only in a later view gets
    its event then; a pod told already is not told again until the GPU fails anew."""
    whole = failing(synthetic_snapshot(1, replicas=2), 0, Condition("ecc_dbe"))
    first, *rest = whole.pods.allocated
    late = {(a.namespace, a.pod) for a in rest} - {(first.namespace, first.pod)}
    assert late  # two pods hold the GPU's two replicas
    lagging = replace(whole, pods=replace(whole.pods, allocated=(first,)))

    def told(model: NodeHealthModel) -> dict[str, int]:
        return {
            r.key.regarding.name: r.count
            for r in model.events.values()
            if r.key.regarding.kind == "Pod"
        }

    model = NodeHealthModel("node-a")
    model.observe(view_of(lagging), T0)
    assert told(model) == {first.pod: 1}
    model.observe(view_of(whole), T0 + 5)
    assert told(model) == {first.pod: 1, **{pod: 1 for _, pod in late}}
    model.observe(view_of(lagging), T0 + 10)  # a holder missing from one view is not news
    model.observe(view_of(whole), T0 + 15)
    assert told(model) == {first.pod: 1, **{pod: 1 for _, pod in late}}
    healthy = replace(whole, gpus=tuple(replace(g, health=GpuHealth()) for g in whole.gpus))
    model.observe(view_of(healthy), T0 + 20)
    model.observe(view_of(whole), T0 + 25)  # failed anew: every holder is told again
    assert told(model) == {first.pod: 2, **{pod: 2 for _, pod in late}}


def test_the_message_is_bounded() -> None:
    snapshot = synthetic_snapshot(16)
    for index in range(16):
        snapshot = failing(snapshot, index, Condition("xid", "79"), Condition("ecc_dbe"))
    model = NodeHealthModel("node-a")
    model.observe(view_of(snapshot), T0)
    report = model.condition()
    assert report is not None
    assert report.message.count("unhealthy since") == MAX_LISTED
    assert report.message.endswith("And 8 more unhealthy devices.")
    assert len(report.message) < 4096
    assert model.taint_wanted()


def test_recovery_writes_one_normal_event_and_turns_the_condition_true() -> None:
    healthy = synthetic_snapshot(2, replicas=1)
    model = NodeHealthModel("node-a", node_uid="uid-1")
    model.observe(view_of(failing(healthy, 0, Condition("ecc_dbe"))), T0)
    before = {r.key for r in model.pending_events()}
    model.observe(view_of(healthy), T0 + 60)
    (recovered,) = [r for r in model.pending_events() if r.key not in before]
    assert (recovered.type, recovered.key.reason, recovered.action) == (
        "Normal", "GPURecovered", "MarkHealthy",
    )  # fmt: skip
    assert recovered.key.note == f"GPU 0 ({gpu_uuid(0)}) is healthy again"
    assert recovered.key.regarding.reference() == {
        "apiVersion": "v1", "kind": "Node", "name": "node-a", "uid": "uid-1",
    }  # fmt: skip
    report = model.condition()
    assert report is not None
    assert report.status == "True"


def test_a_flapping_gpu_folds_into_one_series_per_event() -> None:
    healthy = synthetic_snapshot(1)
    bad = failing(healthy, 0, Condition("xid", "79"))
    model = NodeHealthModel("node-a")
    model.observe(view_of(healthy), T0)
    for i in range(50):
        model.observe(view_of(bad), T0 + 2 * i)
        model.observe(view_of(healthy), T0 + 2 * i + 1)
    unhealthy, recovered = sorted(model.pending_events(), key=lambda r: r.key.reason, reverse=True)
    assert (unhealthy.key.reason, unhealthy.count, unhealthy.first, unhealthy.last) == (
        "GPUUnhealthy", 50, T0, T0 + 98,
    )  # fmt: skip
    assert (recovered.key.reason, recovered.count) == ("GPURecovered", 50)
    assert len(model.events) == 2


def test_a_written_series_is_patched_with_its_count_and_last_time() -> None:
    healthy = synthetic_snapshot(1)
    bad = failing(healthy, 0, Condition("lost"))
    model = NodeHealthModel("node-a")
    model.observe(view_of(bad), T0)
    (record,) = model.pending_events()
    model.written(record, event_name(record))
    assert model.pending_events() == []
    model.observe(view_of(healthy), T0 + 10)
    model.observe(view_of(bad), T0 + 20)
    repeat = next(r for r in model.pending_events() if r.key == record.key)
    assert (repeat.count, repeat.written, repeat.name) == (2, 1, event_name(record))
    assert series_patch(repeat) == {
        "series": {"count": 2, "lastObservedTime": "2026-01-01T00:00:20.000000Z"}
    }
    # An hour and more later the server may have dropped it: a new event, not a series.
    model.written(repeat, repeat.name)
    model.observe(view_of(healthy), T0 + 30)
    model.observe(view_of(bad), T0 + 30 + 3601)
    fresh = next(r for r in model.pending_events() if r.key == record.key)
    assert (fresh.count, fresh.written, fresh.first) == (1, 0, T0 + 3631)


def test_events_kept_are_bounded_and_what_is_dropped_is_counted() -> None:
    healthy = synthetic_snapshot(1)
    model = NodeHealthModel("node-a", max_events=10)
    for i in range(40):  # 40 different XIDs: 40 different notes
        model.observe(view_of(failing(healthy, 0, Condition("xid", str(100 + i)))), T0 + i)
        model.observe(view_of(healthy), T0 + i + 0.5)
    # 41 events (40 notes of unhealthy, one recovered series of 40): the oldest 31 go.
    assert len(model.events) == 10
    assert model.dropped_events == 41 - 10
    kept = model.pending_events()
    assert len(kept) == 10
    assert [r.count for r in kept if r.key.reason == "GPURecovered"] == [40]
    xids = sorted(int(r.key.note.split("XID ")[1][:3]) for r in kept if "XID" in r.key.note)
    assert xids == list(range(131, 140))  # the newest nine


def test_event_manifests_for_both_apis() -> None:
    model = NodeHealthModel("node-a")
    bad = failing(synthetic_snapshot(1, replicas=1), 0, Condition("xid", "79"))
    model.observe(view_of(bad), T0)
    pod = next(r for r in model.pending_events() if r.key.regarding.kind == "Pod")
    name = event_name(pod)
    new = event_manifest(pod, name=name, instance="node-a", api_version="events.k8s.io/v1")
    assert new["metadata"] == {"name": name, "namespace": "team-a"}
    assert (new["reportingController"], new["reportingInstance"]) == ("gpuagent", "node-a")
    assert (new["action"], new["reason"], new["type"]) == (
        "MarkUnhealthy",
        "GPUUnhealthy",
        "Warning",
    )
    assert new["eventTime"] == "2026-01-01T00:00:00.000000Z"
    assert "series" not in new
    assert new["regarding"]["kind"] == "Pod"
    core = event_manifest(pod, name=name, instance="node-a", api_version="v1")
    assert core["involvedObject"] == new["regarding"]
    assert core["message"] == new["note"]
    assert core["reportingComponent"] == "gpuagent"
    assert name.startswith(pod.key.regarding.name + ".")
    assert len(name) <= 253


def test_a_note_is_cut_at_the_api_limit() -> None:
    model = NodeHealthModel("node-a")
    long_detail = "x" * 3000
    bad = failing(synthetic_snapshot(1), 0, Condition("unresponsive", long_detail))
    model.observe(view_of(bad), T0)
    (record,) = model.pending_events()
    assert len(record.key.note) == NOTE_LIMIT


def test_the_condition_patch_names_only_gpuhealthy_and_the_times_given() -> None:
    model = NodeHealthModel("node-a")
    model.observe(view_of(synthetic_snapshot(1)), T0)
    report = model.condition()
    assert report is not None
    patch = condition_patch(report, transition=None, heartbeat=T0)
    assert patch == {"status": {"conditions": [{
        "type": "GPUHealthy", "status": "True", "reason": "AllGPUsHealthy",
        "message": "All 1 GPU are healthy", "lastHeartbeatTime": "2026-01-01T00:00:00Z",
    }]}}  # fmt: skip
