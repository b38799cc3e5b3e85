"""Keeps ``Snapshot.usage`` current: per-process readings → containers → names → accounting.

Each time the poller stores new per-process readings (or the kubelet's allocations change), the
accountant reads the cgroup of processes it has not seen (off the event loop), names their
containers — from the kubelet's container log links first (:mod:`gpuagent.runtime.loglinks`,
when given), then from the CRI cache for the IDs those did not name (each source refreshes only
for container IDs it has not named) — runs the pure :func:`~gpuagent.domain.accounting.account`
and stores the result, and the CRI's and the log links' counts into the store's counters.
Scrapes only read the store.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import structlog

from gpuagent.domain.accounting import Ledger, account
from gpuagent.domain.devices import PodRef
from gpuagent.domain.snapshot import Snapshot
from gpuagent.domain.usage import Usage
from gpuagent.runtime.cri import CriClient
from gpuagent.runtime.loglinks import LogLinks
from gpuagent.runtime.procfs import ProcReader
from gpuagent.state.counters import CriStats, LogLinkStats
from gpuagent.state.store import DeviceStore

__all__ = ["Accountant"]

log = structlog.get_logger("gpuagent.accounting")


class Accountant:
    """Joins the driver's per-process readings to containers (one instance per agent)."""

    def __init__(
        self,
        store: DeviceStore,
        proc: ProcReader,
        cri: CriClient,
        links: LogLinks | None = None,
    ) -> None:
        self._store = store
        self._proc = proc
        self._cri = cri
        self._links = links
        self._ledger = Ledger()
        self.updates = 0
        self._counted()

    async def run(self) -> None:
        """Account after every change of readings or allocations, until cancelled."""
        try:
            async for _ in self._store.watch(_Inputs.of):
                await self.update()
        finally:
            self._cri.close()

    async def update(self) -> Usage:
        """Account for the current snapshot now and store the result."""
        snapshot = self._store.snapshot
        pids = {p.pid for gpu in snapshot.gpus if gpu.processes for p in gpu.processes.processes}
        owners = await asyncio.to_thread(self._proc.owners, pids)
        ids = {o.container_id for o in owners.values() if o is not None}
        names = await self._names(ids)
        # Newer readings stored meanwhile are accounted for on the next round.
        served = snapshot.plan.served_resources
        usage, self._ledger = account(
            snapshot, owners, names, self._ledger, served, dra=snapshot.plan.dra
        )
        self._store.update(lambda s: replace(s, usage=usage))
        self.updates += 1
        return usage

    async def _names(self, ids: set[str]) -> dict[str, PodRef]:
        """The log links' names, and the CRI's for the IDs they do not name."""
        names: dict[str, PodRef] = {}
        try:
            if self._links is not None and ids:
                names = await asyncio.to_thread(self._links.resolve, ids)
            rest = ids - names.keys()
            if rest:
                names = {**await self._cri.resolve(rest), **names}
        finally:
            self._counted()
        return names

    def _counted(self) -> None:
        """Put the CRI's and the log links' counts in the store, as they are now (they move only
        when asked for names, here)."""
        cri, links, counters = self._cri, self._links, self._store.counters
        counters.cri_counted(CriStats(cri.requests, cri.errors, len(cri.names)))
        if links is not None:
            counters.log_links_counted(LogLinkStats(links.listings, links.errors, links.containers))


class _Inputs:
    """What accounting depends on: each GPU's reading, the allocations and whether they are known,
    and the plan (which resources are ours, so whose pods hold the devices) — equal only when the
    same objects (readings and mappings are replaced, never mutated, so identity tells a change,
    and a reading equal in value to the last is still a new poll's)."""

    __slots__ = ("_items",)

    def __init__(self, items: tuple[object, ...]) -> None:
        self._items = items

    @classmethod
    def of(cls, snapshot: Snapshot) -> _Inputs:
        return cls(
            (
                *(g.processes for g in snapshot.gpus),
                snapshot.pods.allocated,
                snapshot.plan,
                snapshot.pods.refreshed_at is None,
            )
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Inputs):
            return NotImplemented
        a, b = self._items, other._items
        return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))

    def __hash__(self) -> int:
        return hash(tuple(id(x) for x in self._items))
