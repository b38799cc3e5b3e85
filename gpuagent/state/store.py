"""The store: the versioned snapshot (the node's state and the plan it is served under), and the
counters.

One place every adapter reads from and publishes into: the NVML poller and the pod-resources
client write the snapshot, each plugin endpoint its registration (DRA's plugin and its slice
publisher their status), the reloader the plan, and each owner its counters; an ``Allocate``
answered is news for the pod-resources client (:meth:`DeviceStore.allocated`). Every consumer
follows it through :meth:`DeviceStore.watch`: its own projection of each new snapshot, when that
projection changes — or, for a consumer that also waits for a time (a retry, a batch due, a
message to repeat), when that time comes (:meth:`Watch.next`'s deadline, on the clock the watch
was given). Nothing here calls back into an adapter: readers read what owners put here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Generic, TypeVar

from gpuagent.domain.devices import Registration
from gpuagent.domain.plan import Plan
from gpuagent.domain.snapshot import Snapshot
from gpuagent.state.clock import Clock, LoopClock, Timer
from gpuagent.state.counters import Counters

__all__ = ["DeviceStore", "Keyed", "Watch", "per_snapshot"]

T = TypeVar("T")
K = TypeVar("K")
V = TypeVar("V")


class DeviceStore:
    """Holds the current :class:`Snapshot`; writers replace it, consumers watch it.

    Used from the event loop's thread only (:attr:`counters` excepted). ``update`` bumps the
    version only when the new snapshot differs from the current one, so watches wake on real
    changes; ``publish`` likewise only for a plan that differs.
    """

    def __init__(self, initial: Snapshot | None = None, *, plan: Plan | None = None) -> None:
        snapshot = initial or Snapshot()
        self._snapshot = snapshot if plan is None else replace(snapshot, plan=plan)
        self._changes = _Changes()
        self.counters = Counters()
        self._allocations = asyncio.Event()

    @property
    def snapshot(self) -> Snapshot:
        return self._snapshot

    @property
    def plan(self) -> Plan:
        """The current snapshot's plan."""
        return self._snapshot.plan

    def update(self, change: Callable[[Snapshot], Snapshot]) -> Snapshot:
        """Apply ``change`` to the current snapshot; returns the (possibly new) current snapshot."""
        current = self._snapshot
        proposed = change(current)
        if replace(proposed, version=current.version) == current:
            return current
        self._snapshot = replace(proposed, version=current.version + 1)
        self._changes.wake()
        return self._snapshot

    def publish(self, plan: Plan) -> Plan | None:
        """Serve under ``plan`` from now on, as the next generation (a new snapshot); ``None``
        (and nothing happens) when it equals the current plan (generations aside)."""
        current = self._snapshot.plan
        if replace(plan, generation=current.generation) == current:
            return None
        published = replace(plan, generation=current.generation + 1)
        self.update(lambda s: replace(s, plan=published))
        return published

    def set_registration(self, resource: str, registration: Registration | None) -> None:
        """Record ``resource``'s registration with the kubelet (``None``: no longer served)."""

        def change(snapshot: Snapshot) -> Snapshot:
            registrations = dict(snapshot.registrations)
            if registration is None:
                registrations.pop(resource, None)
            else:
                registrations[resource] = registration
            return replace(snapshot, registrations=MappingProxyType(registrations))

        self.update(change)

    def allocated(self) -> None:
        """Devices were given to a container (an ``Allocate`` answered, a DRA claim prepared):
        the kubelet records it next, so whoever follows the allocations (the pod-resources
        client) looks again soon. News, not state: no new snapshot, so no consumer of the
        node's state wakes for it, and the hot path of an ``Allocate`` pays one flag set."""
        self._allocations.set()

    @property
    def allocations(self) -> asyncio.Event:
        """Set by :meth:`allocated`; its one reader (the pod-resources client) clears it once it
        has looked."""
        return self._allocations

    def set_dra_registration(self, registration: Registration) -> None:
        """Record DRA's kubelet plugin's registration (the kubelet's verdict, or why the plugin
        is not served); the first record says DRA is on."""
        self.update(lambda s: replace(s, dra_registration=registration))

    def set_dra_published(self, names: frozenset[str]) -> None:
        """Record the names of the devices in the ResourceSlices just published."""
        self.update(lambda s: replace(s, dra_published=names))

    def watch(
        self,
        projection: Callable[[Snapshot], T],
        *,
        until: asyncio.Event | None = None,
        clock: Clock | None = None,
    ) -> Watch[T]:
        """``projection`` of the current snapshot at once, then of each newer snapshot whose
        projection differs (``==``) from the last one given: see :class:`Watch`.

        ``until``: the watch ends once it is set (after the first value). ``clock``: what the
        deadlines of :meth:`Watch.next` are times of (default: the event loop's clock).
        """
        return Watch(self, self._changes, projection, until, clock or _LOOP_CLOCK)

    @property
    def waiting(self) -> int:
        """How many watches wait for a change now."""
        return len(self._changes)


class _Changes:
    """The store's waiters for its next update."""

    def __init__(self) -> None:
        self._waiters: set[asyncio.Future[None]] = set()

    def __len__(self) -> int:
        return len(self._waiters)

    def wake(self) -> None:
        waiters, self._waiters = self._waiters, set()
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def next(self, wait: _Wait) -> None:
        """Until the next update, or ``wait`` ends (its event is set, its deadline passes)."""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.add(waiter)
        wait.waiter = waiter
        try:
            await waiter
        finally:
            self._waiters.discard(waiter)
            wait.waiter = None


