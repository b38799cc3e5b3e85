"""MIG devices made when a claim is prepared and destroyed when it is unprepared
(``--dra-mig dynamic``): the DRA side's rules over the driver's MIG operations.

* Making: the device's GPU is switched to MIG mode if it is not (a GPU that switches without a
  reset only; the agent remembers that it did), the GPU instance is made at the device's
  placement with its compute instance, and the GPU is described again until the MIG device is
  listed (its UUID, its ``/dev/nvidia-caps`` nodes).
* Removing: the instance is destroyed only when it is still the one made (same profile and
  placement); while processes run on it the driver answers IN_USE and the claim stays prepared.
  Once the GPU holds no instance and the agent switched its MIG mode on, it is switched off.
* After a restart: every instance on a GPU published partitionable that no prepared claim holds
  is destroyed (:meth:`DynamicMig.sweep`); an instance recorded in another boot holds nothing
  (a MIG device does not outlive a reboot: whatever is there now is someone else's).
* A claim prepared again (:meth:`DynamicMig.again`): its instance is checked against the
  driver; one gone (a reboot, a driver reload, destroyed behind the agent's back) is made again
  at its placement, or the claim is refused when another instance holds the placement.

Errors reach the claim as :class:`~gpuagent.domain.claims.ClaimError`, naming the driver's.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import replace
from typing import Protocol

import structlog

from gpuagent.domain.claims import ClaimError, MadeMig, PreparedDevice
from gpuagent.domain.devices import Gpu
from gpuagent.domain.dra import DraDevice
from gpuagent.domain.dynmig import Standing, made_standing, same_boot
from gpuagent.domain.migshapes import Instance, MigRefused, MigShape, Placement
from gpuagent.state.store import DeviceStore

__all__ = ["DynamicMig", "MigDriver"]

log = structlog.get_logger("gpuagent.dra")

#: Descriptions asked for after a creation before the MIG device must be listed.
LISTED_WITHIN = 20


class MigDriver(Protocol):
    """The driver's MIG operations (:class:`gpuagent.gpu.migcontrol.MigControl`), raising
    :class:`MigRefused`; ``rediscover`` describes a GPU again into the store."""

    async def mig_mode(self, index: int) -> bool: ...
    async def set_mig_mode(self, index: int, *, on: bool) -> None: ...
    async def make(self, index: int, shape: MigShape, placement: Placement) -> int: ...
    async def instances(self, index: int, shapes: tuple[MigShape, ...]) -> list[Instance]: ...
    async def destroy(self, index: int, gpu_instance_id: int) -> bool: ...
    async def rediscover(self, index: int) -> Gpu: ...
    def close(self) -> None: ...


class DynamicMig:
    """Makes and removes the MIG devices of claims; ``switched``: the GPUs (UUIDs) whose MIG mode
    the agent switched on, checkpointed with the claims by the caller; ``boot``: the kernel's
    boot ID (empty: unknown), recorded with each MIG device made."""

    def __init__(self, driver: MigDriver, store: DeviceStore) -> None:
        self._driver = driver
        self._store = store
        self.switched: frozenset[str] = frozenset()
        self.boot = ""

    def close(self) -> None:
        """Let the driver's MIG thread end (the agent is stopping)."""
        self._driver.close()

    def _gpu(self, uuid: str) -> Gpu:
        gpu = next((g for g in self._store.snapshot.gpus if g.uuid == uuid), None)
        if gpu is None:
            raise ClaimError(f"GPU {uuid} is not on this node")
        return gpu

    async def make(self, device: DraDevice) -> tuple[MadeMig, str]:
        """Make ``device``'s MIG device; the record and the MIG device's UUID."""
        shape, placement = device.shape, device.placement
        if shape is None or placement is None:
            raise ClaimError(f"device {device.name} is not made on prepare")
        gpu = self._gpu(device.gpu_uuid)
        try:
            await self._mig_mode_on(gpu)
            gi = await self._driver.make(gpu.index, shape, placement)
        except MigRefused as exc:
            raise ClaimError(f"device {device.name}: {_explained(exc)}") from None
        made = MadeMig(gpu.uuid, shape.profile_id, placement.start, gi, self.boot)
        for _ in range(LISTED_WITHIN):
            described = await self._driver.rediscover(gpu.index)
            listed = next((m for m in described.mig_devices if m.gpu_instance_id == gi), None)
            if listed is not None:
                log.info(
                    "mig device made",
                    device=device.name,
                    gpu=gpu.index,
                    gpu_instance=gi,
                    uuid=listed.uuid,
                )
                return made, listed.uuid
        await self.remove(made)
        raise ClaimError(f"device {device.name}: made, but the driver does not list it")

    async def ready(self, device: DraDevice) -> tuple[MadeMig | None, str]:
        """``device`` ready for its claim: its MIG device made if it is made on prepare, a
        partitionable GPU prepared whole out of MIG mode; ``(record of what was made, the UUID
        its CDI device is named by)``."""
        if device.made_on_prepare:
            return await self.make(device)
        if device.counter_set is not None:
            await self.whole(device)
        return None, device.uuid

    async def remove_all(self, devices: Iterable[PreparedDevice], *, undo: bool = False) -> None:
        """Destroy what was made for ``devices``; ``undo``: for a claim whose prepare failed
        (its error stands, a refusal is logged)."""
        for device in devices:
            if device.made is None:
                continue
            try:
                await self.remove(device.made)
            except ClaimError as exc:
                if not undo:
                    raise
                log.error("mig device of a failed prepare not destroyed", error=str(exc))

    async def whole(self, device: DraDevice) -> None:
        """A partitionable GPU prepared whole: out of MIG mode if the agent switched it on and
        it holds no instance (a switch back that failed before); else a GPU in MIG mode is
        refused, it cannot run a container whole."""
        gpu = self._gpu(device.gpu_uuid)
        if not gpu.mig_enabled:
            return
        if gpu.uuid in self.switched and not gpu.mig_devices:
            await self._mig_mode_back(gpu)
            if gpu.uuid not in self.switched:
                await self._rediscover(gpu.index)
                return
        raise ClaimError(f"device {device.name}: GPU {gpu.index} is in MIG mode")

    async def _mig_mode_on(self, gpu: Gpu) -> None:
        if await self._driver.mig_mode(gpu.index):
            return
        if gpu.mig_partitions is None or not gpu.mig_partitions.toggles:
            raise MigRefused(f"GPU {gpu.index} is not in MIG mode and switching takes a GPU reset")
        await self._driver.set_mig_mode(gpu.index, on=True)
        self.switched = self.switched | {gpu.uuid}
        log.info("mig mode switched on", gpu=gpu.index)

    async def remove(self, made: MadeMig) -> None:
        """Destroy the MIG device ``made`` (nothing if it is gone), then switch MIG mode off
        where the agent switched it on and the GPU is empty; raises :class:`ClaimError`. A GPU
        the node no longer has holds nothing to destroy."""
        gpu = next((g for g in self._store.snapshot.gpus if g.uuid == made.gpu_uuid), None)
        if gpu is None:
            log.warning(
                "mig device's gpu is gone; nothing to destroy",
                gpu=made.gpu_uuid,
                gpu_instance=made.gpu_instance_id,
            )
            return
        shapes = () if gpu.mig_partitions is None else gpu.mig_partitions.shapes
        try:
            found = await self._driver.instances(gpu.index, shapes)
            # One made in another boot is gone: an instance of its ID now is someone else's.
            mine = same_boot(made, self.boot) and any(
                i.gpu_instance_id == made.gpu_instance_id
                and i.profile_id == made.profile_id
                and i.placement.start == made.start
                for i in found
            )
            if mine:
                await self._driver.destroy(gpu.index, made.gpu_instance_id)
                found = [i for i in found if i.gpu_instance_id != made.gpu_instance_id]
                log.info("mig device destroyed", gpu=gpu.index, gpu_instance=made.gpu_instance_id)
            if not found:
                await self._mig_mode_back(gpu)
        except MigRefused as exc:
            raise ClaimError(
                f"MIG device of GPU {gpu.index}, GPU instance {made.gpu_instance_id}: "
                f"{_explained(exc)}"
            ) from None
        finally:
            await self._rediscover(gpu.index)

    async def _mig_mode_back(self, gpu: Gpu) -> None:
        if gpu.uuid not in self.switched:
            return
        try:
            await self._driver.set_mig_mode(gpu.index, on=False)
        except MigRefused as exc:  # tried again when the GPU is next left empty
            log.warning("mig mode not switched back off", gpu=gpu.index, error=str(exc))
            return
        self.switched = self.switched - {gpu.uuid}
        log.info("mig mode switched back off", gpu=gpu.index)

    async def _rediscover(self, index: int) -> None:
        try:
            await self._driver.rediscover(index)
        except MigRefused as exc:
            log.warning("gpu not described again after a mig change", gpu=index, error=str(exc))

    async def sweep(self, devices: Iterable[DraDevice], kept: Collection[MadeMig]) -> int:
        """Destroy every instance on the GPUs of ``devices`` (those published partitionable) that
        is not ``kept`` (one recorded in another boot keeps nothing); switch MIG mode back where
        the agent switched it and no prepared claim has a MIG device on the GPU (one to be made
        again keeps it). The instances destroyed; an instance the driver refuses is logged and
        left."""
        holding = {(m.gpu_uuid, m.gpu_instance_id) for m in kept if same_boot(m, self.boot)}
        claimed = {m.gpu_uuid for m in kept}
        gpus = {d.gpu_uuid for d in devices if d.made_on_prepare}
        removed = 0
        for uuid in sorted(gpus):
            gpu = self._gpu(uuid)  # published: so in the snapshot
            shapes = () if gpu.mig_partitions is None else gpu.mig_partitions.shapes
            try:
                found = await self._driver.instances(gpu.index, shapes)
                for instance in found:
                    if (uuid, instance.gpu_instance_id) in holding:
                        continue
                    await self._driver.destroy(gpu.index, instance.gpu_instance_id)
                    removed += 1
                    log.warning(
                        "orphaned mig device destroyed: no prepared claim holds it",
                        gpu=gpu.index,
                        gpu_instance=instance.gpu_instance_id,
                        profile_id=instance.profile_id,
                        start=instance.placement.start,
                    )
                if uuid not in claimed:
                    await self._mig_mode_back(gpu)
            except (MigRefused, ClaimError) as exc:
                log.error("orphaned mig devices not removed", gpu=gpu.index, error=str(exc))
            await self._rediscover(gpu.index)
        return removed

    async def again(self, device: PreparedDevice, current: DraDevice | None) -> PreparedDevice:
        """``device`` (made on prepare) of a claim prepared again: itself while its MIG device is
        there; else made again at its placement (``current``: the device published under its
        name now), its record and UUID the new ones. Raises :class:`ClaimError` when it cannot
        be: another instance holds the placement, the device is no longer offered, the driver
        refuses."""
        made = device.made
        if made is None:
            return device
        gpu = self._gpu(made.gpu_uuid)
        shapes = () if gpu.mig_partitions is None else gpu.mig_partitions.shapes
        try:
            found = await self._driver.instances(gpu.index, shapes)
        except MigRefused as exc:
            raise ClaimError(f"device {device.device}: {_explained(exc)}") from None
        placement = current.placement if current is not None else None
        standing, blocker = made_standing(made, found, boot=self.boot, placement=placement)
        if standing is Standing.HELD:
            return device
        if blocker is not None:
            raise ClaimError(
                f"device {device.device}: its MIG device (GPU instance {made.gpu_instance_id}) "
                f"is gone and its placement is taken by GPU instance {blocker.gpu_instance_id} "
                f"(profile {blocker.profile_id} at memory slice {blocker.placement.start}); "
                "it is not made again — allocate the claim anew (delete its pod)"
            )
        if current is None or not current.made_on_prepare:
            raise ClaimError(
                f"device {device.device}: its MIG device is gone, and this node no longer "
                "offers the device to make it again"
            )
        log.warning(
            "mig device of a prepared claim gone; making it again",
            device=device.device,
            gpu=gpu.index,
            gpu_instance=made.gpu_instance_id,
            made_in_this_boot=bool(made.boot) and made.boot == self.boot,
        )
        record, uuid = await self.make(current)
        return replace(device, made=record, uuid=uuid)


def _explained(exc: MigRefused) -> str:
    """The driver's refusal, with what it means for the claim."""
    meaning = _MEANINGS.get(exc.reason)
    return str(exc) if meaning is None else f"{exc}: {meaning}"


#: What a refusal of the driver's (nvml.h's error name) means for a claim.
_MEANINGS = {
    "INSUFFICIENT_RESOURCES": (
        "the placement overlaps a MIG device already made (or the GPU is full)"
    ),
    "IN_USE": "processes still run on it; it is destroyed once they have exited",
    "NO_PERMISSION": "making MIG devices needs CAP_SYS_ADMIN",
}
