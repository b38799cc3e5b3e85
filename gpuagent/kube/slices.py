"""Keeping this node's ResourceSlices equal to its DRA devices, politely to the control plane.

On every store change the devices are derived again; when they differ from what was published,
the node's slices are written (create or replace, with the pool's generation one above the last)
and any left over deleted. The writes follow the API client rules every writer of the agent does
(:mod:`gpuagent.domain.pacing`, applied by :class:`~gpuagent.kube.pacer.Pacer`):

- a change of a GPU's health (a taint that appears, clears or changes its effect) goes out at
  once (after 0.2 s that gather what one fault changes together), whatever was written before;
  a taint that flaps (changed within a minute of its last change going out) is merged like any
  other change, and news spends a budget of as many writes as the node has GPUs, two back a
  minute;
- other changes go out at once after a quiet spell, then merged into one publication at most
  every 30 s; a repeat of a fault on a GPU already tainted changes nothing (a taint per cause,
  its value fixed while the cause holds), so a storm costs a node at most two slice updates a
  minute once its first news is out;
- the slices as last written are kept, ``resourceVersion`` included: a replace needs no LIST. The
  node's slices are listed only at start and after a conflict (409: someone else wrote one) or an
  absence (404: one was deleted);
- an unreachable, throttling (429) or failing (5xx) API server is retried after a full-jitter
  exponential delay (0.5 s to 60 s), never sooner than its ``Retry-After``; a refusal (403, or a
  422 the writer cannot fix by retrying) is tried again every 10 minutes.

Whether the API server is reached goes into the store's counters as soon as a publication fails
or works again, with why not (``gpuagent_dra_api_up``, ``/readyz``), the publisher's counts with
it, and the names of the devices published into the snapshot (``/readyz`` names a GPU offered
through neither API); the device plugin side goes on untouched.
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace
from typing import Any

import structlog

from gpuagent.domain.apireach import NOT_PUBLISHED, ApiReach
from gpuagent.domain.backoff import Backoff
from gpuagent.domain.dra import DraDevice
from gpuagent.domain.pacing import Budget, Coalescing, NewsKey, changed_keys
from gpuagent.domain.slices import slice_manifests, taints_by_cause
from gpuagent.domain.snapshot import Snapshot
from gpuagent.kube.client import KubeApi
from gpuagent.kube.pacer import CallFailed, Pacer
from gpuagent.state.clock import Clock, LoopClock
from gpuagent.state.counters import SliceCounts
from gpuagent.state.store import DeviceStore, Watch

__all__ = ["Backoff", "Budget", "Coalescing", "SlicePublisher"]

log = structlog.get_logger("gpuagent.dra.slices")

#: What a refusal holds back (every call of the publisher, the Node's read included: they stand
#: or fall together).
SLICES = "resource_slices"
#: Seconds to wait when nothing is due (a store change ends the wait sooner).
IDLE_WAIT = 3600.0


class SlicePublisher:
    """Publishes the node's DRA devices as ResourceSlices; runs until cancelled."""

    def __init__(
        self,
        store: DeviceStore,
        devices: Callable[[Snapshot], tuple[DraDevice, ...]],
        api: KubeApi,
        *,
        node: str,
        driver: str,
        backoff: Backoff = Backoff(),
        coalescing: Coalescing = Coalescing(),
        budget: Budget = Budget(),
        clock: Clock | None = None,
        draw: Callable[[], float] = random.random,
    ) -> None:
        self._store = store
        self._devices = devices
        self._api = api
        self._node = node
        self._driver = driver
        self._clock = clock or LoopClock()
        self.pacer = Pacer(
            self._clock, backoff=backoff, coalescing=coalescing, budget=budget, draw=draw
        )
        self._node_uid: str | None = None
        # The node's slices as last written or listed, by name, each with its resourceVersion;
        # None: not known (at start, after a conflict or an absence): listed before the next write.
        self._stored: dict[str, dict[str, Any]] | None = None
        self._latest: tuple[DraDevice, ...] | None = None
        self._views: Watch[tuple[DraDevice, ...] | None] | None = None
        self.published: tuple[DraDevice, ...] | None = None
        self.generation = 0
        self.error = NOT_PUBLISHED
        self.up = False
        self.writes = 0
        self.lists = 0
        self.failures = 0
        self._reach: ApiReach | None = None
        self._reached()
        self._counted()

    @property
    def seen_version(self) -> int:
        """The last store version the publisher looked at (``-1`` before it runs)."""
        return self._views.version if self._views is not None else -1

    async def run(self) -> None:
        self._views = views = self._store.watch(self._wanted, clock=self._clock)
        self._latest = await anext(views)
        while True:
            due = self._next()
            now = self._clock.now()
            if due is not None and due <= now:
                await self._flush()
                continue
            # The devices once they change, or as they are when the publication is due.
            self._latest = await views.next(now + IDLE_WAIT if due is None else due)

    def _wanted(self, snapshot: Snapshot) -> tuple[DraDevice, ...] | None:
        """The devices to publish, as a slice says them (without the reason in words, which the
        kubelet's health stream carries); ``None`` until the GPUs are discovered."""
        if not snapshot.discovered:
            return None
        return tuple(d if not d.reason else replace(d, reason="") for d in self._devices(snapshot))

    def _health_changed(self) -> frozenset[NewsKey]:
        """The GPUs and causes whose taints differ from those published."""
        return changed_keys(
            taints_by_cause(self.published or ()), taints_by_cause(self._latest or ())
        )

    def _next(self) -> float | None:
        """When the next publication goes out (``None``: nothing to publish)."""
        if self._latest is None or self._latest == self.published:
            if self.pacer.pending:
                self.pacer.done(wrote=False)  # changed, and changed back before it went out
            return None
        until = self.pacer.refused(SLICES)
        if until is not None:
            return until
        self.pacer.capacity = len({d.gpu_index for d in self._latest})
        self.pacer.changed()
        return self.pacer.due(self._health_changed())

    async def _flush(self) -> None:
        devices = self._latest
        assert devices is not None
        try:
            wrote = await self._publish(devices)
        except CallFailed as exc:
            said = exc.error.startswith("API server")  # the pacer's words for a retry
            self._failed(exc.error if said else f"API server: {exc.error}")
            return
        except Exception as exc:  # a bug must not end the task, nor spin: back off as if down
            log.exception("resource slices not published")
            self.pacer.pause(f"{type(exc).__name__}: {exc}")
            self._failed(f"{type(exc).__name__}: {exc}")
            return
        self.pacer.done(wrote=wrote)
        if not self.up:
            log.info("resource slices published", generation=self.generation)
        self.up = True
        self.error = ""
        self._reached()
        self._counted()

    def _failed(self, error: str) -> None:
        self.up = False
        self.failures += 1
        # Once per error, not on every retry (they back off up to the maximum).
        (log.warning if error != self.error else log.debug)(
            "resource slices not published; retrying", error=error
        )
        self.error = error
        self._reached()
        self._counted()

    def _reached(self) -> None:
        """Say in the store whether the API server is reached, as the last publication found."""
        reach = ApiReach(up=self.up, backing_off=bool(self.pacer.error), error=self.error)
        if reach != self._reach:
            self._reach = reach
            self._store.counters.api_reached("resource_slices", reach)

    def _counted(self) -> None:
        """Put the publisher's counts in the store, as they are now."""
        devices = len(self.published or ())
        counts = SliceCounts(self.failures, self.writes, self.generation, devices)
        self._store.counters.slices_counted(counts)

    def _published(self, devices: tuple[DraDevice, ...], generation: int) -> None:
        """``devices`` are the node's slices' now, at ``generation``: said in the store too."""
        self.generation, self.published = generation, devices
        self._store.set_dra_published(frozenset(d.name for d in devices))

    async def _publish(self, devices: tuple[DraDevice, ...]) -> bool:
        if self._node_uid is None:  # refused (403, 404): the slices wait with it, not spin
            call = self._api.node_uid(self._node)
            self._node_uid = await self.pacer.call("node", call, key=SLICES)
        if self._stored is None:
            listed = await self._call(self._api.slices(self._node, self._driver))
            self.lists += 1
            self._stored = {s["metadata"]["name"]: s for s in listed}
            seen = max((_generation(s) for s in listed), default=0)
            self.generation = max(self.generation, seen)
            current = self._manifests(devices, seen)
            if seen and _same(current, self._stored):
                # Already there (an agent restart): adopt it without a write.
                self._published(devices, seen)
                return False
        stored = self._stored
        wanted = self._manifests(devices, self.generation + 1)
        for manifest in wanted:
            name = manifest["metadata"]["name"]
            old = stored.get(name)
            if old is None:
                version = await self._call(self._api.create_slice(manifest))
            else:
                manifest["metadata"]["resourceVersion"] = old["metadata"]["resourceVersion"]
                version = await self._call(self._api.replace_slice(manifest))
            manifest["metadata"]["resourceVersion"] = version
            stored[name] = manifest
            self.writes += 1
        names = {m["metadata"]["name"] for m in wanted}
        for name in [n for n in stored if n not in names]:
            await self._call(self._api.delete_slice(name), absent_ok=True)
            del stored[name]
        self._published(devices, self.generation + 1)
        log.info("resource slices written", generation=self.generation, devices=len(devices))
        return True

    async def _call(self, call: Awaitable[Any], *, absent_ok: bool = False) -> Any:
        """A slice call through the pacer. A conflict (409) or an absence (404) means the slices
        are not as last written: they are listed again, after a short backoff (``absent_ok``: a
        404 is the wanted outcome, a deletion of a slice already gone)."""
        try:
            return await self.pacer.call(
                "resource_slice", call, key=SLICES, absent_is_conflict=True
            )
        except CallFailed as exc:
            if exc.kind == "conflict":
                if exc.code == 404 and absent_ok:
                    return None
                self._stored = None
                self.pacer.pause(f"API server: {exc.error}")
            raise

    def _manifests(self, devices: tuple[DraDevice, ...], generation: int) -> list[dict[str, Any]]:
        assert self._node_uid is not None
        return slice_manifests(
            devices,
            node=self._node,
            node_uid=self._node_uid,
            driver=self._driver,
            generation=generation,
        )


def _generation(obj: Mapping[str, Any]) -> int:
    pool = obj.get("spec", {}).get("pool", {})
    value = pool.get("generation", 0)
    return value if isinstance(value, int) else 0


def _comparable(obj: Mapping[str, Any]) -> Any:
    spec = dict(obj.get("spec", {}))
    devices = []
    for device in spec.get("devices") or []:
        copy = dict(device)
        if "taints" in copy:  # the API server stamps timeAdded
            copy["taints"] = [
                {k: v for k, v in t.items() if k != "timeAdded"} for t in copy["taints"]
            ]
        devices.append(copy)
    spec["devices"] = devices
    return spec


def _same(wanted: list[dict[str, Any]], existing: Mapping[str, Mapping[str, Any]]) -> bool:
    if {m["metadata"]["name"] for m in wanted} != set(existing):
        return False
    return all(_comparable(m) == _comparable(existing[m["metadata"]["name"]]) for m in wanted)
