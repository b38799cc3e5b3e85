"""The poller's judgement (`gpuagent.gpu.readings`): readings to health facts, without threads."""

from __future__ import annotations

from dataclasses import replace

import pytest
from support.nodes import gpu, mig, node

from gpuagent.domain.devices import Condition, GpuHealth, Telemetry
from gpuagent.domain.health import (
    DoubleBitEccError,
    GpuLost,
    GpuReset,
    HealthEvent,
    HealthPolicy,
    LivenessFailed,
    RecoveryActionChanged,
    Responding,
    RowRemapState,
    XidError,
)
from gpuagent.domain.usage import GpuProcess, ProcessReading
from gpuagent.gpu.backend import Probe
from gpuagent.gpu.readings import (
    Previous,
    after_event,
    health_line,
    judge_probe,
    merge_description,
    nvlink_rate,
    recorded,
    with_readings,
    work_failed,
)

POLICY = HealthPolicy()
READ = Telemetry(temperature_c=40.0, energy_mj=1e6)


def probe(
    *events: HealthEvent, action: int | None = None, taken_at: float = 0.0, **telemetry: float
) -> Probe:
    """A probe that answered (``Responding``) unless ``events`` say otherwise."""
    nvlink = telemetry.pop("nvlink_kib", None)
    return Probe(
        events=tuple(events) or (Responding(),),
        telemetry=replace(READ, **telemetry),
        recovery_action=action,
        nvlink_kib=nvlink,
        taken_at=taken_at,
    )


# ----- a probe judged against the GPU's previous reading ----------------------------------------
def test_a_recovery_action_is_an_event_only_when_it_changes() -> None:
    """An unchanged "none" after an XID must not clear it: only a change between two readings
    is a signal, and a reading without the field changes nothing."""
    first = judge_probe(probe(action=0), Previous())
    assert first.events == (Responding(),)
    second = judge_probe(probe(action=1), first.previous)
    assert second.events == (Responding(), RecoveryActionChanged(1))
    assert judge_probe(probe(action=1), second.previous).events == (Responding(),)
    unread = judge_probe(probe(), second.previous)
    assert unread.events == (Responding(),)
    assert unread.previous.recovery_action == 1
    # An event read the action too: the next probe reading it is no change.
    after = after_event(Previous(), RecoveryActionChanged(2))
    assert judge_probe(probe(action=2), after).events == (Responding(),)
    assert after_event(after, XidError(79)) == after


def test_a_drop_of_the_volatile_dbe_count_is_a_reset() -> None:
    """Volatile ECC counts restart at a reset: a count lower than the last one is evidence."""
    counted = judge_probe(probe(ecc_dbe_volatile=2.0), Previous())
    assert counted.events == (Responding(),)
    assert counted.previous.ecc_dbe_volatile == 2.0
    assert judge_probe(probe(ecc_dbe_volatile=3.0), counted.previous).events == (Responding(),)
    reset = judge_probe(probe(ecc_dbe_volatile=0.0), counted.previous)
    assert reset.events == (Responding(), GpuReset())
    unread = judge_probe(probe(), counted.previous)
    assert unread.previous.ecc_dbe_volatile == 2.0


@pytest.mark.parametrize(
    ("pending", "failure", "expected"),
    [
        (None, None, None),
        (1.0, 0.0, RowRemapState(pending=True, failed=False)),
        (None, 1.0, RowRemapState(pending=False, failed=True)),
        (0.0, 0.0, RowRemapState(pending=False, failed=False)),
    ],
)
def test_the_row_remapping_state_is_reported_as_read(
    pending: float | None, failure: float | None, expected: RowRemapState | None
) -> None:
    read = probe()
    read = replace(
        read,
        telemetry=replace(read.telemetry, row_remap_pending=pending, row_remap_failure=failure),
    )
    events = judge_probe(read, Previous()).events
    assert events == (Responding(),) + (() if expected is None else (expected,))


def test_the_events_of_one_probe_come_in_order() -> None:
    """What the liveness check said, then the recovery action, a reset, the remapping state."""
    read = probe(LivenessFailed("Unknown Error (NVML 999)"), action=1, ecc_dbe_volatile=0.0)
    read = replace(read, telemetry=replace(read.telemetry, row_remap_pending=1.0))
    judged = judge_probe(read, Previous(ecc_dbe_volatile=4.0))
    assert judged.events == (
        LivenessFailed("Unknown Error (NVML 999)"),
        RecoveryActionChanged(1),
        GpuReset(),
        RowRemapState(pending=True, failed=False),
    )
    assert judged.keep_readings


