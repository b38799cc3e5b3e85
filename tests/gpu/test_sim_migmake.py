"""MIG made and destroyed on the simulated driver, through the real pynvml wrappers, with the
answers nvml.h gives: placements, MIG mode (a reset on Ampere), instance creation refused with
INSUFFICIENT_RESOURCES, NO_PERMISSION or NOT_SUPPORTED, destruction refused with IN_USE, and a
creation's latency spent through the injectable sleep."""

from __future__ import annotations

import ctypes
from typing import Any

import pynvml
import pytest
from support.clock import Sleeps
from support.simnvml import Run

from gpuagent.gpu.sim import SimDriver, node_from_mapping

ENABLE, DISABLE = pynvml.NVML_DEVICE_MIG_ENABLE, pynvml.NVML_DEVICE_MIG_DISABLE
# nvml.h's GPU-instance profile indexes and the IDs an H100 answers for them.
ONE_SLICE, THREE_SLICE, ONE_SLICE_ME = 0x0, 0x2, 0x7


def node(name: str = "H100", *, admin: bool = True, count: int = 1) -> Any:
    return node_from_mapping(
        {"version": "v1", "gpus": [{"name": name}] * count, "cap_sys_admin": admin}
    )


def handle(index: int = 0) -> Any:
    return pynvml.nvmlDeviceGetHandleByIndex(index)


def profile_id(index: int) -> int:
    return int(pynvml.nvmlDeviceGetGpuInstanceProfileInfo(handle(), index, version=1).id)


def placement(start: int, size: int) -> Any:
    value = pynvml.c_nvmlGpuInstancePlacement_t()
    value.start, value.size = start, size
    return ctypes.byref(value)


def make(index: int, start: int) -> tuple[Any, Any]:
    """A GPU instance of profile ``index`` at ``start`` and the compute instance spanning it."""
    info = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(handle(), index, version=1)
    size = {ONE_SLICE: 1, ONE_SLICE_ME: 1, THREE_SLICE: 4}[index]
    gi = pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(
        handle(), int(info.id), placement(start, size)
    )
    ci_profile = {ONE_SLICE: 0x0, ONE_SLICE_ME: 0x0, THREE_SLICE: 0x2}[index]
    ci_info = pynvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, ci_profile, 0)
    return gi, pynvml.nvmlGpuInstanceCreateComputeInstance(gi, int(ci_info.id))


def code(call: Any, *args: Any) -> int:
    """The NVML error ``call(*args)`` raises."""
    with pytest.raises(pynvml.NVMLError) as caught:
        call(*args)
    return int(caught.value.value)


def mig_uuids() -> list[str]:
    out = []
    for i in range(int(pynvml.nvmlDeviceGetMaxMigDeviceCount(handle()))):
        try:
            mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle(), i)
        except pynvml.NVMLError_NotFound:
            break
        out.append(str(pynvml.nvmlDeviceGetUUID(mig)))
    return out


def test_placements_are_offered_whatever_the_mig_mode(run: Run) -> None:
    run(node(), Sleeps())
    assert pynvml.nvmlDeviceGetMigMode(handle()) == [DISABLE, DISABLE]
    wanted = {ONE_SLICE: [(s, 1) for s in range(7)], THREE_SLICE: [(0, 4), (4, 4)]}
    for index, expected in wanted.items():
        count = ctypes.c_uint(0)
        pid = profile_id(index)
        pynvml.nvmlDeviceGetGpuInstancePossiblePlacements(handle(), pid, None, ctypes.byref(count))
        assert count.value == len(expected)
        array = (pynvml.c_nvmlGpuInstancePlacement_t * count.value)()
        pynvml.nvmlDeviceGetGpuInstancePossiblePlacements(handle(), pid, array, ctypes.byref(count))
        assert [(p.start, p.size) for p in array] == expected
    # The versioned profile call needs MIG mode; the first one (above) does not.
    assert code(pynvml.nvmlDeviceGetGpuInstanceProfileInfo, handle(), 0) == (
        pynvml.NVML_ERROR_NOT_SUPPORTED
    )


def test_made_instances_are_mig_devices_until_destroyed(run: Run) -> None:
    driver = run(node(), Sleeps())
    pynvml.nvmlDeviceSetMigMode(handle(), ENABLE)
    assert pynvml.nvmlDeviceGetMigMode(handle()) == [ENABLE, ENABLE]
    small_gi, small_ci = make(ONE_SLICE, 6)
    big_gi, big_ci = make(THREE_SLICE, 0)
    (gpu,) = driver.describe()
    devices: Any = gpu["mig_devices"]
    placed = {(m["profile"], m["placement"]["start"]) for m in devices}
    assert placed == {("1g.10gb", 6), ("3g.40gb", 0)}
    first = mig_uuids()
    assert len(first) == 2
    assert all(u.startswith("MIG-") for u in first)
    # A GPU instance holding a compute instance is in use.
    assert code(pynvml.nvmlGpuInstanceDestroy, small_gi) == pynvml.NVML_ERROR_IN_USE
    pynvml.nvmlComputeInstanceDestroy(small_ci)
    pynvml.nvmlGpuInstanceDestroy(small_gi)
    assert len(mig_uuids()) == 1
    # Made again at the same place: a new MIG device, with a new UUID.
    make(ONE_SLICE, 6)
    assert set(mig_uuids()) - set(first)
    assert code(pynvml.nvmlGpuInstanceGetInfo, small_gi) == pynvml.NVML_ERROR_INVALID_ARGUMENT
    del big_gi, big_ci


