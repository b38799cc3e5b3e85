"""MPS on the simulated driver: compute modes, the stand-in control daemon, clients under its
server's limits, the server's life (it outlives its clients until its daemon goes), the clients a
server serves, the server in NVML's lists, and the reader telling the server from its clients."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pynvml
import pytest
from support.clock import FakeClock
from support.mpsdaemon import StandIn, running_daemon, wait_until

from gpuagent.gpu.computemode import ComputeModeError, ComputeModes
from gpuagent.gpu.nvml import Nvml
from gpuagent.gpu.processes import ProcessReader
from gpuagent.gpu.sim import SimDriver, install, mps, node_from_mapping, uninstall
from gpuagent.gpu.sim._api_process import PROCESS_MODE_ALL_CUDA
from gpuagent.gpu.sim.mps import SERVER_NAME
from gpuagent.gpu.sim.processes import Refused
from gpuagent.gpu.sim.spec import CUDA_DRIVER_VERSION

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


def handle(index: int) -> Any:
    return pynvml.nvmlDeviceGetHandleByIndex(index)


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
    sim: tuple[SimDriver, Nvml], mps_daemon: StandIn
) -> None:
    driver, _ = sim
    mps_daemon.send(
        "set_default_device_pinned_mem_limit 0 20G", "set_default_active_thread_percentage 25"
    )
    pynvml.nvmlDeviceSetComputeMode(handle(H100), EXCLUSIVE)
    started = driver.add_process(H100, 500, 20 * 1024, 60, mps_client=mps_daemon.client())
    assert (started["type"], started["sm_util"]) == ("mps", 25.0)
    with pytest.raises(Refused, match="past the client's pinned device memory limit") as info:
        driver.add_process(H100, 501, 20 * 1024 + 1, 10, mps_client=mps_daemon.client())
    assert info.value.cuda_error == "cudaErrorMemoryAllocation"
    # A client's own limit wins over the daemon's default.
    with pytest.raises(Refused, match="limit of 1024 MiB"):
        driver.add_process(
            H100, 502, 2048, 10, mps_client=mps_daemon.client(pinned_mem_limit_mib=1024)
        )
    driver.add_process(H100, 503, 512, 10, mps_client=mps_daemon.client(pinned_mem_limit_mib=1024))
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


def test_a_clients_own_limits_only_lower_its_servers(
    sim: tuple[SimDriver, Nvml], mps_daemon: StandIn
) -> None:
    """NVIDIA: a client's CUDA_MPS_ACTIVE_THREAD_PERCENTAGE "will only further constrain" the
    daemon's; the memory limit is read the same stricter way (the docs are silent on it)."""
    driver, _ = sim
    mps_daemon.send(
        "set_default_device_pinned_mem_limit 0 1G", "set_default_active_thread_percentage 20"
    )
    own = mps_daemon.client(pinned_mem_limit_mib=4096, active_thread_percentage=80)
    with pytest.raises(Refused, match="limit of 1024 MiB"):
        driver.add_process(H100, 500, 2048, 90, mps_client=own)
    assert driver.add_process(H100, 500, 1024, 90, mps_client=own)["sm_util"] == 20.0


# ----- the server's life --------------------------------------------------------------------------
def server_of(driver: SimDriver) -> list[tuple[object, object]]:
    """(GPU, pid) of each MPS server context."""
    return [(p["gpu"], p["pid"]) for p in driver.processes() if p["name"] == SERVER_NAME]


def test_the_server_outlives_its_clients_until_its_daemon_quits(
    sim: tuple[SimDriver, Nvml], mps_daemon: StandIn
) -> None:
    driver, _ = sim
    pynvml.nvmlDeviceSetComputeMode(handle(H100), EXCLUSIVE)
    driver.add_process(H100, 500, 100, 5, mps_client=mps_daemon.client())
    ((_, server),) = server_of(driver)
    assert mps_daemon.ask("get_server_list") == str(server)
    assert [p["pid"] for p in driver.remove_process(500)] == [500]
    # No client left: the server stays, listed by NVML, and holds the exclusive GPU.
    assert server_of(driver) == [(H100, server)]
    listed = pynvml.nvmlDeviceGetComputeRunningProcesses_v3(handle(H100))
    assert [p.pid for p in listed] == [server]
    with pytest.raises(Refused, match=f"process {server} holds it") as info:
        driver.add_process(H100, 600, 100, 5)
    assert info.value.cuda_error == "cudaErrorDevicesUnavailable"
    # A later client joins the same server.
    driver.add_process(H100, 501, 100, 5, mps_client=mps_daemon.client())
    assert server_of(driver) == [(H100, server)]
    driver.remove_process(501)
    # The daemon quits: its server goes with it, and the GPU is free again.
    mps_daemon.send("quit")
    wait_until(lambda: not server_of(driver), what="the server's exit")
    wait_until(
        lambda: not pynvml.nvmlDeviceGetComputeRunningProcesses_v3(handle(H100)),
        what="NVML's list without the server",
    )
    assert driver.add_process(H100, 600, 100, 5)["type"] == "compute"


