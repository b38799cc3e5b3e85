"""The node's CDI spec (:mod:`gpuagent.nodefiles.cdi`), kept current for the container runtime,
which reads it for the ``cdi-annotations`` and ``cdi-cri`` strategies: built from the snapshot
and the driver's files under the driver root (:mod:`gpuagent.nodefiles.driverfiles`), or — in
``toolkit`` mode — none at all, the NVIDIA container toolkit's own spec being checked for the
devices the agent hands out.

The writer is blocking (run in a thread), replaces the file atomically and only when the content
changes, and returns whether it did; it raises :class:`OSError` when the file cannot be written.
Health and readings do not enter it.

:class:`CdiSpecKeeper` keeps the spec current from the store's devices while the plan uses CDI,
and records in the store which devices the spec on disk defines (:class:`~gpuagent.domain.devices.
CdiSpec`): the device plugin advertises a device only once its spec entry is on disk, and
registers only once the first spec is (:mod:`gpuagent.domain.serving`). A reload that turns a CDI
strategy on writes the spec before the plan is published (:meth:`CdiSpecKeeper.sync`). A write
that fails is retried once its backoff is over (1 s, doubling to 30 s), at once when what the
spec is written from changes, and logged when its error changes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import structlog

from gpuagent.clock import Clock, LoopClock
from gpuagent.domain.backoff import Backoff
from gpuagent.domain.containers import ContainerSettings
from gpuagent.domain.devices import CdiSpec
from gpuagent.domain.naming import mig_index
from gpuagent.domain.serving import spec_devices
from gpuagent.domain.snapshot import Snapshot
from gpuagent.logs import ProblemLog
from gpuagent.nodefiles.cdi import (
    TOOLKIT_SPEC_DIRS,
    Spec,
    build_spec,
    device_names,
    sync_spec,
    toolkit_devices,
)
from gpuagent.nodefiles.described import DescribedDevices, described_devices
from gpuagent.nodefiles.driverfiles import DriverFiles, DriverRoot
from gpuagent.state.store import DeviceStore, Keyed

__all__ = [
    "CdiSpecKeeper",
    "CdiTarget",
    "NodeSpecs",
    "expected_toolkit_names",
    "node_spec",
    "write_cdi",
]

log = structlog.get_logger("gpuagent.nodefiles")

WRITE = "write"
TOOLKIT = "toolkit"
#: A CDI spec that could not be written is tried again after 1 s, doubling up to 30 s.
RETRY = Backoff(1.0, 30.0)


@dataclass(frozen=True, slots=True)
class CdiTarget:
    """Where and how the CDI spec is kept.

    ``driver_root`` is the driver root as the host (and so the container runtime) sees it,
    ``read_root`` where the agent reads it (a mount of it in the agent's container, or the same
    path); ``hook_path`` the host path of the toolkit's hook binary.
    """

    spec_dir: Path
    mode: str = WRITE
    driver_root: str = "/"
    read_root: Path = Path("/")
    hook_path: str = "/usr/bin/nvidia-ctk"
    toolkit_dirs: Sequence[Path] = TOOLKIT_SPEC_DIRS
    kernel_release: str | None = None


class CdiSpecKeeper:
    """Keeps the agent's CDI spec (``target``) current while the plan's strategies use CDI, and
    tells the store which devices the spec on disk defines (in ``write`` mode; the toolkit's spec
    is another program's, only checked).

    Construct it before the device plugin registers: from then on the first device list waits
    for the first spec (see the module doc).
    """

    def __init__(
        self,
        store: DeviceStore,
        target: CdiTarget,
        *,
        clock: Clock | None = None,
        backoff: Backoff = RETRY,
    ) -> None:
        self._store = store
        self._target = target
        self._clock = clock or LoopClock()  # times the retries: tests move it by hand
        self._backoff = backoff
        self._lock = asyncio.Lock()
        self._written: object = None  # what the spec on disk was last written for
        self._error = ""
        # After a failed write, the same spec is tried again no sooner than this (the clock's).
        self._failed: object = None
        self._retry_at = 0.0
        self._retrying = False  # the last write failed
        self._failures = 0  # writes in a row that failed
        self._described = DescribedDevices()
        self._libraries = ProblemLog(log)  # said once, not at every try of a failing write
        if target.mode == WRITE:
            store.update(lambda s: replace(s, cdi=s.cdi or CdiSpec()))

    async def run(self) -> None:
        """Write the spec after each change of the devices while the plan uses CDI (a failed
        write again once its backoff is over), until cancelled."""
        wanted = self._store.watch(self._wanted, clock=self._clock)
        want = await anext(wanted)
        while True:
            if want is not None:
                await self.sync(*want.value)
            # A failed write of what is still wanted is tried again when its backoff is over.
            retry = self._retry_at if self._retrying and want is not None else None
            want = await wanted.next(retry)

    def _wanted(self, snapshot: Snapshot) -> _Want | None:
        """What the spec is written from, while the plan uses CDI and the GPUs are discovered."""
        plan = snapshot.plan
        if not (snapshot.discovered and plan.writes_cdi_spec):
            return None
        containers = plan.serving.containers
        return Keyed(_spec_key(snapshot, containers, self._described), (snapshot, containers))

    async def sync(self, snapshot: Snapshot, containers: ContainerSettings) -> None:
        """Bring the spec on disk in line with ``snapshot`` now (nothing when it is already);
        the store then says which devices it defines."""
        key = _spec_key(snapshot, containers, described_devices)
        async with self._lock:
            if key == self._written or (key == self._failed and self._clock.now() < self._retry_at):
                return
            target = self._target
            try:
                changed = await asyncio.to_thread(
                    write_cdi, snapshot, containers, target, self._libraries
                )
            except OSError as exc:
                if str(exc) != self._error:
                    log.warning("cannot write file", what="cdi spec", path=str(target.spec_dir),
                                error=str(exc))  # fmt: skip
                self._error = str(exc)
                self._failures += 1
                delay = self._backoff.ceiling(self._failures)
                self._failed, self._retry_at = key, self._clock.now() + delay
                self._retrying = True
                self._record(lambda spec: replace(spec, written=True, error=self._error))
                return
            if changed:
                log.info("file updated", what="cdi spec", path=str(target.spec_dir))
            self._written, self._error, self._failures = key, "", 0
            self._retrying = False
            devices = spec_devices(snapshot)
            self._record(lambda spec: CdiSpec(devices=devices, written=True))

    def _record(self, change: Callable[[CdiSpec], CdiSpec]) -> None:
        if self._target.mode == WRITE:
            self._store.update(lambda s: replace(s, cdi=change(s.cdi or CdiSpec())))


def write_cdi(
    snapshot: Snapshot,
    containers: ContainerSettings,
    target: CdiTarget,
    libraries: ProblemLog | None = None,
) -> bool:
    """Bring the agent's CDI spec in line with ``snapshot``; True if the file changed.
    ``libraries``: where the want of the driver's libraries is said (see :func:`driver_files`)."""
    if target.mode == TOOLKIT:
        _check_toolkit(snapshot, containers, target)
        return sync_spec(None, target.spec_dir)
    files = driver_files(snapshot, target, libraries)
    return sync_spec(node_spec(snapshot, containers, target, files), target.spec_dir)


def node_spec(
    snapshot: Snapshot,
    containers: ContainerSettings,
    target: CdiTarget,
    files: DriverFiles | None = None,
) -> Spec | None:
    """The agent's own CDI spec for ``snapshot``: device nodes and the driver's files found under
    the target's driver root (blocks: it reads the driver root), or ``files`` as found before."""
    if files is None:
        files = driver_files(snapshot, target)
    return build_spec(
        snapshot,
        dev_root=containers.dev_root,
        control_nodes=containers.control_nodes,
        driver=files,
        driver_root=target.driver_root,
        hook_path=target.hook_path,
    )


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
    """:func:`node_spec`, built again only when the devices, the driver or the container settings
    change — DRA's per-claim specs take their edits from it, so a prepare does not read the
    driver root each time — and the driver root read again only when the driver or the GPUs
    change (a MIG device made on prepare changes the devices alone). Blocking; one caller at a
    time."""

    def __init__(self, target: CdiTarget) -> None:
        self._target = target
        self._key: object = None
        self._spec: Spec | None = None
        self._files_key: object = None
        self._files: DriverFiles | None = None
        self._libraries = ProblemLog(log)

    def get(self, snapshot: Snapshot, containers: ContainerSettings) -> Spec | None:
        key = _spec_key(snapshot, containers, described_devices)
        if key != self._key:
            files_key = (snapshot.driver.version, tuple(g.pci_bus_id for g in snapshot.gpus))
            if files_key != self._files_key or self._files is None:
                self._files = driver_files(snapshot, self._target, self._libraries)
                self._files_key = files_key
            self._spec = node_spec(snapshot, containers, self._target, self._files)
            self._key = key
        return self._spec


_Want = Keyed[object, tuple[Snapshot, ContainerSettings]]


def _spec_key(
    snapshot: Snapshot, containers: ContainerSettings, described: Callable[[Snapshot], object]
) -> object:
    """What the node's spec depends on: the devices as described and where the nodes are."""
    return (described(snapshot), containers.dev_root, containers.control_nodes)


def expected_toolkit_names(snapshot: Snapshot, containers: ContainerSettings) -> list[str]:
    """The device names ``Allocate`` hands out, which the toolkit's spec must define."""
    names: list[str] = []
    strategy = (containers.id_strategy,)
    for gpu in sorted(snapshot.gpus, key=lambda g: g.index):
        names += device_names(gpu.uuid, str(gpu.index), strategy)
        for position, mig in enumerate(gpu.mig_devices):
            names += device_names(mig.uuid, mig_index(gpu.index, position), strategy)
    return names


def _check_toolkit(snapshot: Snapshot, containers: ContainerSettings, target: CdiTarget) -> None:
    defined = toolkit_devices(target.toolkit_dirs)
    if not snapshot.gpus:
        return
    if defined is None:
        log.warning(
            "no NVIDIA container toolkit CDI spec found; containers will not start "
            "(run nvidia-ctk cdi generate, or set cdi-spec: write)",
            searched=[str(d) for d in target.toolkit_dirs],
        )
        return
    missing = [n for n in expected_toolkit_names(snapshot, containers) if n not in defined]
    if missing:
        log.warning(
            "the toolkit's CDI spec lacks devices the agent hands out; regenerate it "
            "(nvidia-ctk cdi generate --device-name-strategy=uuid or index, as the agent's "
            "device-id-strategy)",
            missing=missing,
        )
