"""What the node's files are written from: the devices as described, nothing that changes by
itself.

The CDI spec and the feature file (and DRA's claim specs, built from the node's spec) depend on
the driver and on each device's description; a keeper writes again only when
:func:`described_devices` changes, never for health, readings or history.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from types import MappingProxyType

from gpuagent.domain.devices import Gpu, GpuHealth, Telemetry
from gpuagent.domain.snapshot import Snapshot

__all__ = ["DescribedDevices", "described_devices"]


def described_devices(snapshot: Snapshot) -> object:
    """What the files depend on: the driver and each device as described (so a GPU described
    after an undescribed start counts), not health, readings or history (a MIG device's
    telemetry changes every poll)."""
    return (
        snapshot.driver.version,
        snapshot.driver.cuda_version,
        tuple(_described(g) for g in snapshot.gpus),
    )


class DescribedDevices:
    """:func:`described_devices` for a watch's projection, which runs on every store version: a
    GPU still the same object as at the last call is not described again (a poll stores one
    GPU's readings at a time, so the others are), and equal descriptions compare by identity."""

    def __init__(self) -> None:
        self._last: dict[int, tuple[Gpu, Gpu]] = {}

    def __call__(self, snapshot: Snapshot) -> object:
        last, seen = self._last, {}
        devices = []
        for gpu in snapshot.gpus:
            hit = last.get(id(gpu))  # (held, so its id is not another object's)
            described = hit[1] if hit is not None and hit[0] is gpu else _described(gpu)
            seen[id(gpu)] = (gpu, described)
            devices.append(described)
        self._last = seen
        return (snapshot.driver.version, snapshot.driver.cuda_version, tuple(devices))


def _described(gpu: Gpu) -> Gpu:
    migs = tuple(replace(m, telemetry=_NO_TELEMETRY, health=_HEALTHY) for m in gpu.mig_devices)
    return replace(
        gpu,
        health=_HEALTHY,
        telemetry=_NO_TELEMETRY,
        xid_counts=_NO_XIDS,
        last_xid=None,
        processes=None,
        mig_devices=migs,
    )


_NO_XIDS: Mapping[int, int] = MappingProxyType({})
_NO_TELEMETRY = Telemetry()
_HEALTHY = GpuHealth()
