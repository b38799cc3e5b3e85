"""Events about the node's GPUs: what makes two occurrences one event (:class:`EventKey`), the
record of its series (:class:`EventRecord`), its name, and its manifest in ``events.k8s.io/v1``
or core ``v1``."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from gpuagent.domain.devices import PodRef

__all__ = [
    "NOTE_LIMIT",
    "OVER_SHARE",
    "RECOVERED",
    "REPORTING_CONTROLLER",
    "UNHEALTHY",
    "EventKey",
    "EventRecord",
    "EventType",
    "Regarding",
    "What",
    "by_pod",
    "event_manifest",
    "event_name",
    "series_patch",
    "truncated",
]

REPORTING_CONTROLLER = "gpuagent"
#: The API server's limit on an event's note.
NOTE_LIMIT = 1024

EventType = Literal["Normal", "Warning"]
What = tuple[EventType, str, str]  # an event's type, reason and action
#: A device turned unhealthy (on the Node and on each pod holding it); a device recovered.
UNHEALTHY: What = ("Warning", "GPUUnhealthy", "MarkUnhealthy")
RECOVERED: What = ("Normal", "GPURecovered", "MarkHealthy")
#: A DRA claim's processes use more of a GPU than its share (on each pod holding the claim).
OVER_SHARE: What = ("Warning", "GPUShareExceeded", "CheckGPUShare")


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


def by_pod(
    refs: Iterable[PodRef], uids: Iterable[tuple[str, str, str]] = ()
) -> list[tuple[Regarding, tuple[str, ...]]]:
    """The pods of ``refs`` with their containers' names; ``uids``: (namespace, pod, UID) of
    those whose UID is known (``kubectl describe pod`` lists only events naming the pod's UID)."""
    known = {(namespace, pod): uid for namespace, pod, uid in uids}
    pods: dict[Regarding, list[str]] = {}
    for ref in refs:
        uid = known.get((ref.namespace, ref.pod), "")
        pods.setdefault(Regarding("Pod", ref.pod, ref.namespace, uid), []).append(ref.container)
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


def micro_time(seconds: float) -> str:
    """A ``metav1.MicroTime``: UTC, to the microsecond."""
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def truncated(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"
