"""Successive views of one node folded into what should be written (:class:`NodeHealthModel`):
the condition, the taint, and the events with their series."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from gpuagent.domain.nodehealth.condition import ConditionReport, condition_report, evidence_of
from gpuagent.domain.nodehealth.events import (
    NOTE_LIMIT,
    OVER_SHARE,
    RECOVERED,
    UNHEALTHY,
    EventKey,
    EventRecord,
    Regarding,
    What,
    by_pod,
    truncated,
)
from gpuagent.domain.nodehealth.view import DeviceRef, NodeHealthView
from gpuagent.domain.shareuse import Overuse

__all__ = ["MAX_EVENTS", "TAINT_KEY", "NodeHealthModel"]

TAINT_KEY = "nvidia.com/gpu-unhealthy"
#: Events kept (pending or written, for their series).
MAX_EVENTS = 256


@dataclass(frozen=True, slots=True)
class Episode:
    """A device's failure, from ``since`` until it recovers: the pods (namespace, name) told."""

    since: float
    told: frozenset[tuple[str, str]] = frozenset()


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
    #: Each failed device's episode: since when, and the pods told of it.
    episodes: dict[DeviceRef, Episode] = field(default_factory=dict)
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
            detail = evidence_of(fault.conditions)
            if device not in before:
                self.episodes[device] = Episode(since=now)
                self._occurred(node, UNHEALTHY, f"{device} is unhealthy: {detail}", now)
            self._tell_holders(view, device, detail, now)
        for device in sorted(before - set(after)):
            self.episodes.pop(device, None)
            self._occurred(node, RECOVERED, f"{device} is healthy again", now)
        self._over_shares(view, now)
        self.view = view
        return True

    def _tell_holders(
        self, view: NodeHealthView, device: DeviceRef, detail: str, now: float
    ) -> None:
        """An event on each pod holding failed ``device`` not told yet in this episode: the
        holders when it failed, and one attributed only later (attribution lags a poll)."""
        episode = self.episodes.get(device, Episode(since=now))
        told = episode.told
        for pod, containers in by_pod(view.holders_of(device), view.pod_uids):
            if (pod.namespace, pod.name) in told:
                continue
            told |= {(pod.namespace, pod.name)}
            names = ", ".join(containers)
            plural = "s" if len(containers) > 1 else ""
            note = f"{device} allocated to this pod (container{plural} {names}) failed: "
            self._occurred(pod, UNHEALTHY, note + detail, now)
        self.episodes[device] = replace(episode, told=told)

    def _over_shares(self, view: NodeHealthView, now: float) -> None:
        """An event on each pod holding a claim that went over its share (once per episode:
        a claim that stays over is in every view, and is said again only after it was under)."""
        before = {(u.share, u.gpu) for u in self.view.overused} if self.view is not None else set()
        for use in view.overused:
            if (use.share, use.gpu) in before:
                continue
            for pod, containers in by_pod(use.holders, view.pod_uids):
                self._occurred(pod, OVER_SHARE, _over_share_note(use, containers), now)

    def condition(self) -> ConditionReport | None:
        if self.view is None:
            return None
        return condition_report(self.view, {d: e.since for d, e in self.episodes.items()})

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

    def _occurred(self, regarding: Regarding, what: What, note: str, now: float) -> None:
        type_, reason, action = what
        key = EventKey(regarding, reason, truncated(note, NOTE_LIMIT))
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


def _over_share_note(use: Overuse, containers: tuple[str, ...]) -> str:
    share = use.share
    plural = "s" if len(containers) > 1 else ""
    return (
        f"the processes of claim {share.namespace}/{share.claim} in this pod (container{plural} "
        f"{', '.join(containers)}) use more memory of GPU {use.gpu} ({share.uuid}) than the "
        f"claim's share ({share.share.memory_mib} MiB, {share.share.compute} % of compute): "
        "the MPS memory limit binds each CUDA process on its own, so several processes, or one "
        "that sets its own CUDA_MPS_PINNED_DEVICE_MEM_LIMIT, can exceed it"
    )
