"""MPS on the simulated driver: compute modes, the stand-in control daemon, clients under its
limits, the server in NVML's lists, and the reader telling the server from its clients."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pynvml
import pytest
from support.clock import FakeClock
from support.mpsdaemon import StandIn, running_daemon

from gpuagent.gpu.computemode import ComputeModeError, ComputeModes
from gpuagent.gpu.nvml import Nvml
from gpuagent.gpu.processes import ProcessReader
from gpuagent.gpu.sim import SimDriver, install, node_from_mapping, uninstall
from gpuagent.gpu.sim._api_process import PROCESS_MODE_ALL_CUDA
from gpuagent.gpu.sim.mps import SERVER_NAME
from gpuagent.gpu.sim.processes import Refused

MIB = 1024 * 1024
H100, H100_MIG, A100 = 0, 1, 2
EXCLUSIVE = pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS


@pytest.fixture
def sim(clock: FakeClock, tmp_path: Path) -> Iterator[tuple[SimDriver, Nvml]]:
    node = node_from_mapping(
        {
            "version": "v1",
            "gpus": [
                {"name": "H100"},
                {"name": "H100", "mig": ["3g.40gb", "1g.10gb"]},
                {"name": "A100-80GB"},
            ],
        }
    )
    # CUDA 13.3: the detail list's mode ALL answers (H100), an A100 still has three lists.
    driver = SimDriver(replace(node, cuda_driver_version=PROCESS_MODE_ALL_CUDA), clock=clock)
    install(driver)
    nvml = Nvml(sysfs_root=tmp_path)
    try:
        nvml.init()
        nvml.discover()
        yield driver, nvml
    finally:
        nvml.shutdown()
        uninstall()


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[StandIn]:
    with running_daemon(
        tmp_path / "driver", tmp_path / "mps" / "pipe", tmp_path / "mps" / "log"
    ) as d:
        yield d


def handle(index: int) -> Any:
    return pynvml.nvmlDeviceGetHandleByIndex(index)


def client(daemon: StandIn, **own: float) -> dict[str, object]:
    return {"pipe_directory": str(daemon.pipe), **own}


# ----- compute modes ------------------------------------------------------------------------------
def test_compute_mode_is_read_and_set_through_nvml(sim: tuple[SimDriver, Nvml]) -> None:
    driver, _ = sim
    assert pynvml.nvmlDeviceGetComputeMode(handle(H100)) == pynvml.NVML_COMPUTEMODE_DEFAULT
    pynvml.nvmlDeviceSetComputeMode(handle(H100), EXCLUSIVE)
    assert pynvml.nvmlDeviceGetComputeMode(handle(H100)) == EXCLUSIVE
    assert driver.describe()[H100]["compute_mode"] == "exclusive_process"
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlDeviceSetComputeMode(handle(H100), 7)
    mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle(H100_MIG), 0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetComputeMode(mig)


def test_a_mig_enabled_gpu_refuses_an_exclusive_mode(sim: tuple[SimDriver, Nvml]) -> None:
    """A real driver: "Setting compute mode to EXCLUSIVE_PROCESS is not supported on a
    MIG-enabled device" (NVIDIA/DCGM#82); nvml.h: with MIG on, the device must be a MIG device."""
    driver, _ = sim
    for mode in (EXCLUSIVE, pynvml.NVML_COMPUTEMODE_PROHIBITED):
        with pytest.raises(pynvml.NVMLError_NotSupported):
            pynvml.nvmlDeviceSetComputeMode(handle(H100_MIG), mode)
    pynvml.nvmlDeviceSetComputeMode(handle(H100_MIG), pynvml.NVML_COMPUTEMODE_DEFAULT)
    assert pynvml.nvmlDeviceGetComputeMode(handle(H100_MIG)) == pynvml.NVML_COMPUTEMODE_DEFAULT
    assert driver.describe()[H100_MIG]["compute_mode"] == "default"


async def test_compute_modes_say_none_when_the_gpu_refuses_to_be_set(
    sim: tuple[SimDriver, Nvml],
) -> None:
    """A MIG-enabled GPU reads its mode (DEFAULT) but refuses EXCLUSIVE_PROCESS: nothing was set,
    so nothing is to be restored (the keeper is told None, not DEFAULT as if it had set it)."""
    _, nvml = sim
    modes = ComputeModes(nvml)
    try:
        assert pynvml.nvmlDeviceGetComputeMode(handle(H100_MIG)) == pynvml.NVML_COMPUTEMODE_DEFAULT
        assert await asyncio.wait_for(modes.exclusive(H100_MIG), 10) is None
        assert pynvml.nvmlDeviceGetComputeMode(handle(H100_MIG)) == pynvml.NVML_COMPUTEMODE_DEFAULT
    finally:
        modes.close()


async def test_compute_modes_give_back_what_the_gpu_had(sim: tuple[SimDriver, Nvml]) -> None:
    _, nvml = sim
    pynvml.nvmlDeviceSetComputeMode(handle(A100), pynvml.NVML_COMPUTEMODE_PROHIBITED)
    modes = ComputeModes(nvml)
    try:
        assert await modes.exclusive(H100) == pynvml.NVML_COMPUTEMODE_DEFAULT
        assert await modes.exclusive(A100) == pynvml.NVML_COMPUTEMODE_PROHIBITED
        assert await modes.exclusive(H100) == EXCLUSIVE  # already: nothing set
        assert pynvml.nvmlDeviceGetComputeMode(handle(A100)) == EXCLUSIVE
        await modes.restore(A100, pynvml.NVML_COMPUTEMODE_PROHIBITED)
        assert pynvml.nvmlDeviceGetComputeMode(handle(A100)) == pynvml.NVML_COMPUTEMODE_PROHIBITED
        with pytest.raises(ComputeModeError, match="GPU 9"):
            await asyncio.wait_for(modes.exclusive(9), 10)
    finally:
        modes.close()


