"""The NVML backend's MIG management (gpu/migmake.py) on the simulated driver: the shapes a GPU
offers, instances made at a placement and found again with their placement, the driver's
refusals named, and a re-description keeping what events recorded on an instance."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any, TypeVar

import pytest
from support.clock import Sleeps
from support.simnvml import Run

from gpuagent.domain.devices import Condition, GpuHealth
from gpuagent.domain.migshapes import Instance, MigRefused, MigShape, Placement
from gpuagent.domain.snapshot import Snapshot
from gpuagent.gpu import migmake
from gpuagent.gpu.nvml import Nvml
from gpuagent.gpu.readings import merge_description
from gpuagent.gpu.sim import node_from_mapping

T = TypeVar("T")


def node(name: str = "H100", *, admin: bool = True) -> Any:
    return node_from_mapping({"version": "v1", "gpus": [{"name": name}], "cap_sys_admin": admin})


def backend() -> Nvml:
    """The backend with GPU 0 described (MIG is managed only on a GPU it knows)."""
    nvml = Nvml(mig_shapes=True)
    nvml.init()
    nvml.describe(0)
    return nvml


def on(nvml: Nvml, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
    """``fn`` of gpu/migmake.py on GPU 0, as gpu/migcontrol.py calls it."""
    return fn(0, nvml.mig_handle(0), nvml.calls, *args, **kw)


def shape(nvml: Nvml, name: str) -> MigShape:
    partitions = nvml.describe(0).mig_partitions
    assert partitions is not None
    return next(s for s in partitions.shapes if s.name == name)


def test_an_h100_offers_its_seven_profiles_at_their_placements(run: Run) -> None:
    run(node(), Sleeps())
    gpu = backend().describe(0)
    assert not gpu.mig_enabled
    offered = gpu.mig_partitions
    assert offered is not None
    assert offered.toggles
    assert offered.memory_slices == 8
    placements = {s.name: [(p.start, p.size) for p in s.placements] for s in offered.shapes}
    assert placements == {
        "1g.10gb": [(i, 1) for i in range(7)],
        "1g.10gb+me": [(i, 1) for i in range(7)],
        "1g.20gb": [(0, 2), (2, 2), (4, 2), (6, 2)],
        "2g.20gb": [(0, 2), (2, 2), (4, 2)],
        "3g.40gb": [(0, 4), (4, 4)],
        "4g.40gb": [(0, 4)],
        "7g.80gb": [(0, 8)],
    }
    assert {s.name: s.profile_id for s in offered.shapes}["3g.40gb"] == 9


def test_an_ampere_gpu_offers_shapes_that_take_a_reset(run: Run) -> None:
    run(node("A100-80GB"), Sleeps())
    offered = backend().describe(0).mig_partitions
    assert offered is not None
    assert not offered.toggles


def test_without_cap_sys_admin_no_shapes_are_read(run: Run) -> None:
    run(node(admin=False), Sleeps())
    assert backend().describe(0).mig_partitions is None


def test_an_instance_is_made_found_and_destroyed(run: Run) -> None:
    run(node(), Sleeps())
    nvml = backend()
    small = shape(nvml, "1g.10gb")
    with pytest.raises(MigRefused, match="NOT_SUPPORTED"):
        on(nvml, migmake.make_instance, small, Placement(3, 1))  # MIG mode is off
    on(nvml, migmake.set_mig_mode, on=True)
    gi = on(nvml, migmake.make_instance, small, Placement(3, 1))
    assert on(nvml, migmake.instances, (small,)) == [
        Instance(gi, 19, Placement(3, 1), computed=True)
    ]
    (mig,) = nvml.describe(0).mig_devices
    assert (mig.gpu_instance_id, mig.profile_id, mig.placement) == (gi, 19, Placement(3, 1))
    with pytest.raises(MigRefused, match="INSUFFICIENT_RESOURCES") as caught:
        on(nvml, migmake.make_instance, shape(nvml, "3g.40gb"), Placement(0, 4))
    assert caught.value.reason == "INSUFFICIENT_RESOURCES"
    assert on(nvml, migmake.destroy_instance, gi)
    assert not on(nvml, migmake.destroy_instance, gi)
    assert nvml.describe(0).mig_devices == ()
    on(nvml, migmake.set_mig_mode, on=False)
    assert not on(nvml, migmake.mig_mode)


def test_mig_mode_on_an_ampere_gpu_needs_a_reset(run: Run) -> None:
    run(node("A100-80GB"), Sleeps())
    with pytest.raises(MigRefused, match="RESET_REQUIRED"):
        on(backend(), migmake.set_mig_mode, on=True)


def test_a_redescription_keeps_an_instances_own_conditions(run: Run) -> None:
    run(node(), Sleeps())
    nvml = backend()
    on(nvml, migmake.set_mig_mode, on=True)
    on(nvml, migmake.make_instance, shape(nvml, "1g.10gb"), Placement(0, 1))
    before = nvml.describe(0)
    (mig,) = before.mig_devices
    sick = GpuHealth((Condition("xid", "43"),))
    state = Snapshot(gpus=(replace(before, mig_devices=(replace(mig, health=sick),)),))
    on(nvml, migmake.make_instance, shape(nvml, "1g.10gb"), Placement(1, 1))
    merged = merge_description(state, nvml.describe(0)).gpu(0)
    assert merged is not None
    health = {m.uuid: m.health for m in merged.mig_devices}
    assert len(health) == 2
    assert health.pop(mig.uuid) == sick
    assert list(health.values()) == [GpuHealth()]


def test_a_gpu_not_described_is_refused(run: Run) -> None:
    run(node(), Sleeps())
    nvml = Nvml(mig_shapes=True)
    nvml.init()
    with pytest.raises(MigRefused, match="not been described"):
        nvml.mig_handle(0)
