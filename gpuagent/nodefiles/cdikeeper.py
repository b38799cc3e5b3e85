"""The node's CDI spec (:mod:`gpuagent.nodefiles.cdi`), kept current for the container runtime,
which reads it for the ``cdi-annotations`` and ``cdi-cri`` strategies: built from the snapshot
(:mod:`~gpuagent.nodefiles.cdicontent`) and the driver's files under the driver root
(:mod:`~gpuagent.nodefiles.cdidriver`), or — in ``toolkit`` mode — none at all, the NVIDIA
container toolkit's own spec being checked for the devices the agent hands out.

The writer (:func:`write_cdi`) is blocking (run in a thread), replaces the file atomically and
only when the content changes, and returns whether it did; it raises :class:`OSError` when the
file cannot be written. Health and readings do not enter it.

:class:`CdiSpecKeeper` keeps the spec current from the store's devices while the plan uses CDI,
and records in the store which devices the spec on disk defines (:class:`~gpuagent.domain.devices.
CdiSpec`): the device plugin advertises a device only once its spec entry is on disk, and
registers only once the first spec is (:mod:`gpuagent.domain.serving`). A reload that turns a CDI
strategy on writes the spec before the plan is published (:meth:`CdiSpecKeeper.sync`). A write
that fails is retried once its backoff is over (1 s, doubling to 30 s:
:class:`~gpuagent.nodefiles.writeretry.WriteRetry`), at once when what the spec is written from
changes, and logged when its error changes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace

import structlog

from gpuagent.domain.backoff import Backoff
from gpuagent.domain.containers import ContainerSettings
from gpuagent.domain.devices import CdiSpec
from gpuagent.domain.serving import spec_devices
from gpuagent.domain.snapshot import Snapshot
from gpuagent.logs import ProblemLog
from gpuagent.nodefiles.cdi import sync_spec, toolkit_devices
from gpuagent.nodefiles.cdicontent import (
    TOOLKIT,
    WRITE,
    CdiTarget,
    expected_toolkit_names,
    node_spec,
    spec_key,
)
from gpuagent.nodefiles.cdidriver import driver_files
from gpuagent.nodefiles.described import DescribedDevices, described_devices
from gpuagent.nodefiles.writeretry import WriteRetry
from gpuagent.state.clock import Clock, LoopClock
from gpuagent.state.store import DeviceStore, Keyed

__all__ = ["RETRY", "CdiSpecKeeper", "write_cdi"]

log = structlog.get_logger("gpuagent.nodefiles")

#: A CDI spec that could not be written is tried again after 1 s, doubling up to 30 s.
RETRY = Backoff(1.0, 30.0)

_Want = Keyed[object, tuple[Snapshot, ContainerSettings]]


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
        self._lock = asyncio.Lock()
        self._retry = WriteRetry(backoff)
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
            want = await wanted.next(self._retry.retry_at(want.key) if want is not None else None)

    def _wanted(self, snapshot: Snapshot) -> _Want | None:
        """What the spec is written from, while the plan uses CDI and the GPUs are discovered."""
        plan = snapshot.plan
        if not (snapshot.discovered and plan.writes_cdi_spec):
            return None
        containers = plan.serving.containers
        return Keyed(spec_key(snapshot, containers, self._described), (snapshot, containers))

    async def sync(self, snapshot: Snapshot, containers: ContainerSettings) -> None:
        """Bring the spec on disk in line with ``snapshot`` now (nothing when it is already);
        the store then says which devices it defines."""
        key = spec_key(snapshot, containers, described_devices)
        async with self._lock:
            if not self._retry.due(key, self._clock.now()):
                return
            target = self._target
            try:
                changed = await asyncio.to_thread(
                    write_cdi, snapshot, containers, target, self._libraries
                )
            except OSError as exc:
                if self._retry.failed(key, str(exc), self._clock.now()):
                    log.warning("cannot write file", what="cdi spec", path=str(target.spec_dir),
                                error=str(exc))  # fmt: skip
                error = self._retry.error
                self._record(lambda spec: replace(spec, written=True, error=error))
                return
            if changed:
                log.info("file updated", what="cdi spec", path=str(target.spec_dir))
            self._retry.succeeded(key)
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
    ``libraries``: where the want of the driver's libraries is said (see
    :func:`~gpuagent.nodefiles.cdidriver.driver_files`)."""
    if target.mode == TOOLKIT:
        _check_toolkit(snapshot, containers, target)
        return sync_spec(None, target.spec_dir)
    files = driver_files(snapshot, target, libraries)
    return sync_spec(node_spec(snapshot, containers, target, files), target.spec_dir)


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
