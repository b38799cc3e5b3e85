"""Events on the Node and on the pods holding a failing GPU: each new one created at once (news,
whatever flaps), a repeat folded into its series, which is patched at the cadence of
:class:`~gpuagent.domain.nodehealth.SeriesPacing` (at most every 5 minutes per series, 16 a
minute per node); written through ``events.k8s.io/v1`` where the API server serves it (asked
once: :meth:`EventWriter.discover`), else the core ``v1`` API."""

from __future__ import annotations

import math

import structlog

from gpuagent.domain.nodehealth import (
    EventKey,
    EventRecord,
    SeriesPacing,
    event_manifest,
    event_name,
    series_patch,
)
from gpuagent.domain.pacing import Spent
from gpuagent.kube.nodehealth.objects import ApiObject, NodeApi, event_key
from gpuagent.kube.pacer import CallFailed

__all__ = ["EVENTS_API", "EventWriter"]

log = structlog.get_logger("gpuagent.kube")

EVENTS_API = "events.k8s.io/v1"


class EventWriter:
    """Writes the model's pending events, once the events API is known (:meth:`discover`)."""

    object = ApiObject.EVENT

    def __init__(
        self,
        target: NodeApi,
        *,
        api_version: str | None = None,
        series: SeriesPacing = SeriesPacing(),
    ) -> None:
        self._target = target
        self._clock = target.pacer.clock
        #: The API the events go to; ``None`` until discovered.
        self.api_version = api_version
        self._series = series
        self._spent = Spent()  # the node's budget of series updates
        self._written_at: dict[EventKey, float] = {}  # each event's last write (the clock's)

    async def discover(self) -> None:
        """Ask the API server whether it serves ``events.k8s.io/v1``."""
        target = self._target
        try:
            served = await target.pacer.call(ApiObject.DISCOVERY, target.api.serves(EVENTS_API))
        except CallFailed as exc:
            if exc.kind == "retry":
                raise
            served = True  # discovery refused (it is open to all): assume the usual API
        self.api_version = EVENTS_API if served else "v1"
        if not served:
            log.info("the API server has no events.k8s.io/v1: events go to the core v1 API")

    def wanted(self) -> bool:
        """Whether an event is to be created, or a series is due and the budget allows it."""
        if self.api_version is None:
            return False
        now = self._clock.now()
        return any(self._ready_at(r) <= now for r in self._target.model.pending_events())

    def fresh(self) -> bool:
        """Whether an event never written waits (news, even on a GPU that flaps)."""
        return any(
            r.written == 0 and self._refused(r) is None for r in self._target.model.pending_events()
        )

    def next_at(self) -> float | None:
        """When the next series held back falls due (``None``: none is)."""
        now = self._clock.now()
        later = [t for r in self._target.model.pending_events() if (t := self._ready_at(r)) > now]
        return min(later) if later else None

    def _ready_at(self, record: EventRecord) -> float:
        """When ``record`` may be written: a new event at once, a series when it is due and a
        token is there, a refused namespace when it is tried again."""
        refused = self._refused(record)
        if refused is not None:
            return refused
        if record.written == 0:
            return -math.inf
        written_at = self._written_at.get(record.key, -math.inf)
        return max(self._series.due(written_at), self._series.token_at(self._spent))

    def _refused(self, record: EventRecord) -> float | None:
        return self._target.pacer.refused(event_key(record.key.regarding.event_namespace))

    def _due(self) -> list[EventRecord]:
        """What to write now: every new event, and the series that are due, the longest
        waiting first, as many as the budget allows."""
        now = self._clock.now()
        pending = [r for r in self._target.model.pending_events() if self._refused(r) is None]
        series = sorted(
            (r for r in pending if r.written > 0 and self._ready_at(r) <= now),
            key=lambda r: self._written_at.get(r.key, -math.inf),
        )
        allowed = series[: self._series.allowance(self._spent, now)]
        if allowed:
            self._spent = self._series.spend(self._spent, now, len(allowed))
        return [r for r in pending if r.written == 0] + allowed

    async def write(self) -> bool:
        wrote = False
        events = self._target.model.events
        self._written_at = {k: t for k, t in self._written_at.items() if k in events}
        for record in self._due():
            key = event_key(record.key.regarding.event_namespace)
            if self._target.pacer.refused(key) is not None:
                continue  # refused since, in this batch
            try:
                name = await self._write(record, key)
            except CallFailed as exc:
                if exc.kind == "retry":
                    raise
                wrote = True
                self._failed(record, exc, key)
                continue
            wrote = True
            self._written_at[record.key] = self._clock.now()
            self._target.model.written(record, name)
        return wrote

    async def _write(self, record: EventRecord, key: str) -> str:
        """Create ``record``'s event, or patch its series; its name."""
        target = self._target
        api_version = self.api_version or EVENTS_API
        if record.written == 0:
            name = event_name(record)
            manifest = event_manifest(
                record, name=name, instance=target.node, api_version=api_version
            )
            await target.pacer.call(self.object, target.api.create_event(manifest), key=key)
            return name
        namespace = record.key.regarding.event_namespace
        patch = series_patch(record)
        call = target.api.patch_event(api_version, namespace, record.name, patch)
        await target.pacer.call(self.object, call, key=key)
        return record.name

    def _failed(self, record: EventRecord, exc: CallFailed, key: str) -> None:
        model = self._target.model
        if exc.kind == "conflict" and record.written == 0:
            model.written(record, event_name(record))  # created before; the answer was lost
        elif exc.code == 404 and record.written > 0:
            self._target.pacer.forget(key)
            model.lost(record)  # expired on the server: a new event
        elif exc.code == 404 or exc.kind == "invalid":
            self._target.pacer.forget(key)
            model.discard(record)  # the pod's namespace is gone, or a bug: not retried
            log.warning("event dropped", reason=record.key.reason, error=exc.error)
