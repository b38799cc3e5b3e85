"""The store: the versioned snapshot (the node's state and the plan it is served under), and the
counters.

One place every adapter reads from and publishes into: the NVML poller and the pod-resources
client write the snapshot, each plugin endpoint its registration, the reloader the plan, and each
owner its counters. Every consumer follows it through :meth:`DeviceStore.watch`: its own
projection of each new snapshot, when that projection changes.
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

    def watch(
        self,
        projection: Callable[[Snapshot], T],
        *,
        until: asyncio.Event | None = None,
        repeat_after: float | None = None,
    ) -> Watch[T]:
        """``projection`` of the current snapshot at once, then of each newer snapshot whose
        projection differs (``==``) from the last one given: see :class:`Watch`.

        ``until``: the watch ends once it is set (after the first value). ``repeat_after``: the
        last value is given again when it has not changed for that many seconds.
        """
        return Watch(self, self._changes, projection, until, repeat_after)

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

    async def next(self, stop: asyncio.Task[object] | None, deadline: float | None) -> None:
        """Until the next update, ``stop`` is done, or the loop's clock reaches ``deadline``."""
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()

        def wake(_: object = None) -> None:
            if not waiter.done():
                waiter.set_result(None)

        self._waiters.add(waiter)
        timer = None if deadline is None else loop.call_at(deadline, wake)
        if stop is not None:
            stop.add_done_callback(wake)
        try:
            await waiter
        finally:
            self._waiters.discard(waiter)
            if timer is not None:
                timer.cancel()
            if stop is not None:
                stop.remove_done_callback(wake)


class Watch(Generic[T]):
    """One consumer's view of the store: an async iterator of its projection of the snapshot.

    The first value is the projection of the current snapshot, at once. Each next one waits for
    a newer snapshot whose projection differs (``==``) from the last value given, projecting only
    the latest snapshot when the consumer asks: a consumer slower than the store skips what it
    missed and sees the latest, never a queue of stale values. A projection runs on every version
    for every watch: keep it O(devices), cheap to compare, and a function of the snapshot alone.

    Nothing waits between two calls, and a call cancelled (the consumer's task, or
    ``asyncio.timeout`` around it) leaves nothing waiting and the watch usable: a consumer may
    simply stop iterating. With ``until``, the iteration ends once that event is set (the first
    value is given anyway); with ``repeat_after``, a value unchanged for that many seconds (the
    loop's clock) is given again.
    """

    def __init__(
        self,
        store: DeviceStore,
        changes: _Changes,
        projection: Callable[[Snapshot], T],
        until: asyncio.Event | None,
        repeat_after: float | None,
    ) -> None:
        self._store = store
        self._changes = changes
        self._projection = projection
        self._until = until
        self._repeat_after = repeat_after
        self._version = -1  # the version last projected
        self._given: tuple[T] | None = None  # the last value given (None: none yet)
        self._given_at = 0.0

    def __aiter__(self) -> Watch[T]:
        return self

    async def __anext__(self) -> T:
        if self._given is None:
            snapshot = self._store.snapshot
            return self._give(snapshot.version, self._projection(snapshot))
        stop: asyncio.Task[object] | None = None
        try:
            while True:
                if self._until is not None and self._until.is_set():
                    raise StopAsyncIteration
                snapshot = self._store.snapshot
                if snapshot.version != self._version:
                    self._version = snapshot.version
                    value = self._projection(snapshot)
                    if value != self._given[0]:
                        return self._give(snapshot.version, value)
                deadline = None
                if self._repeat_after is not None:
                    deadline = self._given_at + self._repeat_after
                    if asyncio.get_running_loop().time() >= deadline:
                        return self._give(snapshot.version, self._given[0])
                if self._until is not None and stop is None:
                    stop = asyncio.ensure_future(self._until.wait())
                await self._changes.next(stop, deadline)
        finally:
            if stop is not None:
                stop.cancel()

    @property
    def version(self) -> int:
        """The store version last projected (``-1``: none yet), whether its projection changed
        or not: a watch that waits again with it current has seen the store as it is."""
        return self._version

    def now(self) -> T:
        """The projection of the current snapshot, changed or not (a retry's fresh read); the
        next value is a change from it."""
        snapshot = self._store.snapshot
        return self._give(snapshot.version, self._projection(snapshot))

    def _give(self, version: int, value: T) -> T:
        self._version, self._given = version, (value,)
        if self._repeat_after is not None:
            self._given_at = asyncio.get_running_loop().time()
        return value


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
