"""MIG made and removed for the DRA side (``--dra-mig dynamic``), off the event loop.

Every driver call runs on one thread of its own (``nvml-mig``): a creation takes hundreds of
milliseconds, and the poller's threads go on probing meanwhile. After a change the GPU's MIG
devices are read again on that thread (not the whole GPU) and the GPU is taken into the store at
once, keeping what events recorded as the poller does; so ``/metrics``, health, accounting and
the CDI spec know the new MIG device — or forget the removed one — before the claim's answer
goes back.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, Protocol, TypeVar

from gpuagent.domain.devices import Gpu
from gpuagent.domain.migshapes import Instance, MigShape, Placement
from gpuagent.gpu import migmake
from gpuagent.gpu.calls import NvmlCalls
from gpuagent.gpu.readings import merge_description
from gpuagent.gpu.workers import Worker
from gpuagent.state.store import DeviceStore

__all__ = ["MigBackend", "MigControl"]

T = TypeVar("T")


class MigBackend(Protocol):
    """What MIG management needs of the driver (:class:`gpuagent.gpu.nvml.Nvml`); blocking,
    raising :class:`~gpuagent.domain.migshapes.MigRefused`."""

    @property
    def calls(self) -> NvmlCalls: ...
    def mig_handle(self, index: int) -> Any: ...
    def describe_mig(self, index: int) -> Gpu: ...


class MigControl:
    """The driver's MIG operations as coroutines (see :class:`gpuagent.dra.dynamic.MigDriver`),
    each GPU described again after a change."""

    def __init__(self, backend: MigBackend, store: DeviceStore) -> None:
        self._backend = backend
        self._store = store
        self._worker = Worker("nvml-mig")

    async def _run(self, fn: Callable[[], T]) -> T:
        return await self._worker.submit(fn)

    async def _on(self, index: int, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        """``fn(index, GPU index's handle, calls, *args)`` on the MIG thread."""
        backend = self._backend
        return await self._run(
            lambda: fn(index, backend.mig_handle(index), backend.calls, *args, **kw)
        )

    async def mig_mode(self, index: int) -> bool:
        return await self._on(index, migmake.mig_mode)

    async def set_mig_mode(self, index: int, *, on: bool) -> None:
        await self._on(index, migmake.set_mig_mode, on=on)

    async def make(self, index: int, shape: MigShape, placement: Placement) -> int:
        return await self._on(index, migmake.make_instance, shape, placement)

    async def instances(self, index: int, shapes: tuple[MigShape, ...]) -> list[Instance]:
        return await self._on(index, migmake.instances, shapes)

    async def destroy(self, index: int, gpu_instance_id: int) -> bool:
        return await self._on(index, migmake.destroy_instance, gpu_instance_id)

    async def rediscover(self, index: int) -> Gpu:
        """Read GPU ``index``'s MIG devices again and take it into the store."""
        gpu = await self._run(partial(self._backend.describe_mig, index))
        self._store.update(lambda s: merge_description(s, gpu))
        return gpu

    def close(self) -> None:
        self._worker.close()
