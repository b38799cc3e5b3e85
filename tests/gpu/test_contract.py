"""Contract tests: the same assertions on the simulated driver and, where this machine has one, on
the real NVIDIA driver (``libnvidia-ml.so.1`` through pynvml, no fault injection).

They pin what the simulator must share with real hardware for the backend's sake: the shape of
what discovery reports, the ranges and units of telemetry, GPM pairing, and the event wait's
timeout. Without a loadable real driver the ``real`` cases skip (here only).
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pynvml
import pytest
import structlog.testing
from support.clock import FakeClock

from gpuagent.domain.devices import Gpu, Telemetry
from gpuagent.domain.health import Responding
from gpuagent.gpu.gpm import GPM_METRICS
from gpuagent.gpu.nvml import Nvml
from gpuagent.gpu.sim import SimDriver, install, node_from_count, uninstall

UUID = re.compile(r"^GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
BUS_ID = re.compile(r"^[0-9A-F]{8}:[0-9A-F]{2}:[0-9A-F]{2}\.[0-7]$")
GPM_FIELDS = frozenset(name for _, name, _ in GPM_METRICS)
RATIOS = ("gr_engine_active", "sm_active", "sm_occupancy", "tensor_active", "dram_active")
PERCENTS = ("gpu_util_pct", "mem_util_pct", "enc_util_pct", "dec_util_pct")
COUNTERS = (
    "energy_mj",
    "pcie_replays",
    "nvlink_bandwidth_total",
    "remapped_rows_correctable",
    "remapped_rows_uncorrectable",
    "ecc_sbe_volatile",
    "ecc_dbe_volatile",
)
# Every GPU this agent targets (Volta and newer, datacenter) offers these.
ALWAYS = ("temperature_c", "power_w", "energy_mj", "sm_clock_mhz", "mem_clock_mhz", "fb_used_mib")


@dataclass
class Subject:
    """A driver under contract: a backend that has initialised it and discovered its GPUs."""

    kind: str
    nvml: Nvml
    gpus: list[Gpu]
    advance: Callable[[float], None]  # let this much time pass, as that driver sees time
    closed: bool = False


def _real_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    """Point pynvml at the host's libnvidia-ml (restored afterwards), or skip without one."""
    monkeypatch.setattr(pynvml, "nvmlLib", None)
    monkeypatch.setattr(pynvml, "_nvmlGetFunctionPointer_cache", {})
    monkeypatch.setattr(pynvml, "_nvmlLib_refcount", 0)
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        pytest.skip(f"no real NVIDIA driver on this machine: {exc}")
    pynvml.nvmlShutdown()