def test_a_server_whose_daemon_quit_stays_while_a_client_runs(
    sim: tuple[SimDriver, Nvml], mps_daemon: StandIn
) -> None:
    driver, _ = sim
    driver.add_process(H100, 500, 100, 5, mps_client=mps_daemon.client())
    ((_, server),) = server_of(driver)
    mps_daemon.send("quit")
    wait_until(lambda: mps_daemon.process.poll() is not None, what="the daemon's exit")
    assert server_of(driver) == [(H100, server)]
    assert [p["pid"] for p in driver.remove_process(500)] == [500, server]
    assert driver.processes() == []


def test_a_new_daemon_starts_a_new_server_with_its_defaults(
    sim: tuple[SimDriver, Nvml], tmp_path: Path
) -> None:
    driver, _ = sim
    pipe, log = tmp_path / "mps" / "pipe", tmp_path / "mps" / "log"
    with running_daemon(tmp_path / "driver", pipe, log) as first:
        first.send("set_default_active_thread_percentage 30")
        driver.add_process(H100, 500, 100, 90, mps_client=first.client())
        ((_, old),) = server_of(driver)
    with running_daemon(tmp_path / "driver", pipe, log) as second:
        started = driver.add_process(H100, 501, 100, 90, mps_client=second.client())
        assert started["sm_util"] == 90.0  # the new daemon's defaults: 100 %
        servers = server_of(driver)
        assert len(servers) == 2
        assert (H100, old) in servers  # the old one serves 500 still
        (new,) = {pid for _, pid in servers} - {old}
        assert second.ask("get_server_list") == str(new)
        driver.remove_process(500)
        assert server_of(driver) == [(H100, new)]


# ----- the daemon's defaults and a running server's limits ----------------------------------------
def test_defaults_set_while_a_server_runs_are_for_the_next_server(
    sim: tuple[SimDriver, Nvml], mps_daemon: StandIn
) -> None:
    """NVIDIA's MPS docs: a default set while a server runs "will only affect the next server";
    set_device_pinned_mem_limit / set_active_thread_percentage <PID> change the running one for
    the clients created with it afterwards ("existing clients are not affected")."""
    driver, _ = sim
    mps_daemon.send(
        "set_default_device_pinned_mem_limit 0 20G", "set_default_active_thread_percentage 25"
    )
    driver.add_process(H100, 500, 1024, 60, mps_client=mps_daemon.client())
    ((_, server),) = server_of(driver)
    # NVIDIA's plugin re-sends the defaults: the running server keeps what it started with.
    sent = mps_daemon.send(
        "set_default_device_pinned_mem_limit 0 1G", "set_default_active_thread_percentage 50"
    )
    assert sent.returncode == 0
    assert mps_daemon.ask("get_default_device_pinned_mem_limit 0") == "1024M"
    started = driver.add_process(H100, 501, 15 * 1024, 60, mps_client=mps_daemon.client())
    assert started["sm_util"] == 25.0
    assert mps_daemon.ask(f"get_device_pinned_mem_limit {server} 0") == "20480M"
    assert mps_daemon.ask(f"get_active_thread_percentage {server}") == "25.0"
    # The per-PID commands change it.
    mps_daemon.send(
        f"set_device_pinned_mem_limit {server} 0 2G", f"set_active_thread_percentage {server} 10"
    )
    with pytest.raises(Refused, match="limit of 2048 MiB"):
        driver.add_process(H100, 502, 3 * 1024, 60, mps_client=mps_daemon.client())
    assert (
        driver.add_process(H100, 502, 2048, 60, mps_client=mps_daemon.client())["sm_util"] == 10.0
    )
    # The clients already running keep theirs.
    assert [p["memory_mib"] for p in driver.processes() if p["pid"] == 501] == [15 * 1024]
    # Another pid is no server of this daemon.
    refused = mps_daemon.send(f"set_active_thread_percentage {int(str(server)) + 1} 10")
    assert refused.returncode == 1