@pytest.mark.parametrize(("answered", "keep"), [(Responding(), True), (GpuLost(), False)])
def test_a_stale_probe_keeps_its_readings_not_its_verdict(
    answered: HealthEvent, keep: bool
) -> None:
    """A driver event arrived while the probe ran: its health may predate the event and must not
    overtake it; only a GPU that answered has its readings kept."""
    before = Previous(recovery_action=1, ecc_dbe_volatile=4.0)
    judged = judge_probe(probe(answered, action=0, ecc_dbe_volatile=0.0), before, stale=True)
    assert judged.events == ()
    assert judged.keep_readings is keep
    assert judged.previous == before


# ----- NVLink bandwidth: DCGM's rate from the counter -------------------------------------------
def test_nvlink_bandwidth_is_a_rate_in_mb_per_second() -> None:
    """The NVLink data counter (KiB) of two readings becomes MB/s (1024 KiB) between them."""
    first = judge_probe(probe(nvlink_kib=10_000.0, taken_at=100.0), Previous())
    assert first.telemetry.nvlink_bandwidth_total is None  # one reading
    second = judge_probe(probe(nvlink_kib=10_000.0 + 5 * 2048, taken_at=105.0), first.previous)
    assert second.telemetry.nvlink_bandwidth_total == pytest.approx(2.0)
    assert second.previous.nvlink == (10_000.0 + 5 * 2048, 105.0)
    # A stale probe still moves the counter on: the next rate spans from it.
    stale = judge_probe(probe(nvlink_kib=25_360.0, taken_at=110.0), second.previous, stale=True)
    assert stale.telemetry.nvlink_bandwidth_total == pytest.approx(1.0)
    assert stale.previous.nvlink == (25_360.0, 110.0)


@pytest.mark.parametrize(
    ("previous", "kib", "taken_at"),
    [
        ((5_000.0, 100.0), 4_000.0, 105.0),  # the counter went back: a driver reload
        ((5_000.0, 100.0), 6_000.0, 100.0),  # no time between the readings
        ((5_000.0, 100.0), None, 105.0),  # no counter (and none kept)
    ],
    ids=["counter-back", "same-time", "no-counter"],
)
def test_no_nvlink_rate_without_two_good_readings(
    previous: tuple[float, float], kib: float | None, taken_at: float
) -> None:
    rate, kept = nvlink_rate(previous, kib, taken_at)
    assert rate is None
    assert kept == (None if kib is None else (kib, taken_at))


# ----- events recorded on a GPU ------------------------------------------------------------------
def test_readings_go_to_the_gpu_and_its_mig_devices() -> None:
    device = gpu(0, migs=[mig(0, 1), mig(0, 2)])
    mine = Telemetry(fb_used_mib=100.0)
    read = replace(probe(), mig_telemetry={device.mig_devices[1].uuid: mine})
    processes = ProcessReading(processes=(GpuProcess(pid=7, used_memory_bytes=1),))
    read = replace(read, processes=processes)
    after = with_readings(device, read, READ)
    assert after.telemetry == READ
    assert after.processes == processes
    assert [m.telemetry for m in after.mig_devices] == [Telemetry(), mine]


def test_a_gpu_found_lost_keeps_no_readings() -> None:
    """Readings from before a GPU fell off the bus are dropped with it; other events keep them."""
    device = with_readings(gpu(0, migs=[mig(0, 1)]), probe(), READ)
    device = replace(
        device,
        processes=ProcessReading(),
        mig_devices=tuple(replace(m, telemetry=READ) for m in device.mig_devices),
    )
    lost = recorded(device, GpuLost(), POLICY)
    assert Condition("lost") in lost.health.conditions
    assert (lost.telemetry, lost.processes) == (Telemetry(), None)
    assert [m.telemetry for m in lost.mig_devices] == [Telemetry()]
    dbe = recorded(device, DoubleBitEccError(), POLICY)
    assert (dbe.telemetry, dbe.processes) == (READ, ProcessReading())


