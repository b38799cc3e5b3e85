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

__all__ = ["described_devices"]


def described_devices(snapshot: Snapshot) -> object:
    """What the files depend on: the driver and each device as described (so a GPU described
    after an undescribed start counts), not health, readings or history (a MIG device's
    telemetry changes every poll)."""
    return (
        snapshot.driver.version,
        snapshot.driver.cuda_version,
        tuple(_described(g) for g in snapshot.gpus),
    )


def _described(gpu: Gpu) -> Gpu:
    migs = tuple(replace(m, telemetry=Telemetry(), health=GpuHealth()) for m in gpu.mig_devices)
    return replace(
        gpu,
        health=GpuHealth(),
        telemetry=Telemetry(),
        xid_counts=_NO_XIDS,
        last_xid=None,
        processes=None,
        mig_devices=migs,
    )


_NO_XIDS: Mapping[int, int] = MappingProxyType({})
