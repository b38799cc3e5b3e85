"""The rules of MIG made on demand (dra/dynamic.py) over a driver stand-in: what is destroyed,
what is kept, when MIG mode goes back off, and what a claim is told."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from support.nodes import gpu, mig, mig_shapes, node

from gpuagent.domain.claims import ClaimError, ClaimRef, MadeMig, PreparedClaim, PreparedDevice
from gpuagent.domain.devices import Gpu
from gpuagent.domain.dra import DraDevice, DraGpus, DraMig, dra_devices
from gpuagent.domain.migshapes import Instance, MigRefused, MigShape, Placement
from gpuagent.dra.claims import ClaimFiles
from gpuagent.dra.dynamic import DynamicMig
from gpuagent.dra.service import ClaimPreparer, DraConfig
from gpuagent.state.store import DeviceStore

SHAPES = mig_shapes()
ONE_G = next(s for s in SHAPES.shapes if s.name == "1g.10gb")


class Driver:
    """A GPU's instances as a driver keeps them; ``refuse``: an operation's NVML error name."""

    def __init__(self, store: DeviceStore, instances: list[Instance], *, mode: bool) -> None:
        self.store = store
        self.found = instances
        self.mode = mode
        self.refuse: dict[str, str] = {}
        self.calls: list[str] = []

    def _check(self, what: str) -> None:
        self.calls.append(what)
        if what in self.refuse:
            raise MigRefused(f"{what}: {self.refuse[what]}", self.refuse[what])

    async def mig_mode(self, index: int) -> bool:
        return self.mode

    async def set_mig_mode(self, index: int, *, on: bool) -> None:
        self._check("mode on" if on else "mode off")
        self.mode = on

    async def make(self, index: int, shape: MigShape, placement: Placement) -> int:
        self._check("make")
        gi = 1 + max((i.gpu_instance_id for i in self.found), default=0)
        self.found.append(Instance(gi, shape.profile_id, placement, computed=True))
        return gi

    async def instances(self, index: int, shapes: tuple[MigShape, ...]) -> list[Instance]:
        return list(self.found)

    async def destroy(self, index: int, gpu_instance_id: int) -> bool:
        self._check(f"destroy {gpu_instance_id}")
        self.found = [i for i in self.found if i.gpu_instance_id != gpu_instance_id]
        return True

    def close(self) -> None:
        self.calls.append("close")

    async def rediscover(self, index: int) -> Gpu:
        migs = [mig(index, i.gpu_instance_id) for i in self.found]
        described = replace(gpu(index, migs=migs, mig_enabled=self.mode), mig_partitions=SHAPES)
        self.store.update(lambda s: replace(s, gpus=(described,)))
        return described


def setup(instances: list[Instance], *, mode: bool) -> tuple[DynamicMig, Driver, DeviceStore]:
    store = DeviceStore(node(replace(gpu(0, mig_enabled=mode), mig_partitions=SHAPES)))
    driver = Driver(store, instances, mode=mode)
    return DynamicMig(driver, store), driver, store


def partition(store: DeviceStore, name: str) -> DraDevice:
    devices = dra_devices(store.snapshot, DraGpus(all=True), mig=DraMig.DYNAMIC)
    return next(d for d in devices if d.name == name)


async def test_made_then_removed_switches_mig_mode_back_only_if_the_agent_switched_it() -> None:
    dynamic, driver, store = setup([], mode=False)
    made, uuid = await dynamic.make(partition(store, "gpu-0-mig-1g10gb-19-3"))
    assert made == MadeMig(store.snapshot.gpus[0].uuid, 19, 3, 1)
    assert uuid == mig(0, 1).uuid
    assert dynamic.switched == {store.snapshot.gpus[0].uuid}
    await dynamic.remove(made)
    assert driver.calls == ["mode on", "make", "destroy 1", "mode off"]
    assert dynamic.switched == frozenset()
    # Already on when the agent came: left on.
    dynamic, driver, store = setup([], mode=True)
    made, _ = await dynamic.make(partition(store, "gpu-0-mig-1g10gb-19-3"))
    await dynamic.remove(made)
    assert driver.calls == ["make", "destroy 1"]
    assert driver.mode


async def test_an_instance_not_the_one_made_is_not_destroyed() -> None:
    other = Instance(1, 9, Placement(0, 4), computed=True)  # a 3g.40gb where ID 1 was a 1g
    dynamic, driver, store = setup([other], mode=True)
    await dynamic.remove(MadeMig(store.snapshot.gpus[0].uuid, 19, 3, 1))
    assert driver.found == [other]
    assert not [c for c in driver.calls if c.startswith("destroy")]


async def test_refusals_reach_the_claim_named_and_a_failed_switch_back_is_kept_for_later() -> None:
    dynamic, driver, store = setup([], mode=False)
    made, _ = await dynamic.make(partition(store, "gpu-0-mig-1g10gb-19-3"))
    driver.refuse["destroy 1"] = "IN_USE"
    with pytest.raises(ClaimError, match="IN_USE: processes still run on it"):
        await dynamic.remove(made)
    del driver.refuse["destroy 1"]
    driver.refuse["mode off"] = "IN_USE"
    await dynamic.remove(made)  # destroyed; the switch back waits for the next empty GPU
    assert driver.found == []
    assert dynamic.switched == {store.snapshot.gpus[0].uuid}
    driver.refuse["make"] = "INSUFFICIENT_RESOURCES"
    with pytest.raises(ClaimError, match="gpu-0-mig-1g10gb-19-3: make: INSUFFICIENT_RESOURCES: "):
        await dynamic.make(partition(store, "gpu-0-mig-1g10gb-19-3"))


async def test_a_gone_gpu_holds_nothing_to_destroy() -> None:
    dynamic, driver, _ = setup([], mode=True)
    await dynamic.remove(MadeMig("GPU-not-here", 19, 3, 1))
    assert driver.calls == []


async def test_the_sweep_destroys_what_no_claim_holds() -> None:
    kept = Instance(2, 19, Placement(3, 1), computed=True)
    orphan = Instance(5, 19, Placement(5, 1), computed=False)
    dynamic, driver, store = setup([kept, orphan], mode=True)
    uuid = store.snapshot.gpus[0].uuid
    dynamic.switched = frozenset({uuid})
    devices = dra_devices(store.snapshot, DraGpus(all=True), mig=DraMig.DYNAMIC)
    assert await dynamic.sweep(devices, [MadeMig(uuid, 19, 3, 2)]) == 1
    assert driver.found == [kept]
    assert driver.mode  # a claim still holds an instance
    assert await dynamic.sweep(devices, []) == 1
    assert driver.found == []
    assert not driver.mode


async def test_a_restored_claim_is_answered_while_the_driver_is_not_up(tmp_path: Path) -> None:
    """The start-up sweep waits for the GPUs to be described without holding the claims: a
    claim prepared before the restart (with no MIG device made for it) is answered from the
    checkpoint once it has waited ``settle_s`` for them (here none at all)."""
    store = DeviceStore()  # the driver never comes up: no snapshot is ever discovered
    driver = "gpu.nvidia.com"
    files = ClaimFiles(tmp_path / "state", tmp_path / "cdi", driver)
    ref = ClaimRef("default", "claim", "uid-1")
    claim = PreparedClaim(ref, (PreparedDevice(("gpu",), "node-1", "gpu-0", ("x",), "GPU-0"),))
    made_ref = ClaimRef("default", "made", "uid-2")
    made = PreparedClaim(made_ref, (prepared_at(MadeMig("GPU-0", 19, 3, 1)),))
    files.save_claim(claim)
    files.save_claim(made)

    async def unreadable(namespace: str, name: str) -> dict[str, Any]:
        raise AssertionError("a restored claim is not read again")

    preparer = ClaimPreparer(
        store,
        lambda s: (),
        unreadable,
        files,
        DraConfig(driver=driver, pool="node-1"),
        node_spec=lambda s: None,
        settle_s=0.0,
    )
    await preparer.load()
    preparer.mig = DynamicMig(Driver(store, [], mode=False), store)
    sweeping = asyncio.create_task(preparer.sweep())
    try:
        assert await asyncio.wait_for(preparer.prepare(ref), timeout=30) == claim
        # A MIG device made for a claim may be gone: refused until it can be checked.
        with pytest.raises(ClaimError, match="GPUs are not described yet"):
            await asyncio.wait_for(preparer.prepare(made_ref), timeout=30)
        assert not sweeping.done()  # still waiting for the GPUs
    finally:
        sweeping.cancel()
        await asyncio.gather(sweeping, return_exceptions=True)


def prepared_at(made: MadeMig, name: str = "gpu-0-mig-1g10gb-19-3") -> PreparedDevice:
    return PreparedDevice(("m",), "node-1", name, ("x",), mig(0, made.gpu_instance_id).uuid, made)


async def test_a_mig_device_of_a_claim_prepared_again_is_kept_made_again_or_refused() -> None:
    dynamic, driver, store = setup([], mode=False)
    dynamic.boot = "boot-2"
    uuid = store.snapshot.gpus[0].uuid
    small = partition(store, "gpu-0-mig-1g10gb-19-3")
    # Made in boot 1, gone in boot 2: made again at its placement, in this boot.
    before = prepared_at(MadeMig(uuid, 19, 3, 4, boot="boot-1"))
    again = await dynamic.again(before, small)
    assert driver.calls == ["mode on", "make"]
    assert again.made == MadeMig(uuid, 19, 3, 1, boot="boot-2")
    assert again.uuid == mig(0, 1).uuid
    assert (again.requests, again.device, again.cdi_ids) == (
        before.requests,
        before.device,
        before.cdi_ids,
    )
    # There now: kept, nothing made.
    assert await dynamic.again(again, small) is again
    assert driver.calls == ["mode on", "make"]
    # Its placement taken by a 2g.20gb (slices 2-3): refused, naming what holds it.
    driver.found = [Instance(3, 14, Placement(2, 2), computed=True)]
    with pytest.raises(ClaimError, match=r"placement is taken by GPU instance 3 \(profile 14"):
        await dynamic.again(again, small)
    # No longer offered (the GPU's shapes unreadable): refused.
    driver.found = []
    with pytest.raises(ClaimError, match="no longer offers the device"):
        await dynamic.again(again, None)
    assert driver.calls == ["mode on", "make"]


async def test_an_instance_recorded_in_another_boot_is_neither_destroyed_nor_kept() -> None:
    stranger = Instance(1, 19, Placement(3, 1), computed=True)  # made since, by someone else
    dynamic, driver, store = setup([stranger], mode=True)
    dynamic.boot = "boot-2"
    uuid = store.snapshot.gpus[0].uuid
    stale = MadeMig(uuid, 19, 3, 1, boot="boot-1")
    await dynamic.remove(stale)
    assert driver.found == [stranger]
    dynamic.switched = frozenset({uuid})
    devices = dra_devices(store.snapshot, DraGpus(all=True), mig=DraMig.DYNAMIC)
    assert await dynamic.sweep(devices, [stale]) == 1
    assert driver.found == []
    # MIG mode stays on: the claim's device is made again at its next prepare.
    assert driver.mode
    assert dynamic.switched == {uuid}
