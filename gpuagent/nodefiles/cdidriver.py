"""The driver's files for the node's CDI spec, found under the driver root (blocking: it reads
the driver root), and said once when its libraries are missing; :class:`NodeSpecs`, the node's
spec kept for DRA's per-claim specs, which reads the driver root again only for a new driver or
new GPUs."""

from __future__ import annotations

import structlog

from gpuagent.domain.containers import ContainerSettings
from gpuagent.domain.snapshot import Snapshot
from gpuagent.logs import ProblemLog
from gpuagent.nodefiles.cdi import Spec
from gpuagent.nodefiles.cdicontent import CdiTarget, node_spec, spec_key
from gpuagent.nodefiles.described import described_devices
from gpuagent.nodefiles.driverfiles import DriverFiles, DriverRoot

__all__ = ["NodeSpecs", "driver_files"]

log = structlog.get_logger("gpuagent.nodefiles")


def driver_files(
    snapshot: Snapshot, target: CdiTarget, libraries: ProblemLog | None = None
) -> DriverFiles:
    """The driver's files for ``snapshot``'s driver and GPUs under the target's driver root.
    Their libraries' absence is said through ``libraries`` (once until they are found: a caller
    that looks again and again keeps one), or at once without it."""
    root = DriverRoot(target.read_root, kernel_release=target.kernel_release)
    version = snapshot.driver.version
    files = root.find(version, [g.pci_bus_id for g in snapshot.gpus])
    said = libraries or ProblemLog(log)
    host_root, read_at = target.driver_root, str(target.read_root)
    if snapshot.gpus and not files.libraries:
        said.failed(
            "driver libraries not found; CDI containers get device nodes only",
            driver_root=host_root,
            read_at=read_at,
            driver_version=version,
        )
    elif files.libraries:
        said.recovered(
            "driver libraries found", driver_root=host_root, read_at=read_at, driver_version=version
        )
    return files


class NodeSpecs:
    """:func:`~gpuagent.nodefiles.cdicontent.node_spec`, built again only when the devices, the
    driver or the container settings change — DRA's per-claim specs take their edits from it, so
    a prepare does not read the driver root each time — and the driver root read again only when
    the driver or the GPUs change (a MIG device made on prepare changes the devices alone).
    Blocking; one caller at a time."""

    def __init__(self, target: CdiTarget) -> None:
        self._target = target
        self._key: object = None
        self._spec: Spec | None = None
        self._files_key: object = None
        self._files: DriverFiles | None = None
        self._libraries = ProblemLog(log)

    def get(self, snapshot: Snapshot, containers: ContainerSettings) -> Spec | None:
        key = spec_key(snapshot, containers, described_devices)
        if key != self._key:
            files_key = (snapshot.driver.version, tuple(g.pci_bus_id for g in snapshot.gpus))
            if files_key != self._files_key or self._files is None:
                self._files = driver_files(snapshot, self._target, self._libraries)
                self._files_key = files_key
            self._spec = node_spec(snapshot, containers, self._target, self._files)
            self._key = key
        return self._spec
