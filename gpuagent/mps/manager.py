"""The MPS control daemons the node's resources need, each kept by a :class:`DaemonKeeper`.

The daemons follow the store: the resources shared through MPS under the current plan and GPUs
(:meth:`~gpuagent.domain.serving.ResourceView.mps_daemons`), and the GPUs shared through DRA
(``--dra-sharing mps``: :func:`~gpuagent.domain.drasharing.share_daemons`, one per GPU). A
daemon the plan no longer wants is stopped; a new one is started; one whose GPUs or limits
changed (a reload changed the replicas, a GPU was described late) is stopped and started again
with the new limits — its devices are unhealthy meanwhile, so nothing is allocated to a daemon
being reconfigured. The others run on.
Each keeper is a named task (``mps-daemon:<resource>``) of this one, which the agent supervises.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import structlog

from gpuagent.domain.drasharing import share_daemons
from gpuagent.domain.mps import MpsDaemon, MpsDirs
from gpuagent.domain.serving import ResourceView
from gpuagent.domain.snapshot import Snapshot
from gpuagent.mps.daemon import ComputeModeControl, DaemonKeeper, Timing
from gpuagent.state.store import DeviceStore

__all__ = ["MpsDaemons"]

log = structlog.get_logger("gpuagent.mps")


class MpsDaemons:
    """Keeps the control daemon of every resource shared through MPS, for the agent's life."""

    def __init__(
        self,
        store: DeviceStore,
        view: ResourceView,
        *,
        dirs: MpsDirs,
        driver_root: Path,
        compute_modes: ComputeModeControl | None,
        timing: Timing | None = None,
        keeper: Callable[..., DaemonKeeper] = DaemonKeeper,
    ) -> None:
        self._store = store
        self._view = view
        self._dirs = dirs
        self._driver_root = driver_root
        self._modes = compute_modes
        self._timing = timing or Timing()
        self._keeper = keeper
        self._kept: dict[str, tuple[DaemonKeeper, asyncio.Task[None]]] = {}

    @property
    def keepers(self) -> dict[str, DaemonKeeper]:
        return {name: kept[0] for name, kept in self._kept.items()}

    async def run(self) -> None:
        """Follow the planned daemons until cancelled; every daemon is stopped on the way out."""
        try:
            async with asyncio.TaskGroup() as group:
                async for daemons in self._store.watch(self._planned):
                    await self._reconcile(group, {d.name: d for d in daemons})
        finally:
            for name in list(self._kept):
                await self._withdraw(name)
            if self._modes is not None:
                self._modes.close()

    def _planned(self, snapshot: Snapshot) -> tuple[MpsDaemon, ...]:
        """The device plugin's shared resources' daemons, then the shared DRA GPUs' (a GPU is
        served by one API, so no GPU is under two daemons)."""
        plugin = self._view.mps_daemons(snapshot, snapshot.plan.serving)
        return plugin + share_daemons(snapshot, snapshot.plan.dra)

    async def _reconcile(self, group: asyncio.TaskGroup, wanted: dict[str, MpsDaemon]) -> None:
        for name, (keeper, _) in list(self._kept.items()):
            if wanted.get(name) != keeper.daemon:
                if name in wanted:
                    log.info("MPS daemon's GPUs or limits changed; restarting it", daemon=name)
                await self._withdraw(name)
        for name, daemon in wanted.items():
            if name in self._kept:
                continue
            keeper = self._keeper(
                daemon,
                self._store,
                dirs=self._dirs,
                driver_root=self._driver_root,
                compute_modes=self._modes,
                timing=self._timing,
            )
            # A keeper runs until cancelled: one that fails takes this task (and the agent) down.
            task = group.create_task(keeper.run(), name=f"mps-daemon:{name}")
            self._kept[name] = (keeper, task)

    async def _withdraw(self, name: str) -> None:
        _, task = self._kept.pop(name)
        task.cancel()
        await asyncio.wait({task})
