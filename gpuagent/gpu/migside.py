"""The NVML backend's MIG side: each GPU's MIG devices read (their handles kept for their
telemetry) and, with MIG made on demand, the GPU's MIG shapes and GPU-instance profile table,
read once per GPU (a GPU described again after a MIG device was made offers the same).

Thread-safe; every method that reads blocks, and raises :class:`pynvml.NVMLError` as
:func:`~gpuagent.gpu.mig.read_mig_with_total` does.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from gpuagent.domain.migshapes import MigPartitions
from gpuagent.gpu.calls import NvmlCalls
from gpuagent.gpu.mig import MigReading, read_mig_with_total
from gpuagent.gpu.migmake import read_shapes

__all__ = ["MigSide"]

MigHandles = tuple[tuple[str, int, Any], ...]  # (UUID, GPU-instance ID, handle)


class MigSide:
    """``shapes``: read the MIG shapes of MIG-capable GPUs (``--dra-mig dynamic``)."""

    def __init__(self, calls: NvmlCalls, mig_minors: Path, *, shapes: bool) -> None:
        self._calls = calls
        self._mig_minors = mig_minors
        self.reads_shapes = shapes
        self._lock = threading.Lock()
        self._shapes: dict[int, tuple[str, MigPartitions]] = {}  # by index: (UUID, shapes)
        self._profiles: dict[int, dict[int, tuple[int, Any]]] = {}
        self._handles: dict[int, MigHandles] = {}

    def named(self, index: int, uuid: str, before: str | None) -> None:
        """GPU ``index`` is ``uuid`` (was ``before``): another GPU's tables are not kept."""
        if uuid != before:
            with self._lock:
                self._profiles.pop(index, None)
                self._shapes.pop(index, None)

    def read(self, index: int, handle: Any, minor: int, total: int | None) -> MigReading:
        """The GPU's MIG mode and devices (see :func:`read_mig_with_total`)."""
        found: dict[str, Any] = {}
        with self._lock:
            profiles = self._profiles.setdefault(index, {})
        mig = read_mig_with_total(
            index,
            handle,
            minor,
            calls=self._calls,
            mig_minors=self._mig_minors,
            total_memory_bytes=total,
            handles=found,
            profiles=profiles if self.reads_shapes else None,
        )
        with self._lock:
            self._handles[index] = tuple(
                (m.uuid, m.gpu_instance_id, found[m.uuid]) for m in mig.devices if m.uuid in found
            )
        return mig

    def handles(self, index: int) -> MigHandles:
        """The GPU's MIG devices' handles as last read."""
        with self._lock:
            return self._handles.get(index, ())

    def shapes(
        self, index: int, handle: Any, uuid: str, total: int, architecture: int | None
    ) -> MigPartitions | None:
        """The MIG shapes GPU ``index`` offers, read once; ``None`` unless shapes are read."""
        if not self.reads_shapes:
            return None
        with self._lock:
            known = self._shapes.get(index)
        if known is not None and known[0] == uuid:
            return known[1]
        shapes = read_shapes(index, handle, self._calls, total, architecture)
        if shapes is not None:
            with self._lock:
                self._shapes[index] = (uuid, shapes)
        return shapes
