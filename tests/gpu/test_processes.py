"""Per-process readings (``gpuagent.gpu.processes``) through the real pynvml wrappers on the
simulated driver: what is read, which calls are made per poll, and what is absent."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pynvml
import pytest
import structlog.testing
from support.clock import FakeClock
from support.mpsdaemon import StandIn, server_pid

from gpuagent.domain.usage import GpuProcess, ProcessReading, ProcessSample
from gpuagent.gpu.calls import NvmlCalls
from gpuagent.gpu.nvml import Nvml
from gpuagent.gpu.processes import MIN_SAMPLE_ROOM, ProcessReader
from gpuagent.gpu.sim import SimDriver, install, installed, node_from_mapping, uninstall
from gpuagent.gpu.sim._api_process import PROCESS_MODE_ALL_CUDA
from gpuagent.gpu.sim.processes import SAMPLE_PERIOD_US
from gpuagent.gpu.sim.spec import CUDA_DRIVER_VERSION, SimNode

MIB = 1024 * 1024
H100, H100_MIG, A100 = 0, 1, 2


def three_gpus(cuda_driver_version: int = PROCESS_MODE_ALL_CUDA) -> SimNode:
    """An H100, an H100 in MIG mode and an A100; by default on a driver that offers everything
    (the detail list's mode ALL is CUDA 13.3's: an R580 driver refuses it)."""
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
    return replace(node, cuda_driver_version=cuda_driver_version)


@pytest.fixture
def driver(clock: FakeClock, tmp_path: Path) -> Iterator[tuple[SimDriver, ProcessReader]]:
    drv = SimDriver(three_gpus(), clock=clock)
    install(drv)
    nvml = Nvml(sysfs_root=tmp_path)
    try:
        nvml.init()
        nvml.discover()
        yield drv, ProcessReader(nvml.calls)
    finally:
        nvml.shutdown()
        uninstall()


def handle(index: int) -> Any:
    return pynvml.nvmlDeviceGetHandleByIndex(index)


def next_sample(clock: FakeClock) -> None:
    clock.now += SAMPLE_PERIOD_US / 1e6


def test_processes_and_their_samples(
    driver: tuple[SimDriver, ProcessReader], clock: FakeClock
) -> None:
    sim, reader = driver
    sim.add_process(H100, 300, 1024, 30)
    sim.add_process(H100, 301, 2048, 0)
    sim.add_process(H100, 302, 512, 20, kind="graphics")
    reading = reader.read(H100, handle(H100))
    assert reading is not None
    assert reading.processes == (
        GpuProcess(300, 1024 * MIB),
        GpuProcess(301, 2048 * MIB),
        GpuProcess(302, 512 * MIB),
    )
    assert reading.samples is not None
    assert sorted(reading.samples, key=lambda s: s.pid) == [
        ProcessSample(300, 30.0, 15.0, 0.0, 0.0),
        ProcessSample(302, 20.0, 10.0, 0.0, 0.0),
    ]
    # Polled again before the driver's next sample: the GPU has processes but no new samples.
    again = reader.read(H100, handle(H100))
    assert again is not None
    assert again.samples == ()
    next_sample(clock)
    later = reader.read(H100, handle(H100))
    assert later is not None
    assert {s.pid for s in later.samples or ()} == {300, 302}


def test_an_exited_process_is_gone_at_the_next_read(
    driver: tuple[SimDriver, ProcessReader],
) -> None:
    sim, reader = driver
    sim.add_process(H100, 300, 1024, 30)
    first = reader.read(H100, handle(H100))
    assert first is not None
    assert [p.pid for p in first.processes] == [300]
    sim.remove_process(300)
    second = reader.read(H100, handle(H100))
    assert second is not None
    assert second.processes == ()


def test_two_nvml_functions_per_poll(
    driver: tuple[SimDriver, ProcessReader], clock: FakeClock
) -> None:
    """With 50 processes: the list (a sizing call and a reading call) and the utilisation read
    in one call (pynvml's wrapper makes a sizing call first: 2.3 ms more on a real H200)."""
    sim, reader = driver
    for pid in range(1000, 1050):
        sim.add_process(H100, pid, 100, 1)
    for _ in range(3):
        next_sample(clock)
        h = handle(H100)
        before = Counter(sim.calls)
        reading = reader.read(H100, h)
        assert reading is not None
        assert len(reading.processes) == 50
        assert len(reading.samples or ()) == 50
        calls = Counter(sim.calls)
        calls.subtract(before)
        # The list (a sizing call and a reading call), the utilisation read, and with several
        # processes on the GPU the detail list's MPS clients (none: the sizing call alone).
        assert +calls == Counter(
            {"nvmlDeviceGetRunningProcessDetailList": 3, "nvmlDeviceGetProcessesUtilizationInfo": 1}
        )


def test_more_samples_than_room_take_a_second_call(
    driver: tuple[SimDriver, ProcessReader], clock: FakeClock
) -> None:
    """More samples than the room made for them: the driver says how many, the second call
    reads them all; the room grows with the GPU's samples, so the next read takes one call."""
    sim, reader = driver
    for pid in range(2000, 2000 + 3 * MIN_SAMPLE_ROOM):
        sim.add_process(H100, pid, 10, 1)
    counts = []
    for _ in range(2):
        next_sample(clock)
        before = sim.calls["nvmlDeviceGetProcessesUtilizationInfo"]
        reading = reader.read(H100, handle(H100))
        assert reading is not None
        assert len(reading.samples or ()) == 3 * MIN_SAMPLE_ROOM
        counts.append(sim.calls["nvmlDeviceGetProcessesUtilizationInfo"] - before)
    assert counts == [2, 1]


def test_an_idle_gpu_asks_for_utilisation_once(
    driver: tuple[SimDriver, ProcessReader], clock: FakeClock
) -> None:
    """Without a process, the utilisation read (2.3-2.9 ms on a real H200, answering NOT_FOUND)
    is made once, to learn that the GPU offers it; then only the list (0.01 ms) until a process
    runs, whose samples are read from then on."""
    sim, reader = driver
    h = handle(H100)
    per_read = []
    for _ in range(4):
        next_sample(clock)
        before = Counter(sim.calls)
        reading = reader.read(H100, h)
        assert reading is not None
        assert (reading.processes, reading.samples) == ((), ())
        calls = Counter(sim.calls)
        calls.subtract(before)
        per_read.append(+calls)
    list_call = Counter({"nvmlDeviceGetRunningProcessDetailList": 1})
    assert (
        per_read
        == [list_call + Counter({"nvmlDeviceGetProcessesUtilizationInfo": 1})] + [list_call] * 3
    )
    sim.add_process(H100, 300, 1024, 30)
    next_sample(clock)
    reading = reader.read(H100, h)
    assert reading is not None
    assert [s.pid for s in reading.samples or ()] == [300]
    sim.remove_process(300)
    asked = sim.calls["nvmlDeviceGetProcessesUtilizationInfo"]
    assert reader.read(H100, h) == ProcessReading(processes=(), samples=())
    assert sim.calls["nvmlDeviceGetProcessesUtilizationInfo"] == asked


def test_no_sample_since_the_last_is_an_answer_not_an_error(
    driver: tuple[SimDriver, ProcessReader],
) -> None:
    """A utilisation read answering NOT_FOUND ("no sample since": here a process that used no
    SM time) is not counted as a failed NVML call (what gpuagent_nvml_calls_total{result="error"}
    sums)."""
    sim, _ = driver
    sim.add_process(H100, 300, 1024, 0)
    calls = NvmlCalls()
    reader = ProcessReader(calls)
    for _ in range(3):
        assert reader.read(H100, handle(H100)) is not None
    utilisation = dict(calls.stats())["nvmlDeviceGetProcessesUtilizationInfo"]
    assert (utilisation.count, utilisation.errors) == (3, 0)
    sim.inject(H100, "call_error", symbol="nvmlDeviceGetProcessesUtilizationInfo", error="unknown")
    assert reader.read(H100, handle(H100)) is not None
    assert dict(calls.stats())["nvmlDeviceGetProcessesUtilizationInfo"].errors == 1


def test_older_gpus_read_the_three_lists_merging_a_process_in_two(
    driver: tuple[SimDriver, ProcessReader], mps_daemon: StandIn
) -> None:
    sim, reader = driver
    sim.add_process(A100, 40, 300, 10)
    sim.add_process(A100, 41, 100, 10, mps_client={"pipe_directory": str(mps_daemon.pipe)})
    with structlog.testing.capture_logs() as logs:
        reading = reader.read(A100, handle(A100))
        reader.read(A100, handle(A100))
    assert reading is not None
    # The client once (in the compute and MPS lists both), and its server.
    assert [(p.pid, p.mps_server) for p in reading.processes] == [
        (40, False),
        (41, False),
        (server_pid(sim), True),
    ]
    switched = [e for e in logs if "no process detail list" in e["event"]]
    assert len(switched) == 1
    before = Counter(sim.calls)
    reader.read(A100, handle(A100))
    calls = Counter(sim.calls)
    calls.subtract(before)
    assert calls["nvmlDeviceGetRunningProcessDetailList"] == 0
    assert calls["nvmlDeviceGetComputeRunningProcesses_v3"] >= 1
    assert calls["nvmlDeviceGetMPSComputeRunningProcesses_v3"] >= 1


def test_an_r580_driver_refuses_mode_all_and_the_lists_are_read(
    clock: FakeClock, tmp_path: Path, mps_daemon: StandIn
) -> None:
    """The built-in driver is R580 (CUDA 13.0), like the real H200 node: mode ALL answers
    INVALID_ARGUMENT there, and the reader reads the three lists from then on (an MPS client,
    in the compute and MPS lists both, is one process)."""
    with installed(SimDriver(three_gpus(CUDA_DRIVER_VERSION), clock=clock)) as sim:
        nvml = Nvml(sysfs_root=tmp_path)
        nvml.init()
        try:
            nvml.discover()
            reader = ProcessReader(nvml.calls)
            sim.add_process(H100, 40, 300, 10)
            sim.add_process(H100, 41, 100, 10, mps_client={"pipe_directory": str(mps_daemon.pipe)})
            for _ in range(2):
                reading = reader.read(H100, handle(H100))
                assert reading is not None
                assert [p.pid for p in reading.processes] == [40, 41, server_pid(sim)]
        finally:
            nvml.shutdown()
    assert sim.calls["nvmlDeviceGetRunningProcessDetailList"] == 1


def test_duplicate_pid_in_two_lists_is_one_process() -> None:
    from gpuagent.gpu.processes import _merged  # noqa: PLC0415

    class Info:
        def __init__(self, pid: int, memory: int | None) -> None:
            self.pid, self.usedGpuMemory = pid, memory
            self.gpuInstanceId = self.computeInstanceId = 0xFFFF_FFFF

    merged = _merged([Info(7, 100), Info(7, 300), Info(8, None), Info(8, 50)])
    assert merged == (GpuProcess(7, 300), GpuProcess(8, 50))


def test_old_driver_without_the_newer_utilisation_call(
    driver: tuple[SimDriver, ProcessReader],
) -> None:
    sim, reader = driver
    sim.remove("nvmlDeviceGetProcessesUtilizationInfo")
    sim.add_process(H100, 300, 1024, 30)
    reading = reader.read(H100, handle(H100))
    assert reading is not None
    assert reading.samples == (ProcessSample(300, 30.0, 15.0, 0.0, 0.0),)
    assert sim.calls["nvmlDeviceGetProcessUtilization"] == 2


def test_mig_processes_carry_instances_and_have_no_samples(
    driver: tuple[SimDriver, ProcessReader],
) -> None:
    sim, reader = driver
    gis = [m.gpu_instance_id for m in sim.node.gpus[H100_MIG].mig_devices]
    sim.add_process(H100_MIG, 500, 1000, 50, gpu_instance=gis[0])
    sim.add_process(H100_MIG, 501, 500, 50, gpu_instance=gis[1])
    with structlog.testing.capture_logs() as logs:
        reading = reader.read(H100_MIG, handle(H100_MIG))
    assert reading is not None
    assert [(p.pid, p.gpu_instance, p.compute_instance) for p in reading.processes] == [
        (500, gis[0], 0),
        (501, gis[1], 0),
    ]
    assert reading.samples is None
    assert any(e.get("call") == "nvmlDeviceGetProcessesUtilizationInfo" for e in logs)
    before = sim.calls["nvmlDeviceGetProcessesUtilizationInfo"]
    reader.read(H100_MIG, handle(H100_MIG))
    assert sim.calls["nvmlDeviceGetProcessesUtilizationInfo"] == before  # not asked again


def test_a_lost_gpu_raises(driver: tuple[SimDriver, ProcessReader]) -> None:
    sim, reader = driver
    sim.inject(H100, "lost")
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        reader.read(H100, handle(H100))


@pytest.mark.parametrize(
    "symbol", ["nvmlDeviceGetRunningProcessDetailList", "nvmlDeviceGetProcessesUtilizationInfo"]
)
def test_other_errors_leave_the_part_out_and_are_logged_once(
    driver: tuple[SimDriver, ProcessReader], symbol: str
) -> None:
    sim, reader = driver
    sim.add_process(H100, 300, 1024, 30)
    sim.fail(symbol, int(pynvml.NVML_ERROR_UNKNOWN), gpu=H100)
    with structlog.testing.capture_logs() as logs:
        first = reader.read(H100, handle(H100))
        reader.read(H100, handle(H100))
    if symbol == "nvmlDeviceGetRunningProcessDetailList":
        assert first is None
    else:
        assert first is not None
        assert first.samples is None
        assert [p.pid for p in first.processes] == [300]
    assert sum(e["event"] == "per-process reading failed; left out" for e in logs) == 1
    sim.clear_failures()
    assert reader.read(H100, handle(H100)) is not None