class _Wait:
    """What ends one :meth:`Watch.next` besides the store's updates, made at its first wait and
    kept however many updates it sees: a task waiting for ``until``, a timer for the deadline.
    :meth:`close` undoes both."""

    def __init__(self, until: asyncio.Event | None, clock: Clock, deadline: float | None) -> None:
        self._until = until
        self._clock = clock
        self._deadline = deadline
        self._stop: asyncio.Task[object] | None = None
        self._timer: Timer | None = None
        self.passed = False  # the deadline has come
        self.waiter: asyncio.Future[None] | None = None  # the store's, while waiting

    def arm(self) -> bool:
        """Ready to wait (the task for ``until`` and the timer made, the first time); ``False``
        once the deadline has come: nothing to wait for."""
        deadline = self._deadline
        if deadline is not None and self._timer is None and not self.passed:
            if self._clock.now() >= deadline:
                self.passed = True
            else:
                self._timer = self._clock.call_at(deadline, self._deadline_came)
        if self._until is not None and self._stop is None:
            self._stop = asyncio.ensure_future(self._until.wait())
            self._stop.add_done_callback(self._wake)
        return not self.passed

    def _deadline_came(self) -> None:
        self.passed = True
        self._wake()

    def _wake(self, _: object = None) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def close(self) -> None:
        if self._stop is not None:
            self._stop.remove_done_callback(self._wake)
            self._stop.cancel()
        if self._timer is not None:
            self._timer.cancel()


_LOOP_CLOCK = LoopClock()


class Watch(Generic[T]):
    """One consumer's view of the store: an async iterator of its projection of the snapshot.

    The first value is the projection of the current snapshot, at once. Each next one waits for
    a newer snapshot whose projection differs (``==``) from the last value given, projecting only
    the latest snapshot when the consumer asks: a consumer slower than the store skips what it
    missed and sees the latest, never a queue of stale values. A projection runs on every version
    for every watch: keep it O(devices), cheap to compare, and a function of the snapshot alone.

    A consumer that also waits for a time asks :meth:`next` with a deadline: the next change, or
    the value as it is once the deadline comes — one wait for both, so nothing races. Nothing
    waits between two calls, and a call cancelled (the consumer's task, or ``asyncio.timeout``
    around it) leaves nothing waiting and the watch usable: a consumer may simply stop
    iterating. With ``until``, the iteration ends once that event is set (the first value is
    given anyway).
    """

    def __init__(
        self,
        store: DeviceStore,
        changes: _Changes,
        projection: Callable[[Snapshot], T],
        until: asyncio.Event | None,
        clock: Clock,
    ) -> None:
        self._store = store
        self._changes = changes
        self._projection = projection
        self._until = until
        self._clock = clock
        self._version = -1  # the version last projected
        self._given: tuple[T] | None = None  # the last value given (None: none yet)

    def __aiter__(self) -> Watch[T]:
        return self

    async def __anext__(self) -> T:
        return await self.next()

    async def next(self, deadline: float | None = None) -> T:
        """The next value: the projection once it differs from the last value given; or, once
        the watch's clock reaches ``deadline`` (at once if it has), the value as it is, changed
        or not. The first call gives the current value at once. Raises
        :exc:`StopAsyncIteration` once ``until`` is set (the first value aside)."""
        if self._given is None:
            return self.now()
        wait = _Wait(self._until, self._clock, deadline)
        try:
            while True:
                if self._until is not None and self._until.is_set():
                    raise StopAsyncIteration
                snapshot = self._store.snapshot
                if snapshot.version != self._version:
                    self._version = snapshot.version
                    value = self._projection(snapshot)
                    if value != self._given[0]:
                        self._given = (value,)
                        return value
                if not wait.arm():  # the deadline has come
                    return self._given[0]
                await self._changes.next(wait)
        finally:
            wait.close()

    @property
    def version(self) -> int:
        """The store version last projected (``-1``: none yet), whether its projection changed
        or not: a watch that waits again with it current has seen the store as it is."""
        return self._version

    def now(self) -> T:
        """The projection of the current snapshot, changed or not (a retry's fresh read); the
        next value is a change from it."""
        snapshot = self._store.snapshot
        self._version, self._given = snapshot.version, (self._projection(snapshot),)
        return self._given[0]


@dataclass(frozen=True, slots=True)
class Keyed(Generic[K, V]):
    """A projection that carries what its consumer acts on (``value``: the snapshot, say) and
    compares by what the consumer depends on (``key``) alone."""

    key: K
    value: V = field(compare=False)


def per_snapshot(derive: Callable[[Snapshot], T]) -> Callable[[Snapshot], T]:
    """``derive``, computed once per snapshot however many consumers project through it (the
    last snapshot and its value are kept): watches that share a derivation share its cost."""
    last: tuple[Snapshot, T] | None = None

    def derived(snapshot: Snapshot) -> T:
        nonlocal last
        if last is None or last[0] is not snapshot:
            last = (snapshot, derive(snapshot))
        return last[1]

    return derived
