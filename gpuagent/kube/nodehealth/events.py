"""Events on the Node and on the pods holding a failing GPU: each new one created, a repeat
patched into its series; written through ``events.k8s.io/v1`` where the API server serves it
(asked once: :meth:`EventWriter.discover`), else the core ``v1`` API."""

from __future__ import annotations

import structlog

from gpuagent.domain.nodehealth import EventRecord, event_manifest, event_name, series_patch
from gpuagent.kube.nodehealth.objects import ApiObject, NodeApi, event_key
from gpuagent.kube.pacer import CallFailed

__all__ = ["EVENTS_API", "EventWriter"]

log = structlog.get_logger("gpuagent.kube")

EVENTS_API = "events.k8s.io/v1"


class EventWriter:
    """Writes the model's pending events, once the events API is known (:meth:`discover`)."""

    object = ApiObject.EVENT

    def __init__(self, target: NodeApi, *, api_version: str | None = None) -> None:
        self._target = target
        #: The API the events go to; ``None`` until discovered.
        self.api_version = api_version

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
        return self.api_version is not None and bool(self._target.model.pending_events())

    async def write(self) -> bool:
        wrote = False
        for record in self._target.model.pending_events():
            key = event_key(record.key.regarding.event_namespace)
            if self._target.pacer.refused(key) is not None:
                continue
            try:
                name = await self._write(record, key)
            except CallFailed as exc:
                if exc.kind == "retry":
                    raise
                wrote = True
                self._failed(record, exc, key)
                continue
            wrote = True
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
