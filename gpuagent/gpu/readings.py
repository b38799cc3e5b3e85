"""From what the driver said to health facts: the poller's judgement, without threads or a clock.

A probe's readings become health events against what the GPU's earlier readings said
(:class:`Previous`): a recovery action only when it changed between two readings, a drop of the
volatile double-bit ECC count as evidence of a reset, the row-remapping state as read, and the
NVLink data counter as DCGM's bandwidth rate. A probe that a driver event overtook is stale: its
readings are kept, its health is not (the next probe decides). A GPU found lost or judged
unresponsive drops its readings; a GPU described again keeps what events recorded meanwhile. Each
change of a GPU's set of conditions is one log line, an XID that changes nothing one of its own.

:class:`~gpuagent.gpu.monitor.GpuMonitor` runs the calls and applies what this module decides.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from gpuagent.domain import xids
from gpuagent.domain.devices import Condition, Gpu, GpuHealth, Telemetry
from gpuagent.domain.health import (
    DISCOVERY,
    LOST,
    UNRESPONSIVE,
    GpuReset,
    HealthEvent,
    HealthPolicy,
    RecoveryActionChanged,
    Responding,
    RowRemapState,
    XidError,
    record_event,
)
from gpuagent.domain.snapshot import Snapshot
from gpuagent.gpu.backend import Probe

__all__ = [
    "KIB_PER_MB",
    "Judged",
    "Line",
    "Previous",
    "after_event",
    "has",
    "health_line",
    "is_described",
    "judge_probe",
    "map_gpu",
    "merge_description",
    "nvlink_rate",
    "recorded",
    "with_readings",
    "without_readings",
    "work_failed",
    "xid_evidence",
]

#: NVLink counters count KiB; DCGM's bandwidth is in MB (1024 KiB) per second.
KIB_PER_MB = 1024.0


@dataclass(frozen=True, slots=True)
class Previous:
    """What a GPU's earlier readings said, that its next reading is judged against.

    ``recovery_action``: the driver's recovery action as last read (by a probe or an event);
    ``ecc_dbe_volatile``: the volatile double-bit ECC count as last read (a drop is evidence of
    a reset); ``nvlink``: the NVLink data counter as last read, ``(KiB, when)``.
    """

    recovery_action: int = 0
    ecc_dbe_volatile: float = 0.0
    nvlink: tuple[float, float] | None = None


@dataclass(frozen=True, slots=True)
class Judged:
    """A probe judged: the health events to apply (in order), the telemetry with its NVLink
    rate, whether the readings go into the store, and what the next reading is judged against."""

    events: tuple[HealthEvent, ...]
    telemetry: Telemetry
    keep_readings: bool
    previous: Previous


def nvlink_rate(
    previous: tuple[float, float] | None, kib: float | None, taken_at: float
) -> tuple[float | None, tuple[float, float] | None]:
    """NVLink bandwidth as DCGM reports it: MB/s over all links since the GPU's last reading,
    and the counter to keep for the next one.

    From the NVLink data counter (KiB, TX + RX) of two readings: its growth over the time
    between them, in units of 1024 KiB. Absent for the first reading, after a counter that
    went back (a driver reload), or without the counter.
    """
    if kib is None:
        return None, None
    current = (kib, taken_at)
    if previous is None:
        return None, current
    seconds = taken_at - previous[1]
    if seconds <= 0 or kib < previous[0]:
        return None, current
    return (kib - previous[0]) / KIB_PER_MB / seconds, current


def judge_probe(probe: Probe, previous: Previous, *, stale: bool = False) -> Judged:
    """What ``probe`` says about its GPU, read against ``previous``.

    A stale probe (a driver event arrived while it ran) may predate the event and must not
    overtake it: no health events, and its readings are kept only when the GPU answered.
    """
    rate, nvlink = nvlink_rate(previous.nvlink, probe.nvlink_kib, probe.taken_at)
    telemetry = replace(probe.telemetry, nvlink_bandwidth_total=rate)
    if stale:
        answered = probe.events == (Responding(),)
        return Judged((), telemetry, answered, replace(previous, nvlink=nvlink))
    events = list(probe.events)
    action = previous.recovery_action
    if probe.recovery_action is not None:
        # Only a change between two readings is a signal: an unchanged "none" after an XID
        # must not clear it, nor may a reading taken before an event overtake the event.
        action = probe.recovery_action
        if probe.recovery_action != previous.recovery_action:
            events.append(RecoveryActionChanged(probe.recovery_action))
    dbe = telemetry.ecc_dbe_volatile
    if dbe is None:
        dbe = previous.ecc_dbe_volatile
    elif dbe < previous.ecc_dbe_volatile:
        events.append(GpuReset())  # volatile counts restart at a reset
    if telemetry.row_remap_pending is not None or telemetry.row_remap_failure is not None:
        events.append(
            RowRemapState(
                pending=bool(telemetry.row_remap_pending),
                failed=bool(telemetry.row_remap_failure),
            )
        )
    return Judged(tuple(events), telemetry, True, Previous(action, dbe, nvlink))


def after_event(previous: Previous, event: HealthEvent) -> Previous:
    """``previous`` once the driver delivered ``event`` (a recovery action is a reading too)."""
    if isinstance(event, RecoveryActionChanged):
        return replace(previous, recovery_action=event.action)
    return previous


def with_readings(gpu: Gpu, probe: Probe, telemetry: Telemetry) -> Gpu:
    """``gpu`` with a probe's readings: its telemetry, processes and MIG devices' telemetry."""
    migs = gpu.mig_devices
    instances = probe.mig_telemetry
    if instances:
        migs = tuple(
            replace(m, telemetry=instances[m.uuid]) if m.uuid in instances else m for m in migs
        )
    return replace(gpu, telemetry=telemetry, processes=probe.processes, mig_devices=migs)


def recorded(gpu: Gpu, event: HealthEvent, policy: HealthPolicy) -> Gpu:
    """``gpu`` with ``event`` recorded by ``policy``; a GPU found lost or judged unresponsive
    keeps no readings (they are from before it stopped answering: served, they would read as
    current) until it answers a probe again."""
    after = record_event(gpu, event, policy)
    return without_readings(after) if has(after, LOST) or has(after, UNRESPONSIVE) else after


def without_readings(gpu: Gpu) -> Gpu:
    """``gpu`` without readings: no telemetry (its MIG devices' neither), no processes."""
    blank = Telemetry()
    if (
        gpu.processes is None
        and gpu.telemetry == blank
        and all(m.telemetry == blank for m in gpu.mig_devices)
    ):
        return gpu
    migs = tuple(replace(m, telemetry=blank) for m in gpu.mig_devices)
    return replace(gpu, telemetry=blank, processes=None, mig_devices=migs)


@dataclass(frozen=True, slots=True)
class Line:
    """A log line about a GPU's health: a warning or an info line, its event and fields."""

    warning: bool
    event: str
    fields: Mapping[str, object]


def health_line(
    index: int, before: Gpu, after: Gpu, event: HealthEvent, policy: HealthPolicy
) -> Line | None:
    """The line ``event`` is worth, from the GPU before and after it; ``None`` for none.

    One line per change of the GPU's set of conditions (their order, or the liveness strikes
    counted meanwhile, are no change); an XID that changes nothing gets a line of its own, a
    warning when the policy checks it. An XID's line names its catalog meaning and immediate
    action (as ``gpuagent_xid_errors_total`` labels it).
    """
    old, new = before.overall_health, after.overall_health
    if set(old.conditions) != set(new.conditions):
        fields: dict[str, object] = {
            "gpu": index,
            "uuid": after.uuid,
            "health": new.kubelet_health,
            "reason": new.reason,
            "cause": type(event).__name__,
        }
        return Line(not new.healthy, "gpu health changed", fields | xid_evidence(event))
    if isinstance(event, XidError):
        fields = {"gpu": index, "uuid": after.uuid, "health": new.kubelet_health}
        return Line(policy.checks_xid(event.xid), "xid reported", fields | xid_evidence(event))
    return None


def xid_evidence(event: HealthEvent) -> dict[str, object]:
    """An XID's catalog meaning and immediate action, and the MIG instance it names."""
    if not isinstance(event, XidError):
        return {}
    entry = xids.lookup(event.xid)
    fields: dict[str, object] = {
        "xid": event.xid,
        "xid_meaning": entry.text,
        "xid_action": entry.action.value,
    }
    if event.gpu_instance is not None:
        fields["gpu_instance"] = event.gpu_instance
    if event.compute_instance is not None:
        fields["compute_instance"] = event.compute_instance
    return fields


def is_described(gpu: Gpu) -> bool:
    """Whether ``gpu`` came back described (neither undescribable nor lost)."""
    return not has(gpu, DISCOVERY) and not has(gpu, LOST)


def merge_description(snapshot: Snapshot, gpu: Gpu) -> Snapshot:
    """``snapshot`` with a (re-)described GPU, keeping what events recorded meanwhile: their
    conditions (not the discovery or unresponsive ones), XID counts and telemetry, the GPU's and
    each MIG device's that is still there."""
    index = gpu.index
    before = snapshot.gpu(index)
    if before is None:
        gpus = tuple(sorted((*snapshot.gpus, gpu), key=lambda g: g.index))
        return replace(snapshot, gpus=gpus)
    kept = tuple(c for c in before.health.conditions if c.kind not in (DISCOVERY, UNRESPONSIVE))
    earlier = {m.uuid: m for m in before.mig_devices}
    migs = tuple(
        replace(m, health=earlier[m.uuid].health, telemetry=earlier[m.uuid].telemetry)
        if m.uuid in earlier
        else m
        for m in gpu.mig_devices
    )
    merged = replace(
        gpu,
        mig_devices=migs,
        health=GpuHealth(_union(kept, gpu.health.conditions)),
        xid_counts=before.xid_counts,
        last_xid=before.last_xid,
        telemetry=before.telemetry,
    )
    return map_gpu(snapshot, index, lambda _: merged)


def work_failed(result: object) -> bool:
    """Whether a piece of NVML work failed, by what it returned (a probe, a description)."""
    if isinstance(result, Probe):
        return result.events != (Responding(),)
    if isinstance(result, Gpu):
        return bool(result.health.conditions) or not result.uuid
    return False


def has(gpu: Gpu, kind: str) -> bool:
    return any(c.kind == kind for c in gpu.health.conditions)


def _union(first: tuple[Condition, ...], second: tuple[Condition, ...]) -> tuple[Condition, ...]:
    return first + tuple(c for c in second if c not in first)


def map_gpu(snapshot: Snapshot, index: int, change: Callable[[Gpu], Gpu]) -> Snapshot:
    gpus = tuple(change(g) if g.index == index else g for g in snapshot.gpus)
    return replace(snapshot, gpus=gpus)
