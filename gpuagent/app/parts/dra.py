"""The DRA side, when ``--dra-gpus`` serves GPUs through DRA: its kubelet plugin and ResourceSlice
publisher (:mod:`gpuagent.dra.side`), and the check of the GPUs ``--dra-gpus`` names.

The side is built with the agent (imported only when DRA is on: its API client costs memory), so
credentials that cannot be loaded are a configuration error before anything starts — unless
``--dra-gpus`` names GPUs: then the GPUs named are checked first, once the driver has listed
them, and each mistake is said whatever the other. Its tasks start with the rest; with MIG made
on demand (``--dra-mig dynamic``) it makes and destroys MIG devices through the driver, on a
thread of its own closed with the side.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import TYPE_CHECKING

from gpuagent.app import policy
from gpuagent.app.part import Context, Part, Stage, Task, bounded
from gpuagent.app.parts.driver import Driver
from gpuagent.config import ConfigError
from gpuagent.domain.dra import DraMig
from gpuagent.domain.snapshot import Snapshot
from gpuagent.gpu.migcontrol import MigControl

if TYPE_CHECKING:
    from gpuagent.dra.side import DraSide

__all__ = ["Dra", "DraGpusCheck", "build", "check_gpus"]


class Dra(Part):
    """The DRA side: ``side`` (``None`` when it could not be built, for ``unusable``)."""

    name = "dra"

    def __init__(
        self, context: Context, side: DraSide | None, unusable: ConfigError | None = None
    ) -> None:
        self._context = context
        self.side = side
        self.unusable = unusable

    async def start(self) -> None:
        store = self._context.store
        if self.side is not None and store.plan.dra.mig is DraMig.DYNAMIC:
            nvml = self._context.parts.get(Driver).nvml
            assert nvml is not None
            self.side.manage_mig(MigControl(nvml, store))

    def tasks(self) -> Mapping[str, Task]:
        return self.side.tasks() if self.side is not None else {}

    async def close(self, seconds: float) -> None:
        if self.side is not None:
            await bounded(seconds, self.side.close())


def build(context: Context) -> Dra | None:
    """The DRA side, when DRA is on. Without credentials, when ``--dra-gpus`` names GPUs: none,
    and the error, said once the GPUs named are checked (:class:`DraGpusCheck`)."""
    gpus = context.store.plan.dra.gpus
    if not gpus.enabled:
        return None
    try:
        return Dra(context, _side(context))
    except ConfigError as exc:
        if not gpus.refs:
            raise
        return Dra(context, None, exc)


def _side(context: Context) -> DraSide:
    """Raises :class:`ConfigError` without usable credentials, naming the kubeconfig as given, or
    the setting that needs them."""
    from gpuagent.dra.side import DraSide, KubeConfigError  # noqa: PLC0415

    settings = context.settings
    try:
        return DraSide(
            context.store,
            node=context.node_name,
            plugins_dir=settings.plugins_dir,
            registry_dir=settings.plugins_registry_dir,
            cdi_dir=settings.cdi_spec_dir,
            kubeconfig=settings.kubeconfig,
            stopping=context.stopping,
            node_spec=policy.dra_node_spec(settings),
            proc_root=context.proc_root,  # (the checkpoint's boot)
            **context.knobs.dra_options,
        )
    except KubeConfigError as exc:
        given = settings.kubeconfig is not None
        why = str(exc) if given else f"needs API server credentials: {exc}"
        raise ConfigError(settings.named("kubeconfig" if given else "dra_gpus"), why) from exc


class DraGpusCheck(Part):
    """The GPUs ``--dra-gpus`` names, checked against the node's: before anything is served or
    written once the driver has listed them, and again until every one is found (a
    :class:`ConfigError`, exit 2, when the node lacks one)."""

    name = "dra-gpus"
    stage = Stage.KUBELET

    def __init__(self, context: Context) -> None:
        self._context = context

    async def start(self) -> None:
        """Once the driver has listed the GPUs: a GPU named that the node does not have, then
        the DRA side's want of credentials. A driver that could not start is left to the start
        (``--fail-on-init-error``); GPUs named but not yet told apart, to the task."""
        parts = self._context.parts
        driver = parts.get(Driver)
        first = driver.first_start
        await asyncio.wait({first})
        if first.exception() is not None:
            return  # (the start raises it)
        self._check(self._context.store.snapshot, driver.gpu_count)
        dra = parts.find(Dra)
        if dra is not None and dra.unusable is not None:
            raise dra.unusable

    def tasks(self) -> Mapping[str, Task]:
        return {"dra-gpus-check": self._watch}

    async def _watch(self) -> None:
        """Until the check is final (every GPU listed is found, or every GPU's UUID is known);
        then idle until the agent stops."""
        store, driver = self._context.store, self._context.parts.get(Driver)
        gpus = store.plan.dra.gpus
        async for snapshot in store.watch(lambda s: s):
            count = driver.gpu_count
            if self._check(snapshot, count) and gpus.decided(snapshot.gpus, count):
                break
        await self._context.stopping.wait()

    def _check(self, snapshot: Snapshot, count: int) -> bool:
        """Raises :class:`ConfigError` for a GPU named that the node of ``snapshot`` (``count``
        GPUs) lacks; whether its GPUs are discovered (so the check said something)."""
        if not snapshot.discovered:
            return False
        problem = policy.absent_dra_gpus(snapshot.plan.dra.gpus, snapshot, count)
        if problem is not None:
            raise ConfigError(self._context.settings.named("dra_gpus"), problem)
        return True


def check_gpus(context: Context) -> DraGpusCheck | None:
    """The check, when ``--dra-gpus`` names GPUs."""
    return DraGpusCheck(context) if context.store.plan.dra.gpus.refs else None
