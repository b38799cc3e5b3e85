"""The simulated driver's per-process entry points, through the real pynvml wrappers and raw.

nvml.h is the judge: the sizing protocol (INSUFFICIENT_SIZE with the count, SUCCESS with none),
GPU/compute instance IDs only under MIG, NOT_FOUND without new samples, NOT_SUPPORTED for
per-process utilisation under MIG, version checks; and the GPU's own utilisation and memory
following its processes.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pynvml
import pytest
from support.clock import FakeClock
from support.mpsdaemon import StandIn, server_pid
from support.simnvml import nvml_on

from gpuagent.gpu.sim import SimDriver, node_from_mapping
from gpuagent.gpu.sim._api_process import PROCESS_MODE_ALL_CUDA
from gpuagent.gpu.sim.processes import SAMPLE_PERIOD_US
from gpuagent.overrides.nvml import nvml_function

MIB = 1024 * 1024
NO_INSTANCE = 0xFFFF_FFFF


@pytest.fixture
def driver(clock: FakeClock) -> Iterator[SimDriver]:
    """GPU 0 and 1 H100s, GPU 2 an H100 in MIG mode, GPU 3 an A100 (no detail list)."""
    node = node_from_mapping(
        {
            "version": "v1",
            "gpus": [
                {"name": "H100"},
                {"name": "H100"},
                {"name": "H100", "mig": ["3g.40gb", "1g.10gb"]},
                {"name": "A100-80GB"},
            ],
        }
    )
    with nvml_on(SimDriver(node, clock=clock)) as drv:
        yield drv


def handle(index: int) -> Any:
    return pynvml.nvmlDeviceGetHandleByIndex(index)


def mig_handle(gpu: int, position: int) -> Any:
    return pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle(gpu), position)


def instances(driver: SimDriver, gpu: int) -> list[tuple[int, int]]:
    """(GPU instance, compute instance) of each MIG device, in enumeration order."""
    found = []
    for position in range(len(driver.node.gpus[gpu].mig_devices)):
        h = mig_handle(gpu, position)
        found.append(
            (pynvml.nvmlDeviceGetGpuInstanceId(h), pynvml.nvmlDeviceGetComputeInstanceId(h))
        )
    return found


def code(fn: Any, *args: Any) -> int:
    try:
        fn(*args)
    except pynvml.NVMLError as exc:
        return int(exc.value)
    return int(pynvml.NVML_SUCCESS)


class TestRunningProcesses:
    def test_no_processes_is_success_with_an_empty_list(self, driver: SimDriver) -> None:
        assert pynvml.nvmlDeviceGetComputeRunningProcesses_v3(handle(0)) == []
        assert pynvml.nvmlDeviceGetGraphicsRunningProcesses_v3(handle(0)) == []

    def test_processes_listed_by_kind_with_memory(
        self, driver: SimDriver, mps_daemon: StandIn
    ) -> None:
        driver.add_process(0, 4242, 1024, 30)
        driver.add_process(0, 4343, 512.5, 10, kind="graphics")
        driver.add_process(0, 4444, 256, 5, mps_client=mps_daemon.client())
        driver.add_process(1, 4242, 100, 1)  # the same process on a second GPU
        compute = pynvml.nvmlDeviceGetComputeRunningProcesses_v3(handle(0))
        # An MPS client is a compute context too: listed in both, as on a real R580 driver, with
        # its server (a compute process of 66 MiB).
        assert [(p.pid, p.usedGpuMemory) for p in compute] == [
            (4242, 1024 * MIB),
            (4444, 256 * MIB),
            (server_pid(driver), 66 * MIB),
        ]
        assert (compute[0].gpuInstanceId, compute[0].computeInstanceId) == (NO_INSTANCE,) * 2
        graphics = pynvml.nvmlDeviceGetGraphicsRunningProcesses_v3(handle(0))
        assert [(p.pid, p.usedGpuMemory) for p in graphics] == [(4343, round(512.5 * MIB))]
        mps = pynvml.nvmlDeviceGetMPSComputeRunningProcesses_v3(handle(0))
        assert [p.pid for p in mps] == [4444]
        assert [p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses_v3(handle(1))] == [4242]

    def test_sizing_protocol(self, driver: SimDriver) -> None:
        for pid in (10, 11, 12):
            driver.add_process(0, pid, 1, 1)
        fn = nvml_function("nvmlDeviceGetComputeRunningProcesses_v3")
        count = ctypes.c_uint(0)
        assert fn(handle(0), ctypes.byref(count), None) == pynvml.NVML_ERROR_INSUFFICIENT_SIZE
        assert count.value == 3
        count = ctypes.c_uint(2)
        small = (pynvml.c_nvmlProcessInfo_v3_t * 2)()
        assert fn(handle(0), ctypes.byref(count), small) == pynvml.NVML_ERROR_INSUFFICIENT_SIZE
        assert count.value == 3
        count = ctypes.c_uint(3)
        assert fn(handle(0), ctypes.byref(count), None) == pynvml.NVML_ERROR_INVALID_ARGUMENT
        infos = (pynvml.c_nvmlProcessInfo_v3_t * 5)()
        count = ctypes.c_uint(5)
        assert fn(handle(0), ctypes.byref(count), infos) == pynvml.NVML_SUCCESS
        assert count.value == 3
        assert [infos[i].pid for i in range(3)] == [10, 11, 12]

    def test_mig_processes_carry_their_instance(self, driver: SimDriver) -> None:
        (gi_a, ci_a), (gi_b, ci_b) = instances(driver, 2)
        driver.add_process(2, 700, 2048, 0, gpu_instance=gi_a)
        driver.add_process(2, 701, 1024, 0, gpu_instance=gi_b, compute_instance=ci_b)
        on_parent = pynvml.nvmlDeviceGetComputeRunningProcesses_v3(handle(2))
        assert sorted((p.pid, p.gpuInstanceId, p.computeInstanceId) for p in on_parent) == [
            (700, gi_a, ci_a),
            (701, gi_b, ci_b),
        ]
        on_b = pynvml.nvmlDeviceGetComputeRunningProcesses_v3(mig_handle(2, 1))
        assert [(p.pid, p.gpuInstanceId) for p in on_b] == [(701, gi_b)]

    def test_ending_a_process_removes_it_everywhere(self, driver: SimDriver) -> None:
        driver.add_process(0, 55, 1, 1)
        driver.add_process(1, 55, 1, 1)
        removed = driver.remove_process(55)
        assert sorted(int(p["gpu"]) for p in removed) == [0, 1]  # type: ignore[call-overload]
        assert pynvml.nvmlDeviceGetComputeRunningProcesses_v3(handle(0)) == []
        with pytest.raises(LookupError):
            driver.remove_process(55)

    def test_lost_gpu(self, driver: SimDriver) -> None:
        driver.add_process(0, 55, 1, 1)
        driver.inject(0, "lost")
        assert code(pynvml.nvmlDeviceGetComputeRunningProcesses_v3, handle(0)) == (
            pynvml.NVML_ERROR_GPU_IS_LOST
        )


class TestDetailList:
    def detail(self, index: int, mode: int) -> list[Any]:
        return list(
            pynvml.nvmlDeviceGetRunningProcessDetailList(
                handle(index), pynvml.nvmlProcessDetailList_v1, mode
            )
        )

    def test_modes_list_as_a_real_r580_driver_does(
        self, driver: SimDriver, mps_daemon: StandIn
    ) -> None:
        """What a real 580.159 driver answered with an MPS server's clients on the GPU: mode
        compute lists every compute context (MPS clients and server too), MPS the clients,
        graphics none."""
        driver.add_process(0, 1, 10, 1)
        driver.add_process(0, 2, 20, 1, kind="graphics")
        driver.add_process(0, 3, 30, 1, mps_client=mps_daemon.client())
        compute = self.detail(0, pynvml.NVML_PROCESS_MODE_COMPUTE)
        server = server_pid(driver)
        assert [(p.pid, p.usedGpuMemory) for p in compute] == [
            (1, 10 * MIB),
            (3, 30 * MIB),
            (server, 66 * MIB),
        ]
        assert [p.pid for p in self.detail(0, pynvml.NVML_PROCESS_MODE_GRAPHICS)] == [2]
        assert [p.pid for p in self.detail(0, pynvml.NVML_PROCESS_MODE_MPS)] == [3]
        assert self.detail(1, pynvml.NVML_PROCESS_MODE_COMPUTE) == []

    def test_mode_all_is_refused_before_its_header(self, driver: SimDriver) -> None:
        """nvml.h names mode ALL from CUDA 13.3 on; the R580 driver (CUDA 13.0) refuses it."""
        assert driver.node.cuda_driver_version < PROCESS_MODE_ALL_CUDA
        refused = code(self.detail, 0, pynvml.NVML_PROCESS_MODE_ALL)
        assert refused == pynvml.NVML_ERROR_INVALID_ARGUMENT

    def test_mode_all_lists_every_kind_on_a_newer_driver(
        self, clock: FakeClock, mps_daemon: StandIn
    ) -> None:
        node = node_from_mapping({"version": "v1", "gpus": [{"name": "H100"}]})
        newer = replace(node, cuda_driver_version=PROCESS_MODE_ALL_CUDA)
        with nvml_on(SimDriver(newer, clock=clock)) as driver:
            driver.add_process(0, 1, 10, 1)
            driver.add_process(0, 2, 20, 1, kind="graphics")
            driver.add_process(0, 3, 30, 1, mps_client=mps_daemon.client())
            every = self.detail(0, pynvml.NVML_PROCESS_MODE_ALL)
            assert [(p.pid, p.usedGpuMemory) for p in every] == [
                (1, 10 * MIB),
                (2, 20 * MIB),
                (3, 30 * MIB),
                (server_pid(driver), 66 * MIB),
            ]

    def test_bad_version_or_mode_and_older_gpus(self, driver: SimDriver) -> None:
        bad_version = code(pynvml.nvmlDeviceGetRunningProcessDetailList, handle(0), 0x2000018, 3)
        assert bad_version == pynvml.NVML_ERROR_INVALID_ARGUMENT
        bad_mode = code(
            pynvml.nvmlDeviceGetRunningProcessDetailList,
            handle(0),
            pynvml.nvmlProcessDetailList_v1,
            7,
        )
        assert bad_mode == pynvml.NVML_ERROR_INVALID_ARGUMENT
        ampere = code(self.detail, 3, pynvml.NVML_PROCESS_MODE_COMPUTE)
        assert ampere == pynvml.NVML_ERROR_NOT_SUPPORTED


class TestProcessUtilization:
    def test_not_found_without_samples(self, driver: SimDriver) -> None:
        assert code(pynvml.nvmlDeviceGetProcessUtilization, handle(0), 0) == (
            pynvml.NVML_ERROR_NOT_FOUND
        )
        driver.add_process(0, 9, 100, 0)  # idle: no sample
        assert code(pynvml.nvmlDeviceGetProcessesUtilizationInfo, handle(0), 0) == (
            pynvml.NVML_ERROR_NOT_FOUND
        )

    def test_samples_since_the_last_seen_time_stamp(
        self, driver: SimDriver, clock: FakeClock
    ) -> None:
        driver.add_process(0, 9, 100, 40)
        driver.add_process(0, 10, 100, 25)
        samples = pynvml.nvmlDeviceGetProcessUtilization(handle(0), 0)
        assert sorted((s.pid, s.smUtil, s.memUtil) for s in samples) == [(9, 40, 20), (10, 25, 12)]
        stamp = samples[0].timeStamp
        assert stamp > 0
        # Nothing newer until the driver takes its next sample.
        assert code(pynvml.nvmlDeviceGetProcessUtilization, handle(0), stamp) == (
            pynvml.NVML_ERROR_NOT_FOUND
        )
        clock.now += SAMPLE_PERIOD_US / 1e6
        info = pynvml.nvmlDeviceGetProcessesUtilizationInfo(handle(0), stamp)
        assert sorted((s.pid, s.smUtil) for s in info) == [(9, 40), (10, 25)]
        assert all(s.timeStamp > stamp for s in info)

    def test_sizing_protocol(self, driver: SimDriver) -> None:
        driver.add_process(0, 9, 100, 40)
        driver.add_process(0, 10, 100, 25)
        fn = nvml_function("nvmlDeviceGetProcessUtilization")
        count = ctypes.c_uint(0)
        assert fn(handle(0), None, ctypes.byref(count), ctypes.c_ulonglong(0)) == (
            pynvml.NVML_ERROR_INSUFFICIENT_SIZE
        )
        assert count.value == 2
        buffer = (pynvml.c_nvmlProcessUtilizationSample_t * 1)()
        count = ctypes.c_uint(1)
        assert fn(handle(0), buffer, ctypes.byref(count), ctypes.c_ulonglong(0)) == (
            pynvml.NVML_ERROR_INSUFFICIENT_SIZE
        )
        info = pynvml.c_nvmlProcessesUtilizationInfo_v1_t(0)
        info.version = 0x02000018
        fn2 = nvml_function("nvmlDeviceGetProcessesUtilizationInfo")
        assert fn2(handle(0), ctypes.byref(info)) == pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH

    def test_not_supported_under_mig(self, driver: SimDriver) -> None:
        (gi, _), _ = instances(driver, 2)
        driver.add_process(2, 700, 2048, 50, gpu_instance=gi)
        for h in (handle(2), mig_handle(2, 0)):
            assert code(pynvml.nvmlDeviceGetProcessUtilization, h, 0) == (
                pynvml.NVML_ERROR_NOT_SUPPORTED
            )
            assert code(pynvml.nvmlDeviceGetProcessesUtilizationInfo, h, 0) == (
                pynvml.NVML_ERROR_NOT_SUPPORTED
            )


class TestGpuFollowsProcesses:
    def test_utilisation_and_memory_are_the_processes(self, driver: SimDriver) -> None:
        driver.add_process(0, 1, 10_000, 35)
        driver.add_process(0, 2, 6_000, 40)
        util = pynvml.nvmlDeviceGetUtilizationRates(handle(0))
        assert util.gpu == 75
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle(0), version=pynvml.nvmlMemory_v2)
        assert memory.used == 16_000 * MIB
        driver.add_process(0, 3, 1, 80)
        assert pynvml.nvmlDeviceGetUtilizationRates(handle(0)).gpu == 100

    def test_mig_device_memory_is_its_processes(self, driver: SimDriver) -> None:
        (gi_a, _), (gi_b, _) = instances(driver, 2)
        driver.add_process(2, 700, 2048, 0, gpu_instance=gi_a)
        driver.add_process(2, 701, 1024, 0, gpu_instance=gi_b)
        used = pynvml.nvmlDeviceGetMemoryInfo(mig_handle(2, 1), version=pynvml.nvmlMemory_v2)
        assert used.used == 1024 * MIB

    @pytest.mark.parametrize(
        ("gpu", "kwargs", "error", "match"),
        [
            (9, {}, LookupError, "no simulated GPU"),
            (0, {"pid": 0}, ValueError, "'pid'"),
            (0, {"pid": True}, ValueError, "'pid'"),
            (0, {"memory_mib": -1}, ValueError, "'memory_mib'"),
            (0, {"memory_mib": 10**9}, ValueError, "out of memory"),
            (0, {"sm_util": 101}, ValueError, "'sm_util'"),
            (0, {"sm_util": float("nan")}, ValueError, "'sm_util'"),
            (0, {"kind": "video"}, ValueError, "'type'"),
            (0, {"gpu_instance": 1}, ValueError, "not in MIG mode"),
            (2, {}, ValueError, "is in MIG mode"),
            (2, {"gpu_instance": 99}, ValueError, "no GPU instance 99"),
        ],
    )
    def test_bad_processes_refused(
        self,
        driver: SimDriver,
        gpu: int,
        kwargs: dict[str, Any],
        error: type[Exception],
        match: str,
    ) -> None:
        args: dict[str, Any] = {"pid": 5, "memory_mib": 1, "sm_util": 1} | kwargs
        pid, memory, sm = args.pop("pid"), args.pop("memory_mib"), args.pop("sm_util")
        with pytest.raises(error, match=match):
            driver.add_process(gpu, pid, memory, sm, **args)
        assert driver.processes() == []
