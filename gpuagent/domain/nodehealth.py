"""What Kubernetes is told about this node's GPUs: the ``GPUHealthy`` Node condition, Events on
the Node and on the pods that hold a failing GPU, and the optional ``nvidia.com/gpu-unhealthy``
taint — as pure values built from a :class:`~gpuagent.domain.devices.NodeState`.

:func:`project` reduces a snapshot to a :class:`NodeHealthView`: the unhealthy GPUs and MIG
devices with their conditions, and the pods holding them. A writer acts only when that view
changes (a poll that changes a temperature changes nothing here). :class:`NodeHealthModel` folds
successive views into what should be written:

- the **condition**: ``True``/``AllGPUsHealthy``, or ``False`` with the worst cause's reason
  (:data:`REASONS`, worst first) and a message naming each affected device (index, UUID, MIG
  instance), its evidence (XID number and catalog meaning, the catalog's or the driver's
  recommended action) and since when it has been unhealthy (a time, never a duration: the message
  changes only when the facts do);
- **events**: one when a device turns unhealthy (with its evidence) and one when it recovers, on
  the Node; one on each pod holding the device when it turns unhealthy. An event that repeats (a
  device flapping) is folded into the existing event's series (count, last time), never written
  again as a new event. At most :data:`MAX_EVENTS` are kept (pending or written); past that the
  oldest written ones are forgotten first, then the oldest pending ones are dropped and counted.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any, Literal

from gpuagent.domain import xids
from gpuagent.domain.attribution import Target, attributions, by_device
from gpuagent.domain.devices import Condition, Gpu, NodeState, PodRef
from gpuagent.domain.health import (
    DISCOVERY,
    ECC_DBE,
    LOST,
    RECOVERY,
    ROW_REMAP_FAILURE,
    ROW_REMAP_PENDING,
    UNRESPONSIVE,
    XID,
)

__all__ = [
    "CONDITION_TYPE",
    "HEALTHY_REASON",
    "REASONS",
    "REPORTING_CONTROLLER",
    "TAINT_KEY",
    "ConditionReport",
    "DeviceRef",
    "EventRecord",
    "Fault",
    "NodeHealthModel",
    "NodeHealthView",
    "Regarding",
    "condition_patch",
    "event_manifest",
    "project",
    "series_patch",
]

CONDITION_TYPE = "GPUHealthy"
HEALTHY_REASON = "AllGPUsHealthy"
TAINT_KEY = "nvidia.com/gpu-unhealthy"
REPORTING_CONTROLLER = "gpuagent"

#: Reasons of the condition, worst cause first: the reason is the worst cause on any device.
#: A cause outranks the driver's remedy: an XID with the recovery action it brought reads
#: ``XidError`` (the action is in the message); the action alone reads ``RecoveryActionRequired``.
REASONS: tuple[tuple[str, str], ...] = (
    (LOST, "GPULost"),
    (UNRESPONSIVE, "Unresponsive"),
    (ECC_DBE, "DoubleBitECC"),
    (ROW_REMAP_FAILURE, "RowRemapFailure"),
    (XID, "XidError"),
    (RECOVERY, "RecoveryActionRequired"),
    (ROW_REMAP_PENDING, "RowRemapPending"),
    (DISCOVERY, "DiscoveryFailed"),
)
_RANK = {kind: rank for rank, (kind, _) in enumerate(REASONS)}
_REASON = dict(REASONS)
#: The reason of a condition kind this table does not know (ranked last).
OTHER_REASON = "GPUUnhealthy"

#: Devices named one by one in the condition's message; the rest are counted.
MAX_LISTED = 8
#: The API server's limit on an event's note.
NOTE_LIMIT = 1024
#: Events kept (pending or written, for their series).
MAX_EVENTS = 256

#: The catalog's immediate action, as the message says it.
ACTION_TEXT: Mapping[xids.Action, str] = {
    xids.Action.IGNORE: "none",
    xids.Action.RESTART_APP: "restart the application",
    xids.Action.RESTART_VM: "restart the virtual machine",
    xids.Action.RESET_GPU: "reset the GPU",
    xids.Action.RESTART_BM: "restart the node",
    xids.Action.CONTACT_SUPPORT: "contact NVIDIA support",
    xids.Action.CHECK_MECHANICALS: "check the GPU's seating and power connections",
    xids.Action.CHECK_UVM: "reset the GPU if UVM or vGPU is in use",
    xids.Action.UPDATE_SWFW: "update the driver and firmware",
    xids.Action.WORKFLOW_XID_45: "follow the XID it came with",
    xids.Action.WORKFLOW_XID_48: "reset the GPU (drain and reset with XID 63 or 64)",
    xids.Action.WORKFLOW_NVLINK_ERR: "decode the NVLink error registers",
    xids.Action.WORKFLOW_NVLINK5_ERR: "decode the NVLink error (XID catalog, 144-150)",
    xids.Action.XID_154: "follow the driver's recovery action",
    xids.Action.NONE: "none named by the catalog",
}
#: The driver's recovery action (``recovery_action <name>``), as the message says it.
RECOVERY_TEXT: Mapping[str, str] = {
    "gpu_reset": "reset the GPU",
    "node_reboot": "reboot the node",
    "drain_p2p": "drain peer-to-peer traffic",
    "drain_and_reset": "drain the GPU's work, then reset it",
    "recover_imex_domain": "recover the IMEX domain",
    "bus_reset": "reset the GPU's PCIe bus",
    "system_reboot": "reboot the system",
}

EventType = Literal["Normal", "Warning"]
_What = tuple[EventType, str, str]  # an event's type, reason and action
#: A device turned unhealthy (on the Node and on each pod holding it); a device recovered.
UNHEALTHY: _What = ("Warning", "GPUUnhealthy", "MarkUnhealthy")
RECOVERED: _What = ("Normal", "GPURecovered", "MarkHealthy")


# ----- the view ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, order=True)
class DeviceRef:
    """A GPU, or one MIG device of it (``gpu_instance`` set)."""

    gpu: int
    uuid: str
    gpu_instance: int | None = None
    compute_instance: int | None = None
    mig_uuid: str = ""
    profile: str = ""

    def __str__(self) -> str:
        text = f"GPU {self.gpu} ({self.uuid})"
        if self.gpu_instance is None:
            return text
        return (
            f"{text} MIG {self.profile} (GPU instance {self.gpu_instance}, compute instance "
            f"{self.compute_instance}, {self.mig_uuid})"
        )


@dataclass(frozen=True, slots=True)
class Fault:
    """One unhealthy device and why (its conditions, as the health policy keeps them)."""

    device: DeviceRef
    conditions: tuple[Condition, ...]


@dataclass(frozen=True, slots=True)
class NodeHealthView:
    """What the node's health writers act on: comparable, so a writer acts only on a change."""

    gpus: int = 0
    mig_devices: int = 0
    faults: tuple[Fault, ...] = ()
    # The pods holding each unhealthy device (per the kubelet's pod-resources), sorted.
    holders: tuple[tuple[DeviceRef, tuple[PodRef, ...]], ...] = ()
    # Every GPU of the node (there is at least one) has no healthy device left.
    all_unhealthy: bool = False

    @property
    def healthy(self) -> bool:
        return not self.faults

    def holders_of(self, device: DeviceRef) -> tuple[PodRef, ...]:
        for ref, pods in self.holders:
            if ref == device:
                return pods
        return ()


