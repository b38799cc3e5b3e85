"""Saying what the store knows about the GPUs where Kubernetes looks: the Node condition
``GPUHealthy``, events on the Node and on the pods holding a failing GPU, and (optional) the
``nvidia.com/gpu-unhealthy`` taint.

One task per agent, never awaited by anything else: an API server that is slow or down delays
only these writes. On each store change the snapshot is projected
(:func:`~gpuagent.domain.nodehealth.project`); when the projection changes, the model
(:class:`~gpuagent.domain.nodehealth.NodeHealthModel`) works out what to write, and the writes go
out in batches paced by :class:`~gpuagent.kube.pacer.Pacer`: a change of a GPU's health (a cause
that appears or clears) at once, whatever was written before, unless that GPU's cause flaps (it
changed within a minute of its last change going out) or the budget of early writes (as many as
the node has GPUs, two back a minute) is spent; every other change at once after a quiet spell,
then at most once per window. Through an outage only the latest state of each object is kept,
and the first batch after it goes out after a random delay (the backoff's full jitter); whether
the API server is reached goes into the store's counters as soon as a call fails or works again
(``gpuagent_kube_backing_off``).

At start the Node is read once: its UID (for events), the condition as a previous agent left it
(an unchanged condition keeps its ``lastTransitionTime`` and is not written again) and its taints.
Every call goes through the pacer, which counts it.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import structlog

from gpuagent.clock import Clock, LoopClock
from gpuagent.domain.backoff import Backoff
from gpuagent.domain.drapods import dra_holders
from gpuagent.domain.nodehealth import (
    CONDITION_TYPE,
    TAINT_KEY,
    ConditionReport,
    DeviceRef,
    EventRecord,
    NodeHealthModel,
    NodeHealthView,
    condition_patch,
    event_manifest,
    event_name,
    faults_by_cause,
    project,
    series_patch,
)
from gpuagent.domain.pacing import Budget, Coalescing, NewsKey, changed_keys, next_heartbeat
from gpuagent.domain.snapshot import Snapshot
from gpuagent.kube.client import KubeApi
from gpuagent.kube.pacer import CallFailed, Pacer
from gpuagent.state.counters import ApiReach, KubeCounters
from gpuagent.state.store import DeviceStore, Watch

__all__ = ["EVENTS_API", "NodeHealthWriter"]

log = structlog.get_logger("gpuagent.kube")

EVENTS_API = "events.k8s.io/v1"
#: ``lastHeartbeatTime`` moves at most this often (seconds).
HEARTBEAT_MIN = 60.0
#: Seconds to wait when nothing is due (the store's changes end the wait sooner).
IDLE_WAIT = 3600.0


@dataclass(frozen=True, slots=True)
class _Written:
    """The condition as on the Node: what it says and its two times (wall seconds)."""

    report: ConditionReport
    transition: float
    heartbeat: float


class NodeHealthWriter:
    """Writes the node's GPU health to the API server; runs until cancelled."""

    def __init__(
        self,
        store: DeviceStore,
        api: KubeApi,
        *,
        node: str,
        condition: bool = True,
        events: bool = True,
        taint: bool = False,
        heartbeat: float = 1800.0,
        clock: Clock | None = None,
        wall: Callable[[], float] = time.time,
        draw: Callable[[], float] = random.random,
        backoff: Backoff = Backoff(),
        coalescing: Coalescing = Coalescing(),
        budget: Budget = Budget(),
    ) -> None:
        self._store = store
        self._api = api
        self._node = node
        self._condition_on = condition
        self._events_on = events
        self._taint_on = taint
        self._heartbeat = heartbeat
        self._clock = clock or LoopClock()
        self._wall = wall
        self._draw = draw
        self.pacer = Pacer(
            self._clock, backoff=backoff, coalescing=coalescing, budget=budget, draw=draw
        )
        self.model = NodeHealthModel(node)
        self.events_api: str | None = None if events else EVENTS_API
        self._node_read = not (condition or taint)  # the Node is read once, for these
        self._condition: _Written | None = None
        self._heartbeat_at: float | None = None
        self._taint: bool | None = None  # whether the Node has the taint, as last seen
        self.condition_written_at: float | None = None  # wall time of the last condition write
        self._views: Watch[NodeHealthView | None] | None = None
        self._faults_out: Mapping[
            NewsKey, frozenset[DeviceRef]
        ] = {}  # faults as of the last batch out
        self._reach: ApiReach | None = None

    # ----- the loop ----------------------------------------------------------------------------
    @property
    def seen_version(self) -> int:
        """The last store version the writer looked at (``-1`` before it runs)."""
        return self._views.version if self._views is not None else -1

    async def run(self) -> None:
        self._views = views = self._store.watch(self._project, clock=self._clock)
        self._observe(await anext(views))
        while True:
            due = self._next()
            now = self._clock.now()
            if due is not None and due <= now:
                await self._flush()
                continue
            # The view once it changes, or as it is when the next batch is due.
            self._observe(await views.next(now + IDLE_WAIT if due is None else due))

    def _project(self, snapshot: Snapshot) -> NodeHealthView | None:
        plan = snapshot.plan
        return project(snapshot, plan.served_resources, lambda: dra_holders(snapshot, plan.dra))

    def _observe(self, view: NodeHealthView | None) -> None:
        if view is not None:
            self.model.observe(view, self._wall())

    def _work(self) -> Mapping[str, bool]:
        """What has something to write, by the key a refusal holds it back under."""
        view = self.model.view
        return {
            "discovery": self.events_api is None,
            "node": not self._node_read,
            "node_condition": self._node_read and self._condition_due(),
            "node_taint": self._node_read and self._taint_on and view is not None
            and self._taint != self.model.taint_wanted(),
            "event": self.events_api is not None and bool(self.model.pending_events()),
        }  # fmt: skip

    def _health_changed(self) -> frozenset[NewsKey]:
        """The GPUs and causes whose faults differ from those of the last batch out."""
        return changed_keys(self._faults_out, faults_by_cause(self.model.view))

    def _next(self) -> float | None:
        """When the next batch goes out (``None``: nothing to write, no heartbeat to make)."""
        times: list[float] = []
        changed = self._health_changed()
        if self.model.view is not None:
            self.pacer.capacity = self.model.view.gpus
        for key, has in self._work().items():
            if not has:
                continue
            until = self.pacer.refused(key)
            if until is not None:
                times.append(until)
                continue
            self.pacer.changed()
            if (due := self.pacer.due(changed)) is not None:
                times.append(due)
        if self._heartbeat_at is not None and self._heartbeat_at > self._clock.now():
            times.append(self._heartbeat_at)  # once due, the condition has work: paced above
        return min(times) if times else None

    async def _flush(self) -> None:
        """One batch: every object with something to write, once."""
        try:
            wrote = await self._batch()
        except CallFailed:  # the server is down or throttles: everything waits (backoff)
            return
        except Exception as exc:  # a bug must not end the task, nor spin: back off as if down
            log.exception("node health write failed")
            self.pacer.pause(f"{type(exc).__name__}: {exc}")
            return
        finally:
            self._reached()
        self.pacer.done(wrote=wrote)
        self._faults_out = faults_by_cause(self.model.view)

    async def _batch(self) -> bool:
        """Write what is due; returns whether anything was written."""
        wrote = False
        if self.events_api is None and self.pacer.refused("discovery") is None:
            await self._discover()
        if not self._node_read and self.pacer.refused("node") is None:
            await self._read_node()
        if self._node_read:
            if self._condition_due() and self.pacer.refused("node_condition") is None:
                wrote |= await self._write_condition()
            if self._taint_on and self.pacer.refused("node_taint") is None:
                wrote |= await self._write_taint()
        if self.events_api is not None:
            wrote |= await self._write_events()
        return wrote

    def _reached(self) -> None:
        """Say in the store whether the API server is reached, as the last calls found."""
        error = self.pacer.error
        reach = ApiReach(up=not error, backing_off=bool(error), error=error)
        if reach != self._reach:
            self._reach = reach
            self._store.counters.api_reached("node_health", reach)

    # ----- start -------------------------------------------------------------------------------
    async def _discover(self) -> None:
        try:
            served = await self.pacer.call("discovery", self._api.serves(EVENTS_API))
        except CallFailed as exc:
            if exc.kind == "retry":
                raise
            served = True  # discovery refused (it is open to all): assume the usual API
        self.events_api = EVENTS_API if served else "v1"
        if not served:
            log.info("the API server has no events.k8s.io/v1: events go to the core v1 API")

    async def _read_node(self) -> None:
        try:
            node = await self.pacer.call("node", self._api.node(self._node))
        except CallFailed as exc:
            if exc.kind == "retry":
                raise
            return  # no such Node, or not allowed to read it: tried again rarely
        self._node_read = True
        self.model.node_uid = str(node.get("metadata", {}).get("uid") or "")
        self._taint = _has_taint(node)
        self._condition = _existing(node)
        if self._condition is not None:
            # The next heartbeat as if this agent had written the one on the Node.
            age = max(0.0, self._wall() - self._condition.heartbeat)
            self._heartbeat_at = next_heartbeat(
                self._clock.now() - age, self._heartbeat, self._draw()
            )

    # ----- the condition -----------------------------------------------------------------------
    def _condition_due(self) -> bool:
        if not self._condition_on or self.model.view is None:
            return False
        written = self._condition
        if written is None or written.report != self.model.condition():
            return True
        return self._heartbeat_at is not None and self._clock.now() >= self._heartbeat_at

    async def _write_condition(self) -> bool:
        report = self.model.condition()
        if report is None:
            return False
        wall = self._wall()
        old = self._condition
        transition = wall if old is None or old.report.status != report.status else None
        heartbeat = wall if old is None or wall - old.heartbeat >= HEARTBEAT_MIN else None
        patch = condition_patch(report, transition=transition, heartbeat=heartbeat)
        try:
            await self.pacer.call("node_condition", self._api.patch_node_status(self._node, patch))
        except CallFailed as exc:
            if exc.kind == "retry":
                raise
            return False
        self._condition = _Written(
            report,
            transition if transition is not None else old.transition if old else wall,
            heartbeat if heartbeat is not None else old.heartbeat if old else wall,
        )
        self._heartbeat_at = next_heartbeat(self._clock.now(), self._heartbeat, self._draw())
        self.condition_written_at = wall
        if old is None or old.report.status != report.status:
            log.info("node condition written", condition=CONDITION_TYPE, status=report.status,
                     reason=report.reason)  # fmt: skip
        return True

    # ----- the taint ---------------------------------------------------------------------------
    async def _write_taint(self) -> bool:
        wanted = self.model.taint_wanted()
        if self.model.view is None or self._taint == wanted:
            return False
        node = await self.pacer.call("node", self._api.node(self._node))  # its resourceVersion
        self._taint = _has_taint(node)
        if self._taint == wanted:
            return False
        taints = [t for t in node.get("spec", {}).get("taints") or [] if t["key"] != TAINT_KEY]
        if wanted:
            taints.append({"key": TAINT_KEY, "effect": "NoSchedule"})
        patch = {
            "metadata": {"resourceVersion": node["metadata"]["resourceVersion"]},
            "spec": {"taints": taints or None},
        }
        try:
            await self.pacer.call("node_taint", self._api.patch_node(self._node, patch))
        except CallFailed as exc:
            if exc.kind == "retry":
                raise
            return True  # a conflict (the Node changed meanwhile) is tried again next window
        self._taint = wanted
        log.info("node taint " + ("added" if wanted else "removed"), taint=TAINT_KEY)
        return True

    # ----- events ------------------------------------------------------------------------------
    async def _write_events(self) -> bool:
        wrote = False
        api_version = self.events_api or EVENTS_API
        for record in self.model.pending_events():
            namespace = record.key.regarding.event_namespace
            key = f"event:{namespace}"
            if self.pacer.refused(key) is not None:
                continue
            try:
                if record.written == 0:
                    name = event_name(record)
                    manifest = event_manifest(
                        record, name=name, instance=self._node, api_version=api_version
                    )
                    await self.pacer.call("event", self._api.create_event(manifest), key=key)
                else:
                    name = record.name
                    await self.pacer.call(
                        "event",
                        self._api.patch_event(api_version, namespace, name, series_patch(record)),
                        key=key,
                    )
            except CallFailed as exc:
                if exc.kind == "retry":
                    raise
                wrote = True
                self._event_failed(record, exc, key)
                continue
            wrote = True
            self.model.written(record, name)
        return wrote

    def _event_failed(self, record: EventRecord, exc: CallFailed, key: str) -> None:
        if exc.kind == "conflict" and record.written == 0:
            self.model.written(record, event_name(record))  # created before; the answer was lost
        elif exc.code == 404 and record.written > 0:
            self.pacer.forget(key)
            self.model.lost(record)  # expired on the server: a new event
        elif exc.code == 404 or exc.kind == "invalid":
            self.pacer.forget(key)
            self.model.discard(record)  # the pod's namespace is gone, or a bug: not retried
            log.warning("event dropped", reason=record.key.reason, error=exc.error)

    # ----- counters ----------------------------------------------------------------------------
    def counters(self) -> KubeCounters:
        return KubeCounters(
            requests=tuple(
                (obj, result, count)
                for (obj, result), count in sorted(self.pacer.counts.counts.items())
            ),
            condition_written_at=self.condition_written_at,
            events_pending=len(self.model.pending_events()),
            events_dropped=self.model.dropped_events,
        )

    @property
    def view(self) -> NodeHealthView | None:
        return self.model.view


def _has_taint(node: Mapping[str, Any]) -> bool:
    return any(t.get("key") == TAINT_KEY for t in node.get("spec", {}).get("taints") or [])


def _existing(node: Mapping[str, Any]) -> _Written | None:
    """The ``GPUHealthy`` condition on the Node as read, or ``None``."""
    for condition in node.get("status", {}).get("conditions") or []:
        if condition.get("type") != CONDITION_TYPE:
            continue
        status = condition.get("status")
        if status not in ("True", "False"):
            return None
        report = ConditionReport(status, condition.get("reason", ""), condition.get("message", ""))
        transition = _seconds(condition.get("lastTransitionTime"))
        heartbeat = _seconds(condition.get("lastHeartbeatTime"))
        if transition is None or heartbeat is None:
            return None
        return _Written(report, transition, heartbeat)
    return None


def _seconds(value: object) -> float | None:
    if isinstance(value, datetime):
        return value.timestamp()
    if not isinstance(value, str):
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None