# ----- how many clients a server serves -----------------------------------------------------------
def test_max_clients_follow_nvidias_mps_documentation() -> None:
    assert mps.max_clients(pynvml.NVML_DEVICE_ARCH_PASCAL, 13030) == 16
    assert mps.max_clients(pynvml.NVML_DEVICE_ARCH_VOLTA, 12080) == 48
    assert mps.max_clients(pynvml.NVML_DEVICE_ARCH_HOPPER, CUDA_DRIVER_VERSION) == 48  # 13.0
    assert mps.max_clients(pynvml.NVML_DEVICE_ARCH_HOPPER, 13010) == 60


def test_a_server_serves_at_most_its_most_clients_a_gpu(
    sim: tuple[SimDriver, Nvml], mps_daemon: StandIn
) -> None:
    driver, _ = sim
    most = 60  # CUDA 13.3 (the fixture's driver), a Hopper GPU
    for pid in range(1000, 1000 + most):
        driver.add_process(H100, pid, 1, 1, mps_client=mps_daemon.client())
    with pytest.raises(Refused, match="serves 60 clients on GPU 0") as info:
        driver.add_process(H100, 2000, 1, 1, mps_client=mps_daemon.client())
    assert info.value.cuda_error == "cudaErrorMpsMaxClientsReached"
    driver.add_process(
        H100, 1000, 2, 1, mps_client=mps_daemon.client()
    )  # a client updated: still 60
    driver.add_process(A100, 2000, 1, 1, mps_client=mps_daemon.client())  # another GPU: its own 60
    driver.remove_process(1001)
    assert driver.add_process(H100, 2001, 1, 1, mps_client=mps_daemon.client())["type"] == "mps"


# ----- without a daemon ---------------------------------------------------------------------------
def test_without_a_daemon_a_client_runs_as_a_plain_process(
    sim: tuple[SimDriver, Nvml], tmp_path: Path
) -> None:
    driver, _ = sim
    gone = {"pipe_directory": str(tmp_path / "nobody")}
    started = driver.add_process(H100, 700, 100, 5, mps_client=gone)
    assert started["type"] == "compute"
    # Typed "mps", with no daemon answering: CUDA runs it without MPS all the same.
    assert driver.add_process(H100, 701, 100, 5, kind="mps", mps_client=gone)["type"] == "compute"
    assert not (Path(mps.DEFAULT_PIPE) / "control").exists()  # CUDA's default: no daemon there
    assert driver.add_process(A100, 702, 100, 5, kind="mps")["type"] == "compute"
    assert pynvml.nvmlDeviceGetMPSComputeRunningProcesses_v3(handle(H100)) == []
    with pytest.raises(ValueError, match="absolute path"):
        driver.add_process(H100, 703, 1, 1, mps_client={"pipe_directory": "relative"})
    with pytest.raises(ValueError, match="unknown keys"):
        driver.add_process(H100, 703, 1, 1, mps_client={"pipe_directory": "/x", "limit": 1})


def test_a_process_typed_mps_without_a_daemon_is_refused_by_an_exclusive_gpu(
    sim: tuple[SimDriver, Nvml], mps_daemon: StandIn, tmp_path: Path
) -> None:
    """A server holds the EXCLUSIVE_PROCESS GPU; a process whose daemon does not answer is no
    MPS client, whatever its type: CUDA refuses its context (cudaErrorDevicesUnavailable)."""
    driver, _ = sim
    pynvml.nvmlDeviceSetComputeMode(handle(H100), EXCLUSIVE)
    driver.add_process(H100, 500, 100, 5, mps_client=mps_daemon.client())
    ((_, server),) = server_of(driver)
    gone = {"pipe_directory": str(tmp_path / "nobody")}
    for extra in ({"mps_client": gone}, {}):
        with pytest.raises(Refused, match=f"process {server} holds it") as info:
            driver.add_process(H100, 700, 100, 5, kind="mps", **extra)
        assert info.value.cuda_error == "cudaErrorDevicesUnavailable"


# ----- the reader ---------------------------------------------------------------------------------
@pytest.mark.parametrize("gpu", [H100, A100], ids=["detail-list", "three-lists"])
def test_the_reader_marks_the_server_and_asks_its_name_once(
    sim: tuple[SimDriver, Nvml], mps_daemon: StandIn, gpu: int
) -> None:
    driver, nvml = sim
    reader = ProcessReader(nvml.calls)
    driver.add_process(gpu, 42, 100, 5)  # before any client: no name asked
    first = reader.read(gpu, handle(gpu))
    assert first is not None
    assert [(p.pid, p.mps_server) for p in first.processes] == [(42, False)]
    assert driver.calls["nvmlSystemGetProcessName"] == 0
    driver.add_process(gpu, 500, 1000, 5, mps_client=mps_daemon.client())
    driver.add_process(gpu, 501, 1000, 5, mps_client=mps_daemon.client())
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
