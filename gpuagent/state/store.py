"""The store: the versioned snapshot (the node's state and the plan it is served under), and the
counters.

One place every adapter reads from and publishes into: the NVML poller and the pod-resources
client write the snapshot, each plugin endpoint its registration, the reloader the plan, and each
owner its counters. Readers wait for newer snapshot versions; a new plan is a new snapshot too.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace
from types import MappingProxyType

from gpuagent.domain.devices import Registration
from gpuagent.domain.plan import Plan
from gpuagent.domain.snapshot import Snapshot
from gpuagent.state.counters import Counters

__all__ = ["DeviceStore"]


class DeviceStore:
    """Holds the current :class:`Snapshot`; writers replace it, readers wait for newer versions.

    Used from the event loop's thread only (:attr:`counters` excepted). ``update`` bumps the
    version only when the new snapshot differs from the current one, so watchers wake on real
    changes; ``publish`` likewise only for a plan that differs.
    """

    def __init__(self, initial: Snapshot | None = None, *, plan: Plan | None = None) -> None:
        snapshot = initial or Snapshot()
        self._snapshot = snapshot if plan is None else replace(snapshot, plan=plan)
        self._changed = asyncio.Event()
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
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()
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

    async def wait_newer(self, version: int) -> Snapshot:
        """Return the first snapshot whose version is greater than ``version``."""
        while self._snapshot.version <= version:
            await self._changed.wait()
        return self._snapshot