@pytest.fixture(params=["sim", "real"])
def driver(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> Iterator[Subject]:
    """The simulated driver (4 H100s), then the real one where it loads."""
    clock = FakeClock(100.0)

    def advance(seconds: float) -> None:
        if request.param == "sim":
            clock.now += seconds
        else:
            time.sleep(seconds)

    if request.param == "sim":
        install(SimDriver(node_from_count(4), clock=clock))
        nvml = Nvml(sysfs_root=tmp_path)
    else:
        _real_driver(monkeypatch)
        nvml = Nvml()
    subject = Subject(request.param, nvml, [], advance)
    try:
        nvml.init()
        subject.gpus = nvml.discover()
        yield subject
    finally:
        if not subject.closed:
            nvml.shutdown()
        if request.param == "sim":
            uninstall()


def present(telemetry: Telemetry) -> dict[str, float]:
    return {
        f.name: value
        for f in dataclasses.fields(telemetry)
        if (value := getattr(telemetry, f.name)) is not None
    }


def test_discovery_shapes(driver: Subject) -> None:
    """Every GPU: index in order, a GPU-UUID, an NVML bus id, memory, a name, healthy."""
    assert driver.gpus
    assert [g.index for g in driver.gpus] == list(range(len(driver.gpus)))
    assert len({g.uuid for g in driver.gpus}) == len(driver.gpus)
    assert len({g.pci_bus_id for g in driver.gpus}) == len(driver.gpus)
    for gpu in driver.gpus:
        assert UUID.match(gpu.uuid), gpu.uuid
        assert BUS_ID.match(gpu.pci_bus_id), gpu.pci_bus_id
        assert gpu.memory_mib > 0
        assert gpu.name.strip()
        assert gpu.name.startswith("NVIDIA")
        assert gpu.minor >= 0
        assert gpu.numa_node is None or gpu.numa_node >= 0
        assert gpu.health.healthy, gpu.health.reason
        assert gpu.device_node == f"/dev/nvidia{gpu.minor}"


def test_mig_capable_is_the_mig_mode_call_answering(driver: Subject) -> None:
    """Each GPU's ``mig_capable`` is whether ``nvmlDeviceGetMigMode`` answers it (GFD's test)."""
    for gpu in driver.gpus:
        handle = pynvml.nvmlDeviceGetHandleByIndex(gpu.index)
        code = pynvml.NVML_SUCCESS
        try:
            pynvml.nvmlDeviceGetMigMode(handle)
        except pynvml.NVMLError as exc:
            code = exc.value
        assert code in {pynvml.NVML_SUCCESS, pynvml.NVML_ERROR_NOT_SUPPORTED}, code
        assert gpu.mig_capable is (code == pynvml.NVML_SUCCESS), gpu.name
        assert gpu.mig_capable or not gpu.mig_enabled


def test_telemetry_ranges(driver: Subject) -> None:
    """Probes answer; values are in their units and ranges; counters do not fall; GPM pairs."""
    first = {g.index: driver.nvml.probe(g.index) for g in driver.gpus}
    driver.advance(0.5)
    second = {g.index: driver.nvml.probe(g.index) for g in driver.gpus}
    for gpu in driver.gpus:
        before, after = first[gpu.index], second[gpu.index]
        assert before.events == after.events == (Responding(),)
        t = present(after.telemetry)
        for name in ALWAYS:
            assert name in t, name
        # GPM has no pair on the first probe; it does on the second wherever it exists at all.
        assert not GPM_FIELDS & present(before.telemetry).keys()
        gpm = GPM_FIELDS & t.keys()
        assert gpm in (set(), set(GPM_FIELDS))
        assert 0 < t["temperature_c"] <= 200
        if "memory_temperature_c" in t:
            assert 0 < t["memory_temperature_c"] <= 200
        assert 1 <= t["power_w"] <= 2000  # watts, not milliwatts
        assert 0 < t["sm_clock_mhz"] <= 5000
        assert 0 < t["mem_clock_mhz"] <= 20000
        for name in PERCENTS:
            if name in t:
                assert 0 <= t[name] <= 100, name
        for name in RATIOS:
            if name in t:
                assert 0 <= t[name] <= 1, name
        for name in ("pcie_tx_bytes", "pcie_rx_bytes"):
            if name in t:
                assert 0 <= t[name] < 1e12, name  # bytes/s, below 1 TB/s
        memory = sum(t.get(k, 0.0) for k in ("fb_used_mib", "fb_free_mib", "fb_reserved_mib"))
        assert memory <= gpu.memory_mib + 1  # MiB, not bytes
        assert t.get("fb_free_mib", 0.0) >= 0
        for name in ("row_remap_pending", "row_remap_failure"):
            if name in t:
                assert t[name] in (0, 1), name
        earlier = present(before.telemetry)
        for name in COUNTERS:
            if name in t:
                assert t[name] >= 0, name
                if name in earlier:
                    assert t[name] >= earlier[name], name
        assert t["energy_mj"] > 0


def test_event_wait_times_out(driver: Subject) -> None:
    """With no fault, a wait blocks for its timeout and returns None; so does a zero wait."""
    assert driver.nvml.open_events() == {}
    started = time.monotonic()
    assert driver.nvml.wait_event(200) is None
    # A lower bound only (load can lengthen a wait, never shorten it): the wait did block.
    assert time.monotonic() - started >= 0.15
    assert driver.nvml.wait_event(0) is None


def test_shutdown_frees_everything(driver: Subject) -> None:
    """After probes with GPM samples and an event set, shutdown releases all without a warning."""
    driver.nvml.open_events()
    for _ in range(2):
        for gpu in driver.gpus:
            driver.nvml.probe(gpu.index)
        driver.advance(0.2)
    with structlog.testing.capture_logs() as logs:
        driver.nvml.shutdown()
    driver.closed = True
    assert [e for e in logs if e["log_level"] in ("warning", "error")] == []
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        pynvml.nvmlDeviceGetCount()


def test_process_readings(driver: Subject) -> None:
    """Per-process readings are offered on every GPU (an empty list on an idle one); a process
    appears once per (pid, instance) with its memory in bytes; GPU and compute instances only on
    MIG; utilisation samples, where offered, are percentages (or () when nothing ran)."""
    for gpu in driver.gpus:
        driver.nvml.probe(gpu.index)  # the first read sets the samples' starting point
    driver.advance(0.5)
    for gpu in driver.gpus:
        probe = driver.nvml.probe(gpu.index)
        assert probe.events == (Responding(),)
        reading = probe.processes
        assert reading is not None, "no process list offered"
        keys = [(p.pid, p.gpu_instance, p.compute_instance) for p in reading.processes]
        assert len(keys) == len(set(keys))
        for process in reading.processes:
            assert process.pid > 0
            memory = process.used_memory_bytes
            assert memory is None or 0 <= memory <= gpu.memory_mib * 1024 * 1024
            assert (process.gpu_instance is not None) == gpu.mig_enabled
        if gpu.mig_enabled:
            assert reading.samples is None  # nvml.h: not supported on MIG-enabled GPUs
        for sample in reading.samples or ():
            assert sample.pid > 0
            for value in (sample.sm_pct, sample.mem_pct, sample.enc_pct, sample.dec_pct):
                assert 0 <= value <= 100
