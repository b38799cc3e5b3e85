"""The DRA side, when ``--dra-gpus`` serves GPUs through DRA: its kubelet plugin and ResourceSlice
publisher (:mod:`gpuagent.dra.side`), and the check of the GPUs ``--dra-gpus`` names.

Credentials that cannot be loaded are a configuration error before anything starts, told without
the API client (:func:`gpuagent.kube.credentials.unusable`) — unless ``--dra-gpus`` names GPUs:
then the GPUs named are checked first, once the driver has listed them, and each mistake is said
whatever the other. The side and its client (lightkube, httpx2: ~100 ms of CPU) are imported off
the loop once the kubelet has its device plugin, and the side built then (what the client's
models make of the kubeconfig's values is found then: still exit 2). Its tasks start with the
rest; with MIG made on demand (``--dra-mig dynamic``) it makes and destroys MIG devices through
the driver, on a thread of its own closed with the side.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import TYPE_CHECKING

from gpuagent.app import policy
from gpuagent.app.part import Context, Part, Stage, Task, bounded
from gpuagent.app.parts.driver import Driver
from gpuagent.config import ConfigError, Settings
from gpuagent.domain.devices import Registration
from gpuagent.domain.dra import DraMig
from gpuagent.domain.snapshot import Snapshot
from gpuagent.gpu.migcontrol import MigControl
from gpuagent.kube.credentials import unusable

if TYPE_CHECKING:
    from gpuagent.dra.side import DraSide

__all__ = ["SIDE_MODULE", "Dra", "DraGpusCheck", "build", "check_gpus"]

#: The side's module (and with it the API client's), imported off the loop before it starts.
SIDE_MODULE = "gpuagent.dra.side"


class Dra(Part):
    """The DRA side: ``side`` once started (never, for ``unusable`` credentials: the check of
    the GPUs named says so before anything starts)."""

    name = "dra"

    def __init__(self, context: Context, unusable: ConfigError | None = None) -> None:
        self._context = context
        self.side: DraSide | None = None
        self.unusable = unusable
        self.imports = (SIDE_MODULE,) if unusable is None else ()
        if unusable is None:  # (not registered until the kubelet says so: readiness waits)
            context.store.set_dra_registration(Registration())

    async def start(self) -> None:
        if self.unusable is not None:
            return
        self.side = _side(self._context)
        store = self._context.store
        if store.plan.dra.mig is DraMig.DYNAMIC:
            nvml = self._context.parts.get(Driver).nvml
            assert nvml is not None
            self.side.manage_mig(MigControl(nvml, store))

    def tasks(self) -> Mapping[str, Task]:
        return self.side.tasks() if self.side is not None else {}

    async def close(self, seconds: float) -> None:
        if self.side is not None:
            await bounded(seconds, self.side.close())


def build(context: Context) -> Dra | None:
    """The DRA side, when DRA is on. Raises :class:`ConfigError` for credentials that cannot be
    loaded, naming the kubeconfig as given or the setting that needs them; when ``--dra-gpus``
    names GPUs, the error is said once they are checked (:class:`DraGpusCheck`)."""
    gpus = context.store.plan.dra.gpus
    if not gpus.enabled:
        return None
    settings = context.settings
    why = unusable(settings.kubeconfig)
    if why is None:
        return Dra(context)
    error = _credentials_error(settings, why)
    if not gpus.refs:
        raise error
    return Dra(context, error)


def _side(context: Context) -> DraSide:
    """Raises :class:`ConfigError` for credentials the client cannot load, named as in
    :func:`build`."""
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
        raise _credentials_error(settings, str(exc)) from exc


def _credentials_error(settings: Settings, why: str) -> ConfigError:
    """Credentials that cannot be loaded, said of the kubeconfig as given, else of the setting
    that needs them."""
    if settings.kubeconfig is not None:
        return ConfigError(settings.named("kubeconfig"), why)
    return ConfigError(settings.named("dra_gpus"), f"needs API server credentials: {why}")


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