def test_an_exclusive_gpu_admits_one_process(sim: tuple[SimDriver, Nvml]) -> None:
    driver, _ = sim
    pynvml.nvmlDeviceSetComputeMode(handle(H100), EXCLUSIVE)
    driver.add_process(H100, 10, 100, 5)
    driver.add_process(H100, 10, 200, 5)  # the same process, updated
    with pytest.raises(Refused, match="process 10 holds it") as info:
        driver.add_process(H100, 11, 100, 5)
    assert info.value.cuda_error == "cudaErrorDevicesUnavailable"
    pynvml.nvmlDeviceSetComputeMode(handle(H100), pynvml.NVML_COMPUTEMODE_PROHIBITED)
    with pytest.raises(Refused, match="PROHIBITED"):
        driver.add_process(H100, 10, 100, 5)


# ----- clients of a daemon ------------------------------------------------------------------------
def test_a_client_runs_under_its_daemons_limits(
    sim: tuple[SimDriver, Nvml], daemon: StandIn
) -> None:
    driver, _ = sim
    daemon.send(
        "set_default_device_pinned_mem_limit 0 20G", "set_default_active_thread_percentage 25"
    )
    pynvml.nvmlDeviceSetComputeMode(handle(H100), EXCLUSIVE)
    started = driver.add_process(H100, 500, 20 * 1024, 60, mps_client=client(daemon))
    assert (started["type"], started["sm_util"]) == ("mps", 25.0)
    with pytest.raises(Refused, match="past the client's pinned device memory limit") as info:
        driver.add_process(H100, 501, 20 * 1024 + 1, 10, mps_client=client(daemon))
    assert info.value.cuda_error == "cudaErrorMemoryAllocation"
    # A client's own limit wins over the daemon's default.
    with pytest.raises(Refused, match="limit of 1024 MiB"):
        driver.add_process(
            H100, 502, 2048, 10, mps_client=client(daemon, pinned_mem_limit_mib=1024)
        )
    driver.add_process(H100, 503, 512, 10, mps_client=client(daemon, pinned_mem_limit_mib=1024))
    # NVML lists the server and both clients as compute processes, the clients alone as MPS.
    compute = pynvml.nvmlDeviceGetComputeRunningProcesses_v3(handle(H100))
    mps = pynvml.nvmlDeviceGetMPSComputeRunningProcesses_v3(handle(H100))
    server = next(p.pid for p in compute if p.pid not in (500, 503))
    assert sorted(p.pid for p in mps) == [500, 503]
    assert pynvml.nvmlSystemGetProcessName(server) == SERVER_NAME
    assert pynvml.nvmlSystemGetProcessName(500) == "python3"
    # In exclusive mode the server holds the GPU: a process that bypasses MPS cannot start.
    with pytest.raises(Refused, match=f"process {server} holds it"):
        driver.add_process(H100, 600, 100, 5)
    # The server goes with its last client.
    driver.remove_process(500)
    assert [p["pid"] for p in driver.remove_process(503)] == [503, server]
    assert driver.processes() == []


def test_without_a_daemon_a_client_runs_as_a_plain_process(
    sim: tuple[SimDriver, Nvml], tmp_path: Path
) -> None:
    driver, _ = sim
    gone = {"pipe_directory": str(tmp_path / "nobody")}
    started = driver.add_process(H100, 700, 100, 5, mps_client=gone)
    assert started["type"] == "compute"
    with pytest.raises(ValueError, match="absolute path"):
        driver.add_process(H100, 701, 1, 1, mps_client={"pipe_directory": "relative"})
    with pytest.raises(ValueError, match="unknown keys"):
        driver.add_process(H100, 701, 1, 1, mps_client={"pipe_directory": "/x", "limit": 1})


# ----- the reader ---------------------------------------------------------------------------------
@pytest.mark.parametrize("gpu", [H100, A100], ids=["detail-list", "three-lists"])
def test_the_reader_marks_the_server_and_asks_its_name_once(
    sim: tuple[SimDriver, Nvml], daemon: StandIn, gpu: int
) -> None:
    driver, nvml = sim
    reader = ProcessReader(nvml.calls)
    driver.add_process(gpu, 42, 100, 5)  # before any client: no name asked
    first = reader.read(gpu, handle(gpu))
    assert first is not None
    assert [(p.pid, p.mps_server) for p in first.processes] == [(42, False)]
    assert driver.calls["nvmlSystemGetProcessName"] == 0
    driver.add_process(gpu, 500, 1000, 5, mps_client=client(daemon))
    driver.add_process(gpu, 501, 1000, 5, mps_client=client(daemon))
    lists = driver.calls["nvmlDeviceGetMPSComputeRunningProcesses_v3"]
    for _ in range(3):
        reading = reader.read(gpu, handle(gpu))
        assert reading is not None
        servers = [p.pid for p in reading.processes if p.mps_server]
        assert len(servers) == 1
        assert {p.pid for p in reading.processes} - set(servers) == {42, 500, 501}
    # The server and the plain process, once each; the clients never (the MPS list names them).
    assert driver.calls["nvmlSystemGetProcessName"] == 2
    # The path the parameter names: the MPS list read as one of three, or never.
    assert (driver.calls["nvmlDeviceGetMPSComputeRunningProcesses_v3"] > lists) is (gpu == A100)
