"""The node-feature-discovery feature file with GPU feature discovery's labels
(:mod:`gpuagent.nodefiles.labels`), kept current from the snapshot and what the host says about
itself (:mod:`gpuagent.nodefiles.hostfacts`).

:class:`NodeFiles` keeps the feature file current from the snapshot's devices and the plan: a
reload that turns on time-slicing relabels the node. The writer is blocking (run in a thread),
replaces the file atomically and only when the content changes, and returns whether it did; a
write that fails is logged and retried at the next change. Health and readings do not enter it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import structlog

from gpuagent.domain.plan import Plan
from gpuagent.domain.resources import ResourceSettings
from gpuagent.domain.snapshot import Snapshot
from gpuagent.nodefiles.described import DescribedDevices
from gpuagent.nodefiles.hostfacts import DEFAULT_MACHINE_TYPE_FILE, read_host_facts
from gpuagent.nodefiles.labels import DEFAULT_FEATURES_FILE, node_labels, sync_features
from gpuagent.state.store import DeviceStore, Keyed

__all__ = ["LabelTarget", "NodeFiles", "write_labels"]

log = structlog.get_logger("gpuagent.nodefiles")


@dataclass(frozen=True, slots=True)
class LabelTarget:
    """Where the feature file goes, and where the host's facts are read."""

    path: Path = DEFAULT_FEATURES_FILE
    machine_type_file: Path = DEFAULT_MACHINE_TYPE_FILE
    sysfs_root: Path = Path("/sys")


class NodeFiles:
    """Keeps the feature file (``labels``) current from the store; ``None``: it is never written
    (node labels turned off, or a simulated node that must not reach the host's real
    directories)."""

    def __init__(self, store: DeviceStore, *, labels: LabelTarget | None) -> None:
        self._store = store
        self._labels = labels
        self._described = DescribedDevices()

    @property
    def wanted(self) -> bool:
        """Whether there is any file this agent may write."""
        return self._labels is not None

    async def run(self) -> None:
        """Rewrite the files after each change of devices or plan, until cancelled."""
        async for want in self._store.watch(self._wanted):
            if want is not None:
                await self.write(*want.value)

    def _wanted(self, snapshot: Snapshot) -> Keyed[object, tuple[Snapshot, Plan]] | None:
        """What the files are written from, once the GPUs are discovered."""
        if not snapshot.discovered:
            return None
        plan = snapshot.plan
        return Keyed((self._described(snapshot), plan.generation), (snapshot, plan))

    async def write(self, snapshot: Snapshot, plan: Plan) -> None:
        """Write the files for ``snapshot`` under ``plan`` (those this agent may write)."""
        if self._labels is not None:
            resources = plan.serving.resources
            await _write(
                "node labels", self._labels.path, write_labels, snapshot, resources, self._labels
            )


async def _write(what: str, path: Path, writer: Callable[..., bool], *args: object) -> None:
    try:
        changed = await asyncio.to_thread(writer, *args)
    except OSError as exc:
        log.warning("cannot write file", what=what, path=str(path), error=str(exc))
    else:
        if changed:
            log.info("file updated", what=what, path=str(path))


def write_labels(snapshot: Snapshot, resources: ResourceSettings, target: LabelTarget) -> bool:
    """Bring the feature file in line with ``snapshot``; True if the file changed."""
    host = read_host_facts(
        [g.pci_bus_id for g in snapshot.gpus],
        machine_type_file=target.machine_type_file,
        sysfs_root=target.sysfs_root,
    )
    if snapshot.gpus and host.vgpus is None:
        log.info("vgpu labels left out: the PCI configuration space is not fully readable")
    return sync_features(node_labels(snapshot, resources, host=host), target.path)