def test_creation_is_refused_as_the_driver_refuses_it(run: Run) -> None:
    run(node(), Sleeps())
    one = profile_id(ONE_SLICE)
    create = pynvml.nvmlDeviceCreateGpuInstanceWithPlacement
    # No MIG mode: nothing can be made.
    assert code(create, handle(), one, placement(0, 1)) == pynvml.NVML_ERROR_NOT_SUPPORTED
    pynvml.nvmlDeviceSetMigMode(handle(), ENABLE)
    make(THREE_SLICE, 4)
    # Overlapping memory slices: INSUFFICIENT_RESOURCES, not ALREADY_EXISTS.
    assert code(create, handle(), one, placement(5, 1)) == (
        pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES
    )
    # A placement the profile does not offer, an unknown profile ID.
    assert code(create, handle(), one, placement(7, 1)) == pynvml.NVML_ERROR_INVALID_ARGUMENT
    assert code(create, handle(), one, placement(0, 2)) == pynvml.NVML_ERROR_INVALID_ARGUMENT
    assert code(create, handle(), 99, placement(0, 1)) == pynvml.NVML_ERROR_INVALID_ARGUMENT
    # One +me instance per GPU.
    make(ONE_SLICE_ME, 0)
    me = profile_id(ONE_SLICE_ME)
    assert code(create, handle(), me, placement(1, 1)) == (pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)


def test_without_cap_sys_admin_nothing_is_managed(run: Run) -> None:
    run(node(admin=False), Sleeps())
    count = ctypes.c_uint(0)
    one = profile_id(ONE_SLICE)
    refused = pynvml.NVML_ERROR_NO_PERMISSION
    assert code(pynvml.nvmlDeviceSetMigMode, handle(), ENABLE) == refused
    assert (
        code(
            pynvml.nvmlDeviceGetGpuInstancePossiblePlacements,
            handle(),
            one,
            None,
            ctypes.byref(count),
        )
        == refused
    )
    assert pynvml.nvmlDeviceGetMigMode(handle()) == [DISABLE, DISABLE]


def test_processes_keep_an_instance_and_the_mig_mode(run: Run) -> None:
    driver = run(node(), Sleeps())
    pynvml.nvmlDeviceSetMigMode(handle(), ENABLE)
    gi, ci = make(ONE_SLICE, 2)
    gi_id = int(pynvml.nvmlGpuInstanceGetInfo(gi).id)
    driver.add_process(0, 4242, 1024, 50, gpu_instance=gi_id)
    assert code(pynvml.nvmlComputeInstanceDestroy, ci) == pynvml.NVML_ERROR_IN_USE
    # Instances keep MIG mode on: the mode is pending, not current.
    assert pynvml.nvmlDeviceSetMigMode(handle(), DISABLE) == pynvml.NVML_ERROR_IN_USE
    assert pynvml.nvmlDeviceGetMigMode(handle()) == [ENABLE, DISABLE]
    driver.remove_process(4242)
    pynvml.nvmlComputeInstanceDestroy(ci)
    pynvml.nvmlGpuInstanceDestroy(gi)
    assert pynvml.nvmlDeviceSetMigMode(handle(), DISABLE) == pynvml.NVML_SUCCESS
    # A process on the whole GPU keeps it from switching to MIG mode.
    driver.add_process(0, 7, 1024, 50)
    assert pynvml.nvmlDeviceSetMigMode(handle(), ENABLE) == pynvml.NVML_ERROR_IN_USE
    assert pynvml.nvmlDeviceGetMigMode(handle()) == [DISABLE, ENABLE]


def test_ampere_switches_mig_mode_on_a_reset_only(run: Run) -> None:
    driver = run(node("A100-80GB"), Sleeps())
    status = pynvml.nvmlDeviceSetMigMode(handle(), ENABLE)
    assert status == pynvml.NVML_ERROR_RESET_REQUIRED
    assert pynvml.nvmlDeviceGetMigMode(handle()) == [DISABLE, ENABLE]
    driver.inject(0, "recover")
    assert pynvml.nvmlDeviceGetMigMode(handle()) == [ENABLE, ENABLE]
    assert driver.describe()[0]["mig_mode"] == "enabled"


def test_a_creation_takes_the_driver_s_time(run: Run) -> None:
    sleeps = Sleeps()
    driver: SimDriver = run(node(), sleeps)
    latency = driver.node.latency
    pynvml.nvmlDeviceSetMigMode(handle(), ENABLE)
    before = len(sleeps.seconds)
    make(THREE_SLICE, 0)
    spent = sleeps.seconds[before:]
    assert latency.of("nvmlDeviceCreateGpuInstanceWithPlacement") in spent
    assert latency.of("nvmlGpuInstanceCreateComputeInstance") in spent
    assert sum(spent) >= 0.3  # hundreds of milliseconds, as on a real driver
