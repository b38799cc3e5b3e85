"""MIG made and removed for the DRA side (``--dra-mig dynamic``), off the event loop.

Every driver call runs on one thread of its own (``nvml-mig``): a creation takes hundreds of
milliseconds, and the poller's threads go on probing meanwhile. After a change the GPU's MIG
devices are read again on that thread (not the whole GPU) and the GPU is taken into the store at
once (:meth:`GpuMonitor.rediscovered`), so ``/metrics``, health, accounting and the CDI spec know
the new MIG device — or forget the removed one — before the claim's answer goes back.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Protocol, TypeVar

from gpuagent.domain.devices import Gpu
from gpuagent.domain.migshapes import Instance, MigShape, Placement
from gpuagent.gpu.workers import Worker

__all__ = ["MigBackend", "MigControl"]

T = TypeVar("T")


class MigBackend(Protocol):
    """What MIG management needs of the driver (:class:`gpuagent.gpu.nvml.Nvml`); blocking,
    raising :class:`~gpuagent.domain.migshapes.MigRefused`."""

    def describe_mig(self, index: int) -> Gpu: ...
    def mig_mode(self, index: int) -> bool: ...
    def set_mig_mode(self, index: int, *, on: bool) -> None: ...
    def make_mig(self, index: int, shape: MigShape, placement: Placement) -> int: ...
    def mig_instances(self, index: int, shapes: tuple[MigShape, ...]) -> list[Instance]: ...
    def destroy_mig(self, index: int, gpu_instance_id: int) -> bool: ...


class Rediscovered(Protocol):
    def rediscovered(self, gpu: Gpu) -> None: ...


class MigControl:
    """The driver's MIG operations as coroutines (see :class:`gpuagent.dra.dynamic.MigDriver`),
    each GPU described again after a change."""

    def __init__(self, backend: MigBackend, monitor: Rediscovered) -> None:
        self._backend = backend
        self._monitor = monitor
        self._worker = Worker("nvml-mig")

    async def _run(self, fn: Callable[[], T]) -> T:
        return await self._worker.submit(fn)

    async def mig_mode(self, index: int) -> bool:
        return await self._run(partial(self._backend.mig_mode, index))

    async def set_mig_mode(self, index: int, *, on: bool) -> None:
        await self._run(partial(self._backend.set_mig_mode, index, on=on))

    async def make(self, index: int, shape: MigShape, placement: Placement) -> int:
        return await self._run(partial(self._backend.make_mig, index, shape, placement))

    async def instances(self, index: int, shapes: tuple[MigShape, ...]) -> list[Instance]:
        return await self._run(partial(self._backend.mig_instances, index, shapes))

    async def destroy(self, index: int, gpu_instance_id: int) -> bool:
        return await self._run(partial(self._backend.destroy_mig, index, gpu_instance_id))

    async def rediscover(self, index: int) -> Gpu:
        """Read GPU ``index``'s MIG devices again and take it into the store."""
        gpu = await self._run(partial(self._backend.describe_mig, index))
        self._monitor.rediscovered(gpu)
        return gpu

    def close(self) -> None:
        self._worker.close()
