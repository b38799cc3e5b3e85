"""Keeps ``Snapshot.usage`` current: per-process readings → containers → names → accounting.

Each time the poller stores new per-process readings (or the kubelet's allocations change), the
accountant reads the cgroup of processes it has not seen (off the event loop), names their
containers — from the kubelet's container log links first (:mod:`gpuagent.runtime.loglinks`,
when given), then from the CRI cache for the IDs those did not name (each source refreshes only
for container IDs it has not named) — runs the pure :func:`~gpuagent.domain.accounting.account`
and stores the result. Scrapes only read the snapshot.
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
        self._inputs: tuple[object, ...] | None = None
        self.updates = 0
        store.counters.follow_cri(lambda: CriStats(cri.requests, cri.errors, len(cri.names)))
        if links is not None:
            store.counters.follow_log_links(
                lambda: LogLinkStats(links.listings, links.errors, links.containers)
            )

    async def run(self) -> None:
        """Account after every change of readings or allocations, until cancelled."""
        version = -1
        try:
            while True:
                snapshot = await self._store.wait_newer(version)
                version = snapshot.version
                if not _same(_inputs(snapshot), self._inputs):
                    await self.update()
        finally:
            self._cri.close()

    async def update(self) -> Usage:
        """Account for the current snapshot now and store the result."""
        snapshot = self._store.snapshot
        self._inputs = _inputs(snapshot)
        pids = {p.pid for gpu in snapshot.gpus if gpu.processes for p in gpu.processes.processes}
        owners = await asyncio.to_thread(self._proc.owners, pids)
        ids = {o.container_id for o in owners.values() if o is not None}
        names = await self._names(ids)
        # Newer readings stored meanwhile are accounted for on the next round.
        served = snapshot.plan.served_resources
        usage, self._ledger = account(snapshot, owners, names, self._ledger, served)
        self._store.update(lambda s: replace(s, usage=usage))
        self.updates += 1
        return usage

    async def _names(self, ids: set[str]) -> dict[str, PodRef]:
        """The log links' names, and the CRI's for the IDs they do not name."""
        names: dict[str, PodRef] = {}
        if self._links is not None and ids:
            names = await asyncio.to_thread(self._links.resolve, ids)
        rest = ids - names.keys()
        if rest:
            names = {**await self._cri.resolve(rest), **names}
        return names


def _inputs(snapshot: Snapshot) -> tuple[object, ...]:
    """What accounting depends on: each GPU's reading, the allocations and whether they are known
    (readings and mappings are replaced, never mutated, so identity tells a change)."""
    return (
        *(g.processes for g in snapshot.gpus),
        snapshot.pods.allocated,
        snapshot.plan,  # which resources are ours, so whose pods hold the devices
        snapshot.pods.refreshed_at is None,
    )


def _same(a: tuple[object, ...], b: tuple[object, ...] | None) -> bool:
    return b is not None and len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))