def project(snapshot: NodeState, served: Collection[str]) -> NodeHealthView | None:
    """The view of ``snapshot`` (``served``: the resources this agent serves, whose pods are
    attributed); ``None`` until the GPUs are discovered (nothing true can be said before)."""
    if not snapshot.discovered:
        return None
    faults: list[Fault] = []
    for gpu in sorted(snapshot.gpus, key=lambda g: g.index):
        whole = DeviceRef(gpu.index, gpu.uuid)
        if gpu.health.conditions:
            faults.append(Fault(whole, gpu.health.conditions))
        for mig in gpu.mig_devices:
            if mig.health.conditions:
                ref = DeviceRef(
                    gpu.index,
                    gpu.uuid,
                    mig.gpu_instance_id,
                    mig.compute_instance_id,
                    mig.uuid,
                    mig.profile,
                )
                faults.append(Fault(ref, mig.health.conditions))
    holders: tuple[tuple[DeviceRef, tuple[PodRef, ...]], ...] = ()
    if faults and snapshot.pods.allocated:
        held = attributions(snapshot, by_device(snapshot.pods.allocated, served))
        holders = tuple(
            (fault.device, pods) for fault in faults if (pods := _held(fault.device, held))
        )
    gpus = snapshot.gpus
    return NodeHealthView(
        gpus=len(gpus),
        mig_devices=sum(len(g.mig_devices) for g in gpus),
        faults=tuple(faults),
        holders=holders,
        all_unhealthy=bool(gpus) and all(_unusable(g) for g in gpus),
    )


