"""The node's DRA devices as served under ``--dra-sharing mps``, and the MPS daemons they need.

Each whole GPU served through DRA (not a MIG device, not a GPU published partitionable) is
shared: published with ``allowMultipleAllocations`` and its consumable capacities
(:mod:`gpuagent.domain.drashare`), and kept by an MPS control daemon of its own
(:func:`share_daemons`). While that daemon is not up as planned, the GPU's device is unhealthy
(the kubelet's health stream says why); once its keeper has said the daemon is down (it exited,
or could not be started: not merely starting), the device is also tainted ``<driver>/mps-daemon``
(``NoSchedule``), so no new claim lands on a GPU whose shares cannot be held. Pure.
"""

from __future__ import annotations

from dataclasses import replace

from gpuagent.domain.devices import NodeState
from gpuagent.domain.dra import (
    MAX_TAINTS,
    DraDevice,
    DraMig,
    DraPlan,
    Effect,
    Taint,
    gpu_device_name,
)
from gpuagent.domain.drashare import DraSharing, share_daemon
from gpuagent.domain.mps import MpsDaemon, MpsState, daemon_reason

__all__ = ["DAEMON_TAINT", "served_devices", "share_daemons"]

#: The taint (after the driver's name) of a shared GPU whose MPS control daemon is down.
DAEMON_TAINT = "mps-daemon"


def served_devices(snapshot: NodeState, plan: DraPlan) -> tuple[DraDevice, ...]:
    """``plan``'s DRA devices of ``snapshot``, the whole GPUs shared where ``plan`` shares them
    (health and taints following each GPU's MPS daemon)."""
    devices = plan.devices(snapshot)
    if plan.sharing is not DraSharing.MPS:
        return devices
    return tuple(_served(d, snapshot.mps, plan.driver) for d in devices)


def _served(device: DraDevice, state: MpsState, driver: str) -> DraDevice:
    if device.kind != "gpu" or device.counter_set is not None:
        return device
    shared = replace(device, shared=True)
    daemon = share_daemon(driver, device.name, device.gpu_index, device.gpu_uuid)
    reason = daemon_reason(daemon, state)
    if reason is None:
        return shared
    taints = device.taints
    if state.status(daemon.name) is not None:  # said to be down, not merely starting
        down = Taint(key=f"{driver}/{DAEMON_TAINT}", value="", effect=Effect.NO_SCHEDULE)
        taints = (*taints, down)[:MAX_TAINTS]
    said = f"{device.reason}; {reason}" if device.reason else reason
    return replace(shared, healthy=False, reason=said, taints=taints)


def share_daemons(snapshot: NodeState, plan: DraPlan) -> tuple[MpsDaemon, ...]:
    """The MPS control daemons ``plan``'s shared GPUs of ``snapshot`` need, one per GPU, by
    index (read off the GPUs, without building the devices: the daemons' keeper asks on every
    change of the node's state)."""
    if plan.sharing is not DraSharing.MPS or plan.mig is DraMig.DYNAMIC:
        return ()
    return tuple(
        share_daemon(plan.driver, gpu_device_name(gpu), gpu.index, gpu.uuid)
        for gpu in sorted(snapshot.gpus, key=lambda g: g.index)
        if gpu.uuid and not gpu.mig_enabled and plan.gpus.owns(gpu)
    )
