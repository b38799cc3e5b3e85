"""GPUs' compute modes, set for MPS sharing through NVML, off the event loop.

NVIDIA's MPS control daemon sets each shared GPU to EXCLUSIVE_PROCESS before it starts (with
``nvidia-smi -c``, which calls ``nvmlDeviceSetComputeMode``) and back to DEFAULT when it stops.
This sets it through NVML directly, on a thread of its own (``nvml-mps``), and gives back the mode
the GPU had, so it is restored as it was rather than to DEFAULT. A GPU that does not offer it
(NOT_SUPPORTED) answers ``None``; any other error is raised as :class:`ComputeModeError`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import pynvml

from gpuagent.domain.migshapes import MigRefused
from gpuagent.gpu.calls import ABSENT, NvmlCalls, describe
from gpuagent.gpu.workers import Worker

__all__ = ["ComputeModeError", "ComputeModes", "mode_name"]

T = TypeVar("T")

EXCLUSIVE_PROCESS = int(pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS)
_NAMES = {
    int(pynvml.NVML_COMPUTEMODE_DEFAULT): "DEFAULT",
    int(pynvml.NVML_COMPUTEMODE_EXCLUSIVE_THREAD): "EXCLUSIVE_THREAD",
    EXCLUSIVE_PROCESS: "EXCLUSIVE_PROCESS",
    int(pynvml.NVML_COMPUTEMODE_PROHIBITED): "PROHIBITED",
}


class _NoComputeMode(Exception):
    """The GPU has no compute mode to read or set (the driver answered NOT_SUPPORTED or alike)."""


class ComputeModeError(Exception):
    """The driver refused to read or set a compute mode; the message says which GPU and why."""


class HandleBackend(Protocol):
    """What setting a compute mode needs of the driver (:class:`gpuagent.gpu.nvml.Nvml`)."""

    @property
    def calls(self) -> NvmlCalls: ...
    def mig_handle(self, index: int) -> Any: ...


def mode_name(mode: int) -> str:
    return _NAMES.get(mode, str(mode))


class ComputeModes:
    """Sets GPUs to EXCLUSIVE_PROCESS and back (see the module's doc)."""

    def __init__(self, backend: HandleBackend) -> None:
        self._backend = backend
        self._worker: Worker | None = None  # started at the first use (most nodes have none)

    async def exclusive(self, index: int) -> int | None:
        """Set GPU ``index`` to EXCLUSIVE_PROCESS; returns the mode it had (``None``: the GPU
        has no compute mode to set)."""
        return await self._run(lambda: self._exclusive(index))

    async def restore(self, index: int, mode: int) -> None:
        """Set GPU ``index`` back to ``mode``."""
        await self._run(lambda: self._set(index, mode))

    def close(self) -> None:
        if self._worker is not None:
            self._worker.close()
            self._worker = None

    def _run(self, fn: Callable[[], T]) -> asyncio.Future[T]:
        if self._worker is None:
            self._worker = Worker("nvml-mps")
        return self._worker.submit(fn)

    def _exclusive(self, index: int) -> int | None:
        try:
            had = int(self._call(index, pynvml.nvmlDeviceGetComputeMode))
            if had != EXCLUSIVE_PROCESS:
                # A GPU that reads its mode may still refuse to set it (NOT_SUPPORTED on a
                # MIG-enabled GPU): then it was not set, and nothing is to be restored.
                self._call(index, pynvml.nvmlDeviceSetComputeMode, EXCLUSIVE_PROCESS)
        except _NoComputeMode:
            return None
        return had

    def _set(self, index: int, mode: int) -> None:
        with contextlib.suppress(_NoComputeMode):
            self._call(index, pynvml.nvmlDeviceSetComputeMode, mode)

    def _call(self, index: int, fn: Callable[..., T], *args: Any) -> T:
        """``fn`` on GPU ``index``'s handle; raises :class:`_NoComputeMode` where the GPU has none
        to read or set (NOT_SUPPORTED and the like), :class:`ComputeModeError` on any other
        error."""
        try:
            handle = self._backend.mig_handle(index)
            return self._backend.calls.call(index, fn, handle, *args)
        except pynvml.NVMLError as exc:
            if exc.value in ABSENT:
                raise _NoComputeMode from None
            raise ComputeModeError(f"GPU {index}: {describe(exc)}") from exc
        except MigRefused as exc:  # the GPU is not described (yet)
            raise ComputeModeError(f"GPU {index}: {exc}") from exc