def _held(device: DeviceRef, held: Mapping[Target, tuple[PodRef, ...]]) -> tuple[PodRef, ...]:
    if device.gpu_instance is not None:
        return held.get(Target(device.gpu, device.gpu_instance), ())
    # A whole GPU failing fails each of its MIG devices too.
    refs = {ref for target, pods in held.items() if target.gpu == device.gpu for ref in pods}
    return tuple(sorted(refs, key=lambda r: (r.namespace, r.pod, r.container)))


def _unusable(gpu: Gpu) -> bool:
    if not gpu.health.healthy:
        return True
    return bool(gpu.mig_devices) and all(not m.health.healthy for m in gpu.mig_devices)


# ----- words -------------------------------------------------------------------------------------


def evidence(condition: Condition) -> str:
    """What one condition says, for people: the XID's meaning and the action to take."""
    kind, detail = condition.kind, condition.detail
    if kind == XID and detail.isdigit():
        entry = xids.lookup(int(detail))
        return (
            f"XID {entry.code}, {entry.text} "
            f"(recommended action: {ACTION_TEXT.get(entry.action, entry.action.value)})"
        )
    if kind == ECC_DBE:
        return "double-bit ECC error (recommended action: reset the GPU)"
    if kind == LOST:
        return "the GPU has fallen off the bus (recommended action: restart the node)"
    if kind == RECOVERY:
        return f"the driver's recovery action: {RECOVERY_TEXT.get(detail, detail)}"
    if kind == ROW_REMAP_PENDING:
        return "a memory row remap is pending (recommended action: reset the GPU)"
    if kind == ROW_REMAP_FAILURE:
        return "memory row remapping failed (recommended action: contact NVIDIA support)"
    if kind == UNRESPONSIVE:
        return f"the GPU does not answer the driver ({detail})" if detail else "unresponsive"
    if kind == DISCOVERY:
        return f"the GPU could not be described ({detail})" if detail else "not described"
    return str(condition)


def _evidence(conditions: Iterable[Condition]) -> str:
    return "; ".join(evidence(c) for c in sorted(conditions, key=_rank_of))


def _rank_of(condition: Condition) -> int:
    return _RANK.get(condition.kind, len(REASONS))


def worst_reason(faults: Iterable[Fault]) -> str:
    """The reason of the worst cause among ``faults``."""
    conditions = [c for fault in faults for c in fault.conditions]
    if not conditions:
        return HEALTHY_REASON
    return _REASON.get(min(conditions, key=_rank_of).kind, OTHER_REASON)