def test_a_gpu_judged_unresponsive_keeps_no_readings_until_it_answers() -> None:
    """Failed liveness checks keep the readings until the verdict (one is not a verdict); the
    verdict drops them, with the MIG devices' and the processes; an answer clears it, and the
    probe's readings are the GPU's again."""
    device = with_readings(gpu(0, migs=[mig(0, 1)]), probe(), READ)
    device = replace(
        device,
        processes=ProcessReading(),
        mig_devices=tuple(replace(m, telemetry=READ) for m in device.mig_devices),
    )
    seen = []
    for _ in range(POLICY.liveness_strikes):
        device = recorded(device, LivenessFailed("no answer within 10s"), POLICY)
        seen.append((device.health.healthy, device.telemetry == READ))
    assert seen == [(True, True), (True, True), (False, False)]
    assert device.processes is None
    assert [m.telemetry for m in device.mig_devices] == [Telemetry()]
    again = recorded(device, LivenessFailed("an earlier nvml call has not returned"), POLICY)
    assert again.telemetry == Telemetry()
    answered = with_readings(recorded(again, Responding(), POLICY), probe(), READ)
    assert (answered.health.healthy, answered.telemetry) == (True, READ)


# ----- log lines --------------------------------------------------------------------------------
def test_health_log_lines_follow_the_set_of_conditions() -> None:
    """A line per change of the set of conditions, none when only their order changes; an XID's
    line names its catalog meaning and immediate action, whether or not it changes health."""
    healthy = gpu(0)
    ecc = recorded(recorded(healthy, RecoveryActionChanged(1), POLICY), DoubleBitEccError(), POLICY)
    again = recorded(ecc, RecoveryActionChanged(1), POLICY)  # the same action again: reordered
    assert [c.kind for c in again.health.conditions] == ["ecc_dbe", "recovery_action"]
    assert health_line(0, ecc, again, RecoveryActionChanged(1), POLICY) is None

    lines = []
    before = gpu(1)
    for event in (XidError(13), XidError(79), XidError(79)):
        after = recorded(before, event, POLICY)
        lines.append(health_line(1, before, after, event, POLICY))
        before = after
    assert [(line.event, line.warning, line.fields["xid"]) for line in lines if line] == [
        ("xid reported", False, 13),  # the application's fault: health unchanged
        ("gpu health changed", True, 79),
        ("xid reported", True, 79),  # again: changed nothing
    ]
    assert lines[0] is not None
    assert lines[1] is not None
    assert dict(lines[0].fields) == {
        "gpu": 1,
        "uuid": gpu(1).uuid,
        "health": "Healthy",
        "xid": 13,
        "xid_meaning": "Graphics Engine Exception",
        "xid_action": "RESTART_APP",
    }
    assert (
        lines[1].fields["xid_meaning"],
        lines[1].fields["xid_action"],
        lines[1].fields["reason"],
        lines[1].fields["cause"],
    ) == ("GPU has fallen off the bus", "RESTART_BM", "xid 79", "XidError")


def test_a_gpu_back_to_health_is_an_info_line_naming_its_instance() -> None:
    sick = recorded(gpu(2), XidError(48, 1, 0), POLICY)
    line = health_line(2, gpu(2), sick, XidError(48, 1, 0), POLICY)
    assert line is not None
    assert (line.warning, line.fields["gpu_instance"], line.fields["compute_instance"]) == (
        True,
        1,
        0,
    )
    well = recorded(sick, GpuReset(), POLICY)
    line = health_line(2, sick, well, GpuReset(), POLICY)
    assert line is not None
    assert (line.event, line.warning, line.fields["health"]) == (
        "gpu health changed",
        False,
        "Healthy",
    )
    assert "xid" not in line.fields


# ----- descriptions -----------------------------------------------------------------------------
def test_a_description_keeps_what_events_recorded_meanwhile() -> None:
    """A GPU described late keeps the conditions events gave it (not the placeholder's), its
    XID counts and telemetry; a GPU not yet in the snapshot is added in index order."""
    placeholder = replace(
        gpu(1),
        health=GpuHealth((Condition("unresponsive", "nvmlDeviceGetName"), Condition("xid", "79"))),
        xid_counts={79: 1},
        last_xid=79,
        telemetry=READ,
    )
    merged = merge_description(node(gpu(0), placeholder), gpu(1))
    taken = merged.gpu(1)
    assert taken is not None
    assert taken.health.conditions == (Condition("xid", "79"),)
    assert (dict(taken.xid_counts), taken.last_xid, taken.telemetry) == ({79: 1}, 79, READ)
    added = merge_description(node(gpu(0), gpu(2)), gpu(1))
    assert [g.index for g in added.gpus] == [0, 1, 2]


def test_work_failed_by_what_it_returned() -> None:
    assert not work_failed(probe())
    assert work_failed(probe(LivenessFailed("timeout")))
    assert not work_failed(gpu(0))
    assert work_failed(gpu(0, healthy=False))
    assert work_failed(replace(gpu(0), uuid=""))
    assert not work_failed(None)
