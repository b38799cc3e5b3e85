"""The node-health writer's loop: the store's view followed, the Node read once, and batches of
the parts' writes (:mod:`.condition`, :mod:`.taint`, :mod:`.events`) paced by one
:class:`~gpuagent.kube.pacer.Pacer`; whether the API server is reached, and the writer's counts,
said in the store."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping

import structlog

from gpuagent.domain.backoff import Backoff
from gpuagent.domain.drapods import dra_holders
from gpuagent.domain.nodehealth import (
    DeviceRef,
    NodeHealthModel,
    NodeHealthView,
    faults_by_cause,
    project,
)
from gpuagent.domain.pacing import Budget, Coalescing, NewsKey, changed_keys
from gpuagent.domain.snapshot import Snapshot
from gpuagent.kube.client import KubeApi
from gpuagent.kube.nodehealth.condition import ConditionWriter
from gpuagent.kube.nodehealth.events import EventWriter
from gpuagent.kube.nodehealth.objects import ApiObject, NodeApi, Part
from gpuagent.kube.nodehealth.taint import TaintWriter
from gpuagent.kube.pacer import CallFailed, Pacer
from gpuagent.state.clock import Clock, LoopClock
from gpuagent.state.counters import ApiReach, KubeCounters
from gpuagent.state.store import DeviceStore, Watch

__all__ = ["NodeHealthWriter"]

log = structlog.get_logger("gpuagent.kube")

#: Seconds to wait when nothing is due (the store's changes end the wait sooner).
IDLE_WAIT = 3600.0


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
        self._clock = clock = clock or LoopClock()
        self._wall = wall
        self.pacer = Pacer(clock, backoff=backoff, coalescing=coalescing, budget=budget, draw=draw)
        self.model = NodeHealthModel(node)
        self._node = NodeApi(api, self.pacer, node, self.model)
        self._condition = (
            ConditionWriter(self._node, heartbeat=heartbeat, clock=clock, wall=wall, draw=draw)
            if condition
            else None
        )
        self._taint = TaintWriter(self._node) if taint else None
        self._events = EventWriter(self._node) if events else None
        #: The parts in the order of a batch.
        self._parts: tuple[Part, ...] = tuple(
            p for p in (self._condition, self._taint, self._events) if p is not None
        )
        self._node_read = not (condition or taint)  # the Node is read once, for these
        self._views: Watch[NodeHealthView | None] | None = None
        # The faults as of the last batch out.
        self._faults_out: Mapping[NewsKey, frozenset[DeviceRef]] = {}
        self._reach: ApiReach | None = None
        self._counted()

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
            self._counted()

    def _work(self) -> dict[ApiObject, bool]:
        """What has something to write (or read first), by what a refusal holds it back under."""
        work = {
            ApiObject.DISCOVERY: self._events is not None and self._events.api_version is None,
            ApiObject.NODE: not self._node_read,
        }
        for part in self._parts:
            work[part.object] = part.wanted()
        return work

    def _health_changed(self) -> frozenset[NewsKey]:
        """The GPUs and causes whose faults differ from those of the last batch out."""
        return changed_keys(self._faults_out, faults_by_cause(self.model.view))

    def _next(self) -> float | None:
        """When the next batch goes out (``None``: nothing to write, no heartbeat to make)."""
        times: list[float] = []
        changed = self._health_changed()
        fresh = self._events is not None and self._events.fresh()
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
            if (due := self.pacer.due(changed, fresh=fresh)) is not None:
                times.append(due)
        heartbeat = self._condition.heartbeat_at if self._condition is not None else None
        if heartbeat is not None and heartbeat > self._clock.now():
            times.append(heartbeat)  # once due, the condition has work: paced above
        if self._events is not None and (series := self._events.next_at()) is not None:
            times.append(series)  # a series held back falls due: paced above then
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
            self._counted()
        self.pacer.done(wrote=wrote)
        self._faults_out = faults_by_cause(self.model.view)

    async def _batch(self) -> bool:
        """Read what is not known yet, then write what is due; whether anything was written."""
        events = self._events
        if events is not None and events.api_version is None and self._may(ApiObject.DISCOVERY):
            await events.discover()
        if not self._node_read and self._may(ApiObject.NODE):
            await self._read_node()
        wrote = False
        for part in self._parts:
            if part.wanted() and self._may(part.object):
                wrote |= await part.write()
        return wrote

    def _may(self, obj: ApiObject) -> bool:
        """Whether calls about ``obj`` may be made (the server has not refused them lately)."""
        return self.pacer.refused(obj) is None

    async def _read_node(self) -> None:
        """The Node, once: its UID for the events, what the condition and the taint find."""
        try:
            node = await self.pacer.call(ApiObject.NODE, self._node.api.node(self._node.node))
        except CallFailed as exc:
            if exc.kind == "retry":
                raise
            return  # no such Node, or not allowed to read it: tried again rarely
        self._node_read = True
        self.model.node_uid = str(node.get("metadata", {}).get("uid") or "")
        for part in (self._condition, self._taint):
            if part is not None:
                part.found(node)

    def _reached(self) -> None:
        """Say in the store whether the API server is reached, as the last calls found."""
        error = self.pacer.error
        reach = ApiReach(up=not error, backing_off=bool(error), error=error)
        if reach != self._reach:
            self._reach = reach
            self._store.counters.api_reached("node_health", reach)

    # ----- counters ----------------------------------------------------------------------------
    def _counted(self) -> None:
        """Put the writer's counts in the store, as they are now (after each batch and each
        change of what it knows)."""
        self._store.counters.kube_counted(self.counters())

    def counters(self) -> KubeCounters:
        return KubeCounters(
            requests=tuple(
                (str(obj), result, count)
                for (obj, result), count in sorted(self.pacer.counts.counts.items())
            ),
            condition_written_at=self.condition_written_at,
            events_pending=len(self.model.pending_events()),
            events_dropped=self.model.dropped_events,
        )

    @property
    def condition_written_at(self) -> float | None:
        """Wall time of the last condition write."""
        return self._condition.written_at if self._condition is not None else None

    @property
    def view(self) -> NodeHealthView | None:
        return self.model.view