def rfc3339(seconds: float) -> str:
    """A ``metav1.Time``: UTC, to the second."""
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def micro_time(seconds: float) -> str:
    """A ``metav1.MicroTime``: UTC, to the microsecond."""
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _truncated(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


# ----- the condition -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ConditionReport:
    """The condition as it should read (times aside)."""

    status: Literal["True", "False"]
    reason: str
    message: str


def condition_report(view: NodeHealthView, since: Mapping[DeviceRef, float]) -> ConditionReport:
    """The condition for ``view``; ``since``: when each unhealthy device turned so (wall time)."""
    units = f"{view.gpus} GPU{'s' if view.gpus != 1 else ''}"
    if view.mig_devices:
        units += f" ({view.mig_devices} MIG device{'s' if view.mig_devices != 1 else ''})"
    if view.healthy:
        return ConditionReport("True", HEALTHY_REASON, f"All {units} are healthy")
    affected = len({f.device.gpu for f in view.faults})
    entries = [
        f"{fault.device}: {_evidence(fault.conditions)}; unhealthy since "
        f"{rfc3339(since.get(fault.device, 0.0))}."
        for fault in view.faults[:MAX_LISTED]
    ]
    more = len(view.faults) - MAX_LISTED
    if more > 0:
        entries.append(f"And {more} more unhealthy device{'s' if more != 1 else ''}.")
    message = f"{affected} of {units} unhealthy. " + " ".join(entries)
    return ConditionReport("False", worst_reason(view.faults), message)


def condition_patch(
    report: ConditionReport, *, transition: float | None, heartbeat: float | None
) -> dict[str, Any]:
    """A strategic-merge patch of ``nodes/status`` that names only the ``GPUHealthy`` condition
    (``conditions`` merge on ``type``: the kubelet's are left as they are). A time left ``None``
    is not sent, so the one on the Node stays."""
    condition: dict[str, Any] = {
        "type": CONDITION_TYPE,
        "status": report.status,
        "reason": report.reason,
        "message": report.message,
    }
    if heartbeat is not None:
        condition["lastHeartbeatTime"] = rfc3339(heartbeat)
    if transition is not None:
        condition["lastTransitionTime"] = rfc3339(transition)
    return {"status": {"conditions": [condition]}}


# ----- events ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Regarding:
    """The object an event is about: this Node, or a pod."""

    kind: Literal["Node", "Pod"]
    name: str
    namespace: str = ""
    uid: str = ""

    def reference(self) -> dict[str, str]:
        ref = {"apiVersion": "v1", "kind": self.kind, "name": self.name}
        if self.namespace:
            ref["namespace"] = self.namespace
        if self.uid:
            ref["uid"] = self.uid
        return ref

    @property
    def event_namespace(self) -> str:
        """Where its events live: the pod's namespace; ``default`` for the Node (as the
        kubelet's node events)."""
        return self.namespace or "default"


@dataclass(frozen=True, slots=True)
class EventKey:
    """What makes two occurrences the same event (and so one series)."""

    regarding: Regarding
    reason: str
    note: str


@dataclass(frozen=True, slots=True)
class EventRecord:
    """An event: its occurrences (``count``, first and last, wall time) and what of it is
    written (``written`` occurrences, as ``name``; 0 before it is created)."""

    key: EventKey
    type: EventType
    action: str
    first: float
    last: float
    count: int = 1
    written: int = 0
    name: str = ""

    @property
    def pending(self) -> bool:
        return self.count > self.written


@dataclass
class NodeHealthModel:
    """Successive views of one node, folded into the condition and the events to write."""

    node: str
    node_uid: str = ""
    #: A repeat later than this after the last occurrence starts a new event (the API server
    #: keeps events an hour by default: the old one may be gone).
    series_ttl: float = 3600.0
    max_events: int = MAX_EVENTS
    view: NodeHealthView | None = None
    since: dict[DeviceRef, float] = field(default_factory=dict)
    events: dict[EventKey, EventRecord] = field(default_factory=dict)
    dropped_events: int = 0

    def observe(self, view: NodeHealthView, now: float) -> bool:
        """Take ``view`` in (``now``: wall time); returns whether anything changed."""
        if view == self.view:
            return False
        before = {f.device for f in self.view.faults} if self.view is not None else set()
        after = {f.device: f for f in view.faults}
        node = Regarding("Node", self.node, uid=self.node_uid)
        for device, fault in after.items():
            if device in before:
                continue
            self.since[device] = now
            detail = _evidence(fault.conditions)
            self._occurred(node, UNHEALTHY, f"{device} is unhealthy: {detail}", now)
            for pod, containers in _by_pod(view.holders_of(device)):
                names = ", ".join(containers)
                plural = "s" if len(containers) > 1 else ""
                note = f"{device} allocated to this pod (container{plural} {names}) failed: "
                self._occurred(pod, UNHEALTHY, note + detail, now)
        for device in sorted(before - set(after)):
            self.since.pop(device, None)
            self._occurred(node, RECOVERED, f"{device} is healthy again", now)
        self.view = view
        return True

    def condition(self) -> ConditionReport | None:
        return condition_report(self.view, self.since) if self.view is not None else None

    def taint_wanted(self) -> bool:
        return self.view is not None and self.view.all_unhealthy

    def pending_events(self) -> list[EventRecord]:
        """Events with occurrences not yet written, oldest first."""
        return sorted((r for r in self.events.values() if r.pending), key=lambda r: r.first)

    def written(self, record: EventRecord, name: str) -> None:
        """``record`` (as it was handed out) is written as ``name``."""
        current = self.events.get(record.key)
        if current is not None and current.first == record.first:
            self.events[record.key] = replace(current, written=record.count, name=name)

    def lost(self, record: EventRecord) -> None:
        """``record``'s event is gone from the API server: write it anew (a new name)."""
        current = self.events.get(record.key)
        if current is not None and current.first == record.first:
            self.events[record.key] = replace(current, written=0, name="")

    def discard(self, record: EventRecord) -> None:
        """``record`` cannot be written (its namespace is gone, or the server finds it invalid):
        forget it, counted as dropped."""
        current = self.events.get(record.key)
        if current is not None and current.first == record.first:
            del self.events[record.key]
            self.dropped_events += 1

    def _occurred(self, regarding: Regarding, what: _What, note: str, now: float) -> None:
        type_, reason, action = what
        key = EventKey(regarding, reason, _truncated(note, NOTE_LIMIT))
        record = self.events.pop(key, None)
        if record is not None and now - record.last <= self.series_ttl:
            record = replace(record, last=now, count=record.count + 1)
        else:
            record = EventRecord(key, type_, action, first=now, last=now)
        self.events[key] = record  # the newest last: the dict is in order of last occurrence
        self._bound()

    def _bound(self) -> None:
        while len(self.events) > self.max_events:
            written = next((k for k, r in self.events.items() if not r.pending), None)
            if written is not None:
                del self.events[written]
                continue
            del self.events[next(iter(self.events))]
            self.dropped_events += 1


def _by_pod(refs: Iterable[PodRef]) -> list[tuple[Regarding, tuple[str, ...]]]:
    pods: dict[Regarding, list[str]] = {}
    for ref in refs:
        pods.setdefault(Regarding("Pod", ref.pod, ref.namespace), []).append(ref.container)
    return [(pod, tuple(sorted(set(names)))) for pod, names in sorted(pods.items(), key=_pod_key)]


def _pod_key(item: tuple[Regarding, list[str]]) -> tuple[str, str]:
    return (item[0].namespace, item[0].name)


def event_name(record: EventRecord) -> str:
    """A name unique to the event (its regarding object's name, as the kubelet's are, and a hash
    of what it is and when it began): a create retried after a lost answer finds it taken."""
    key = record.key
    digest = hashlib.sha256(
        f"{key.regarding}|{key.reason}|{key.note}|{record.first!r}".encode()
    ).hexdigest()[:16]
    base = key.regarding.name[: 253 - 17].rstrip("-.")
    return f"{base}.{digest}"


def event_manifest(
    record: EventRecord, *, name: str, instance: str, api_version: str
) -> dict[str, Any]:
    """The event as ``api_version`` (``events.k8s.io/v1``, or ``v1`` where that is all the
    server offers) spells it."""
    key = record.key
    series = (
        {"count": record.count, "lastObservedTime": micro_time(record.last)}
        if record.count > 1
        else None
    )
    common: dict[str, Any] = {
        "metadata": {"name": name, "namespace": key.regarding.event_namespace},
        "eventTime": micro_time(record.first),
        "reportingInstance": instance,
        "action": record.action,
        "reason": key.reason,
        "type": record.type,
    }
    if api_version == "v1":
        body = {"apiVersion": "v1", "kind": "Event", **common,
                "involvedObject": key.regarding.reference(), "message": key.note,
                "reportingComponent": REPORTING_CONTROLLER}  # fmt: skip
    else:
        body = {"apiVersion": api_version, "kind": "Event", **common,
                "regarding": key.regarding.reference(), "note": key.note,
                "reportingController": REPORTING_CONTROLLER}  # fmt: skip
    if series is not None:
        body["series"] = series
    return body


def series_patch(record: EventRecord) -> dict[str, Any]:
    """A merge patch that brings a written event's series up to ``record``."""
    return {"series": {"count": record.count, "lastObservedTime": micro_time(record.last)}}
