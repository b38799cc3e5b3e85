"""Telemetry through the real pynvml wrappers (``Nvml.probe`` → ``gpuagent.gpu.telemetry``) on the
simulated driver: every field, its unit, batching, GPM pairs and what is absent."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pynvml
import pytest
import structlog.testing
from support.clock import FakeClock

from gpuagent.domain.devices import Telemetry
from gpuagent.domain.health import GpuLost, Responding
from gpuagent.gpu.gpm import GPM_METRICS
from gpuagent.gpu.nvml import Nvml
from gpuagent.gpu.sim import (
    SimDriver,
    _api_device,
    install,
    node_from_count,
    node_from_mapping,
    uninstall,
)
from gpuagent.gpu.sim import telemetry as sim_telemetry
from gpuagent.gpu.telemetry import FIELDS, TelemetryReader

MIB = 1024 * 1024
GPUS = 4
START = 1000.0
ABSENT_LOG = "value not offered by this gpu or driver"
SLOT_LOG = "nvml value unreadable; left out"
FAILED_LOG = "nvml call failed; value left out"
NOT_SUPPORTED = int(pynvml.NVML_ERROR_NOT_SUPPORTED)
FUNCTION_NOT_FOUND = int(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
GPU_IS_LOST = int(pynvml.NVML_ERROR_GPU_IS_LOST)
UNKNOWN = int(pynvml.NVML_ERROR_UNKNOWN)

GPM_FIELDS = frozenset(name for _, name, _ in GPM_METRICS)
# Every field a probe reads (the NVLink bandwidth is the poller's rate from two probes).
ALL_FIELDS = frozenset(f.name for f in dataclasses.fields(Telemetry)) - {"nvlink_bandwidth_total"}
# The values only the one nvmlDeviceGetFieldValues call carries (the others have a call of their
# own, read where the field value is missing: row remapping, PCIe replays, ECC, violations).
FIELD_BASED = frozenset(
    {
        "memory_temperature_c",
        "nvlink_crc_flit_errors",
        "nvlink_crc_data_errors",
        "nvlink_replay_errors",
        "nvlink_recovery_errors",
    }
)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(START)


@contextlib.contextmanager
def ready(node: Any, clock: FakeClock, tmp_path: Path) -> Iterator[tuple[SimDriver, Nvml]]:
    """``node``'s simulated driver installed and a backend that has discovered its GPUs."""
    drv = SimDriver(node, clock=clock)
    install(drv)
    backend = Nvml(sysfs_root=tmp_path, clock=clock)
    try:
        backend.init()
        backend.discover()
        yield drv, backend
    finally:
        backend.shutdown()
        uninstall()


@pytest.fixture
def sim(clock: FakeClock, tmp_path: Path) -> Iterator[tuple[SimDriver, Nvml]]:
    """A 4-GPU H100 node (all pairs on NVLink) and a backend that has discovered it."""
    with ready(node_from_count(GPUS), clock, tmp_path) as pair:
        yield pair


@pytest.fixture
def driver(sim: tuple[SimDriver, Nvml]) -> SimDriver:
    return sim[0]


@pytest.fixture
def nvml(sim: tuple[SimDriver, Nvml]) -> Nvml:
    return sim[1]


def model(driver: SimDriver, index: int, t: float, previous: float | None) -> Telemetry:
    """What a probe at driver time ``t`` must read, by the simulator's own model.

    ``previous`` is the driver time of the GPU's previous probe (the GPM interval), if any.
    """
    spec = driver.node.gpus[index]
    s = sim_telemetry.sample(spec.profile, index, spec.memory_mib, t)
    gpm: dict[str, float | None] = {}
    if previous is not None:
        p = sim_telemetry.sample(spec.profile, index, spec.memory_mib, previous)
        for metric_id, name, _ in GPM_METRICS:
            value = sim_telemetry.gpm_value(metric_id, p, s)
            per_sec = metric_id in (
                pynvml.NVML_GPM_METRIC_PCIE_TX_PER_SEC,
                pynvml.NVML_GPM_METRIC_PCIE_RX_PER_SEC,
            )
            gpm[name] = value * MIB if per_sec else value / 100
    return Telemetry(
        temperature_c=s.temperature_c,
        memory_temperature_c=s.memory_temperature_c,
        power_w=s.power_mw / 1000,
        energy_mj=s.energy_mj,
        sm_clock_mhz=s.sm_clock_mhz,
        mem_clock_mhz=s.mem_clock_mhz,
        gpu_util_pct=s.gpu_util_pct,
        mem_util_pct=s.mem_util_pct,
        enc_util_pct=s.enc_util_pct,
        dec_util_pct=s.dec_util_pct,
        fb_used_mib=s.fb_used_bytes // MIB,  # whole MiB, as DCGM reports them
        fb_free_mib=s.fb_free_bytes // MIB,
        fb_reserved_mib=s.fb_reserved_bytes // MIB,
        pcie_replays=s.pcie_replays,
        remapped_rows_correctable=0,
        remapped_rows_uncorrectable=0,
        row_remap_pending=0,
        row_remap_failure=0,
        ecc_sbe_volatile=0,
        ecc_dbe_volatile=0,
        # Never throttled, and no NVLink errors, in the simulator.
        power_violation_ns=0,
        thermal_violation_ns=0,
        nvlink_crc_flit_errors=0,
        nvlink_crc_data_errors=0,
        nvlink_replay_errors=0,
        nvlink_recovery_errors=0,
        **gpm,
    )


def missing(telemetry: Telemetry) -> set[str]:
    return {name for name in ALL_FIELDS if getattr(telemetry, name) is None}


def absent_logs(logs: Sequence[Mapping[str, Any]]) -> list[tuple[int, str]]:
    return sorted((e["gpu"], e["call"]) for e in logs if e["event"] == ABSENT_LOG)


def two_probes(nvml: Nvml, clock: FakeClock, index: int, step: float = 30.0) -> Telemetry:
    """Probe, let ``step`` seconds pass, probe again: the second probe's telemetry."""
    assert nvml.probe(index).events == (Responding(),)
    clock.now += step
    probe = nvml.probe(index)
    assert probe.events == (Responding(),)
    return probe.telemetry


# ----- values and units --------------------------------------------------------------------------
class TestValues:
    @pytest.mark.parametrize("index", [0, 2])
    def test_every_field_matches_the_model(
        self, nvml: Nvml, driver: SimDriver, clock: FakeClock, index: int
    ) -> None:
        """On an H100 every Telemetry field is present and equals the simulator's model."""
        clock.now += 42.0
        first = nvml.probe(index).telemetry
        assert first == model(driver, index, 42.0, None)
        clock.now += 30.0
        second = nvml.probe(index).telemetry
        assert missing(second) == set()
        want = model(driver, index, 72.0, 42.0)
        got, expected = dataclasses.asdict(second), dataclasses.asdict(want)
        assert got.pop("nvlink_bandwidth_total") is expected.pop("nvlink_bandwidth_total") is None
        assert got == pytest.approx(expected, rel=1e-12)

    def test_units(self, nvml: Nvml, driver: SimDriver, clock: FakeClock) -> None:
        """W not mW, MiB not bytes, ratios in 0..1, PCIe in bytes/s, NVLink in MiB."""
        for index in range(GPUS):
            t = two_probes(nvml, clock, index, step=17.0)
            assert t.power_w is not None
            assert 50 <= t.power_w <= 700
            for name in ("fb_used_mib", "fb_free_mib", "fb_reserved_mib"):
                value = getattr(t, name)
                assert value is not None
                assert 1 <= value <= 81559, name
            assert t.fb_used_mib is not None
            assert t.fb_free_mib is not None
            assert t.fb_reserved_mib is not None
            total = t.fb_used_mib + t.fb_free_mib + t.fb_reserved_mib
            memory = driver.node.gpus[index].memory_mib
            assert memory - 3 <= total <= memory  # three values, each rounded down
            assert all(float(v).is_integer() for v in (t.fb_used_mib, t.fb_free_mib))
            for name in ("gpu_util_pct", "mem_util_pct", "enc_util_pct", "dec_util_pct"):
                value = getattr(t, name)
                assert value is not None
                assert 0 <= value <= 100, name
            for name in ("gr_engine_active", "sm_active", "sm_occupancy", "tensor_active"):
                value = getattr(t, name)
                assert value is not None
                assert 0 < value < 1, name
            assert t.dram_active is not None
            assert 0 < t.dram_active < 1
            # Hundreds of MiB/s to a few GiB/s, in bytes.
            assert t.pcie_tx_bytes is not None
            assert t.pcie_rx_bytes is not None
            assert 100 * MIB < t.pcie_tx_bytes < 10_000 * MIB
            assert 100 * MIB < t.pcie_rx_bytes < 10_000 * MIB
            assert t.temperature_c is not None
            assert t.memory_temperature_c is not None
            assert 20 <= t.temperature_c < t.memory_temperature_c <= 110

    def test_nvlink_counter_is_all_links(self, nvml: Nvml, driver: SimDriver) -> None:
        """The NVLink counter is TX + RX over every link (scopeId UINT_MAX), in KiB."""
        handle = pynvml.nvmlDeviceGetHandleByIndex(1)
        all_links = 0xFFFF_FFFF
        tx, rx = pynvml.nvmlDeviceGetFieldValues(
            handle,
            [
                (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, all_links),
                (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, all_links),
            ],
        )
        (link0,) = pynvml.nvmlDeviceGetFieldValues(
            handle, [pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX]
        )
        assert link0.value.ullVal < tx.value.ullVal  # scope 0 is one link, not the total
        probe = nvml.probe(1)
        assert probe.nvlink_kib == tx.value.ullVal + rx.value.ullVal
        assert probe.telemetry.nvlink_bandwidth_total is None  # the poller's rate

    def test_counters_only_grow(self, nvml: Nvml, clock: FakeClock) -> None:
        """Energy and NVLink traffic grow with every probe; PCIe replays never fall."""
        readings = []
        links = []
        for _ in range(40):
            clock.now += 50.0
            probe = nvml.probe(3)
            readings.append(probe.telemetry)
            links.append(probe.nvlink_kib)
        assert all(a is not None and b is not None and a < b for a, b in itertools.pairwise(links))
        for before, after in itertools.pairwise(readings):
            assert before.energy_mj is not None
            assert after.energy_mj is not None
            assert before.energy_mj < after.energy_mj
            assert before.pcie_replays is not None
            assert after.pcie_replays is not None
            assert before.pcie_replays <= after.pcie_replays
        assert readings[0].pcie_replays != readings[-1].pcie_replays

    def test_ecc_dbe_counts_faults(self, nvml: Nvml, driver: SimDriver) -> None:
        """The volatile DBE total is the driver's: 0, then 1 after an injected ECC DBE."""
        assert nvml.probe(2).telemetry.ecc_dbe_volatile == 0
        driver.inject(2, "ecc_dbe")
        t = nvml.probe(2).telemetry
        assert t.ecc_dbe_volatile == 1
        assert t.ecc_sbe_volatile == 0

    def test_temperatures_above_200_are_dropped(
        self, nvml: Nvml, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Sensor readings above 200 °C are discarded (as DCGM does); others are kept."""
        real = sim_telemetry.sample

        def hot(*args: Any) -> sim_telemetry.Sample:
            return dataclasses.replace(real(*args), temperature_c=201, memory_temperature_c=255)

        monkeypatch.setattr(sim_telemetry, "sample", hot)
        t = nvml.probe(0).telemetry
        assert t.temperature_c is None
        assert t.memory_temperature_c is None
        assert t.power_w is not None

        def warm(*args: Any) -> sim_telemetry.Sample:
            return dataclasses.replace(real(*args), temperature_c=200, memory_temperature_c=199)

        monkeypatch.setattr(sim_telemetry, "sample", warm)
        t = nvml.probe(0).telemetry
        assert (t.temperature_c, t.memory_temperature_c) == (200, 199)


# ----- what is absent ----------------------------------------------------------------------------
class TestAbsent:
    @pytest.mark.parametrize(
        ("symbol", "how", "absent"),
        [
            ("nvmlDeviceGetEncoderUtilization", "not_supported", {"enc_util_pct"}),
            ("nvmlDeviceGetDecoderUtilization", "removed", {"dec_util_pct"}),
            ("nvmlDeviceGetFieldValues", "not_supported", FIELD_BASED),
            ("nvmlDeviceGetFieldValues", "removed", FIELD_BASED),
            ("nvmlGpmQueryDeviceSupport", "removed", GPM_FIELDS),
            ("nvmlGpmQueryDeviceSupport", "not_supported", GPM_FIELDS),
            ("nvmlGpmSampleGet", "not_supported", GPM_FIELDS),
            ("nvmlGpmSampleAlloc", "removed", GPM_FIELDS),
            ("nvmlGpmMetricsGet", "removed", GPM_FIELDS),
        ],
    )
    def test_call_not_offered(
        self,
        nvml: Nvml,
        driver: SimDriver,
        clock: FakeClock,
        symbol: str,
        how: str,
        absent: frozenset[str],
    ) -> None:
        """A call the GPU or driver lacks leaves exactly its values absent, logged once."""
        if how == "removed":
            driver.remove(symbol)
        else:
            driver.fail(symbol, NOT_SUPPORTED)
        with structlog.testing.capture_logs() as logs:
            readings = []
            for _ in range(3):
                clock.now += 10.0
                probe = nvml.probe(1)
                assert probe.events == (Responding(),)
                readings.append(probe.telemetry)
        assert missing(readings[-1]) == set(absent)
        logged = absent_logs(logs)
        assert len(logged) == 1
        assert logged[0][0] == 1

    @pytest.mark.parametrize(
        ("field_id", "absent"),
        [
            (pynvml.NVML_FI_DEV_MEMORY_TEMP, {"memory_temperature_c"}),
            (pynvml.NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL, {"nvlink_crc_flit_errors"}),
            # Read by a call of its own instead: never absent for want of a field value.
            (pynvml.NVML_FI_DEV_PCIE_REPLAY_COUNTER, set()),
            (pynvml.NVML_FI_DEV_ECC_SBE_VOL_TOTAL, set()),
            (pynvml.NVML_FI_DEV_ECC_DBE_VOL_TOTAL, set()),
            (pynvml.NVML_FI_DEV_PERF_POLICY_THERMAL, set()),
            (pynvml.NVML_FI_DEV_REMAPPED_PENDING, set()),
        ],
    )
    def test_field_slot_not_supported(
        self,
        nvml: Nvml,
        clock: FakeClock,
        monkeypatch: pytest.MonkeyPatch,
        field_id: int,
        absent: set[str],
    ) -> None:
        """A field whose slot says NOT_SUPPORTED is absent on that GPU only, logged once."""
        real = _api_device._field

        def lacking(st: Any, gpu: Any, fid: int, *rest: Any) -> Any:
            if gpu.index == 2 and fid == field_id:
                return None  # the simulated driver answers NOT_SUPPORTED in that slot
            return real(st, gpu, fid, *rest)

        monkeypatch.setattr(_api_device, "_field", lacking)
        with structlog.testing.capture_logs() as logs:
            for _ in range(3):
                clock.now += 10.0
                probes = [nvml.probe(i) for i in range(GPUS)]
        assert all(p.events == (Responding(),) for p in probes)
        assert missing(probes[2].telemetry) == absent
        assert all(missing(p.telemetry) == set() for i, p in enumerate(probes) if i != 2)
        key = next(k for k, fid, _ in FIELDS if fid == field_id)
        assert absent_logs(logs) == [(2, f"nvmlDeviceGetFieldValues:{key}")]

    def test_field_slot_other_error(
        self, nvml: Nvml, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A slot failing otherwise is absent and warned about once, not a failed probe."""
        real = _api_device._field

        def failing(st: Any, gpu: Any, fid: int, *rest: Any) -> Any:
            if fid == pynvml.NVML_FI_DEV_MEMORY_TEMP:
                return UNKNOWN
            return real(st, gpu, fid, *rest)

        monkeypatch.setattr(_api_device, "_field", failing)
        with structlog.testing.capture_logs() as logs:
            nvml.probe(0)  # GPM's first sample
            for _ in range(3):
                clock.now += 10.0
                probe = nvml.probe(0)
                assert probe.events == (Responding(),)
                assert missing(probe.telemetry) == {"memory_temperature_c"}
        warnings = [(e["gpu"], e["call"]) for e in logs if e["event"] == SLOT_LOG]
        assert warnings == [(0, "nvmlDeviceGetFieldValues:memory_temperature")]
        errors = dict(nvml.calls.stats())["nvmlDeviceGetFieldValues:memory_temperature"].errors
        assert errors == 4

    def test_field_slot_lost_gpu_is_lost(self, nvml: Nvml, monkeypatch: pytest.MonkeyPatch) -> None:
        """A slot reporting a lost GPU makes the probe report the GPU lost."""
        real = _api_device._field

        def lost(st: Any, gpu: Any, fid: int, *rest: Any) -> Any:
            return GPU_IS_LOST if gpu.index == 3 else real(st, gpu, fid, *rest)

        monkeypatch.setattr(_api_device, "_field", lost)
        assert nvml.probe(3).events == (GpuLost(),)
        assert nvml.probe(2).events == (Responding(),)

    def test_field_values_failing_leaves_them_absent(self, nvml: Nvml, driver: SimDriver) -> None:
        """The batch failing for another reason leaves its values absent; the GPU answers."""
        driver.fail("nvmlDeviceGetFieldValues", UNKNOWN, gpu=1)
        probe = nvml.probe(1)
        assert probe.events == (Responding(),)
        assert probe.recovery_action is None
        assert missing(probe.telemetry) >= FIELD_BASED
        assert probe.telemetry.row_remap_failure == 0  # through nvmlDeviceGetRemappedRows
        assert nvml.probe(0).events == (Responding(),)

    @pytest.mark.parametrize("how", ["removed", "not_supported"])
    def test_memory_v1(self, nvml: Nvml, driver: SimDriver, clock: FakeClock, how: str) -> None:
        """Without memory info v2: used includes the reservation, reserved is absent; v2 is
        asked only once."""
        if how == "removed":
            driver.remove("nvmlDeviceGetMemoryInfo_v2")
        else:
            driver.fail("nvmlDeviceGetMemoryInfo_v2", NOT_SUPPORTED)
        before = driver.calls["nvmlDeviceGetMemoryInfo_v2"]
        for _ in range(3):
            clock.now += 5.0
            t = nvml.probe(0).telemetry
        assert driver.calls["nvmlDeviceGetMemoryInfo_v2"] - before == 1
        spec = driver.node.gpus[0]
        s = sim_telemetry.sample(spec.profile, 0, spec.memory_mib, clock.now - START)
        assert t.fb_reserved_mib is None
        assert t.fb_used_mib == (s.fb_used_bytes + s.fb_reserved_bytes) // MIB
        assert t.fb_free_mib == s.fb_free_bytes // MIB


# ----- GPM ---------------------------------------------------------------------------------------
class TestGpm:
    def test_absent_first_present_second(self, nvml: Nvml, clock: FakeClock) -> None:
        """The first probe has no pair of samples; from the second on every GPM value is there."""
        first = nvml.probe(0).telemetry
        assert missing(first) == set(GPM_FIELDS)
        for _ in range(3):
            clock.now += 5.0
            assert missing(nvml.probe(0).telemetry) == set()

    def test_each_gpu_pairs_its_own_samples(
        self, nvml: Nvml, driver: SimDriver, clock: FakeClock
    ) -> None:
        """GPU 1's interval is from its own previous probe, however GPU 0 was probed."""
        nvml.probe(1)
        clock.now += 10.0
        nvml.probe(0)
        clock.now += 20.0
        got = nvml.probe(1).telemetry
        want = model(driver, 1, 30.0, 0.0)
        assert got.sm_active == pytest.approx(want.sm_active, rel=1e-12)
        assert got.sm_active != pytest.approx(model(driver, 1, 30.0, 10.0).sm_active, rel=1e-6)

    def test_no_sample_closer_than_110_ms(
        self, nvml: Nvml, driver: SimDriver, clock: FakeClock
    ) -> None:
        """A probe sooner than 110 ms after the last sample takes none and repeats the values."""
        nvml.probe(0)
        samples = driver.calls["nvmlGpmSampleGet"]
        clock.now += 0.05
        assert missing(nvml.probe(0).telemetry) == set(GPM_FIELDS)  # no pair yet
        assert driver.calls["nvmlGpmSampleGet"] == samples
        clock.now += 0.07
        paired = nvml.probe(0).telemetry
        assert missing(paired) == set()
        clock.now += 0.1
        again = nvml.probe(0).telemetry
        assert driver.calls["nvmlGpmSampleGet"] == samples + 1
        assert again.sm_active == paired.sm_active
        assert dict(nvml.calls.stats())["nvmlGpmMetricsGet"].errors == 0

    def test_absent_on_a100(self, clock: FakeClock, tmp_path: Path) -> None:
        """Pre-Hopper GPUs have no GPM: absent, no sample taken, logged once; Hopper+ have it."""
        node = node_from_mapping(
            {
                "version": "v1",
                "gpus": [{"name": "a100"}, {"name": "h100"}, {"name": "h200"}, {"name": "b200"}],
            }
        )
        with ready(node, clock, tmp_path) as (drv, backend):
            with structlog.testing.capture_logs() as logs:
                for _ in range(3):
                    clock.now += 5.0
                    probes = [backend.probe(i) for i in range(4)]
            assert missing(probes[0].telemetry) == set(GPM_FIELDS)
            for probe in probes[1:]:
                assert missing(probe.telemetry) == set()
            assert drv.calls["nvmlGpmQueryDeviceSupport"] == 4  # asked once per GPU
            assert drv.calls["nvmlGpmSampleGet"] == 3 * 3  # never on the A100
            # The H200's driver answers no corrected-ECC field, as the real one did (the value
            # is read through nvmlDeviceGetTotalEccErrors instead).
            assert absent_logs(logs) == [
                (0, "nvmlGpmQueryDeviceSupport"),
                (2, "nvmlDeviceGetFieldValues:ecc_sbe_volatile"),
            ]

    def test_metric_not_supported(
        self, nvml: Nvml, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A metric the driver does not offer is absent alone, logged once."""
        model_without = dict(sim_telemetry.GPM_MODEL)
        del model_without[pynvml.NVML_GPM_METRIC_SM_OCCUPANCY]
        monkeypatch.setattr(sim_telemetry, "GPM_MODEL", model_without)
        with structlog.testing.capture_logs() as logs:
            for _ in range(4):
                clock.now += 5.0
                t = nvml.probe(2).telemetry
        assert missing(t) == {"sm_occupancy"}
        assert absent_logs(logs) == [(2, "nvmlGpmMetricsGet:sm_occupancy")]

    def test_lost_gpu_and_no_pair_across_it(
        self, nvml: Nvml, driver: SimDriver, clock: FakeClock
    ) -> None:
        """A lost GPU's sample call reports it lost; after recovery a fresh pair is needed."""
        nvml.probe(3)
        driver.fail("nvmlGpmSampleGet", GPU_IS_LOST, gpu=3, count=1)
        clock.now += 5.0
        assert nvml.probe(3).events == (GpuLost(),)
        clock.now += 5.0
        assert missing(nvml.probe(3).telemetry) == set(GPM_FIELDS)
        clock.now += 5.0
        assert missing(nvml.probe(3).telemetry) == set()

    @pytest.mark.parametrize("symbol", ["nvmlGpmSampleGet", "nvmlGpmMetricsGet"])
    def test_other_error_leaves_gpm_absent(
        self, nvml: Nvml, driver: SimDriver, clock: FakeClock, symbol: str
    ) -> None:
        """Any other GPM error leaves the values absent, counted; then a fresh pair brings them."""
        nvml.probe(0)
        driver.fail(symbol, UNKNOWN, count=1)
        clock.now += 5.0
        failed = nvml.probe(0)
        assert failed.events == (Responding(),)
        assert missing(failed.telemetry) >= GPM_FIELDS
        assert dict(nvml.calls.stats())[symbol].errors == 1
        for _ in range(2):
            clock.now += 5.0
            probe = nvml.probe(0)
        assert probe.events == (Responding(),)
        assert missing(probe.telemetry) == set()

    def test_samples_reused_and_freed_on_shutdown(
        self, nvml: Nvml, driver: SimDriver, clock: FakeClock
    ) -> None:
        """Two samples per GPU, allocated once and reused, all freed by shutdown."""
        for _ in range(5):
            clock.now += 5.0
            for index in range(GPUS):
                nvml.probe(index)
        assert driver.calls["nvmlGpmSampleAlloc"] == 2 * GPUS
        assert driver.calls["nvmlGpmSampleFree"] == 0
        nvml.shutdown()
        assert driver.calls["nvmlGpmSampleFree"] == 2 * GPUS
        assert driver.calls["nvmlShutdown"] == 1
        # Initialised again, the backend starts GPM afresh.
        nvml.init()
        assert missing(nvml.probe(0).telemetry) == set(GPM_FIELDS)
        clock.now += 5.0
        assert missing(nvml.probe(0).telemetry) == set()
        assert driver.calls["nvmlGpmSampleAlloc"] == 2 * GPUS + 2


# ----- NVML calls per cycle ----------------------------------------------------------------------
class TestCalls:
    def test_one_field_values_call_per_gpu(
        self, nvml: Nvml, driver: SimDriver, clock: FakeClock
    ) -> None:
        """Reading telemetry makes one nvmlDeviceGetFieldValues call per GPU, whatever the
        number of field-based values, and eleven NVML calls in all once GPM has a pair, the
        energy counter's aside (read once a period: tests/gpu/test_poll_cadence.py)."""
        reader = TelemetryReader(nvml.calls, clock)
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(GPUS)]
        try:
            for index, handle in enumerate(handles):
                reader.read(index, handle)
            for _ in range(3):
                before = Counter(driver.calls)
                clock.now += 1.0
                for index, handle in enumerate(handles):
                    t = reader.read(index, handle).telemetry
                    assert t.temperature_c is not None
                calls = Counter(driver.calls)
                calls.subtract(before)
                assert calls["nvmlDeviceGetFieldValues"] == GPUS
                energy = calls.pop("nvmlDeviceGetTotalEnergyConsumption", 0)
                assert energy <= GPUS
                assert calls.total() == 11 * GPUS
                assert calls["nvmlGpmSampleGet"] == GPUS
        finally:
            reader.close()

    def test_probe_reads_fields_in_one_batch(self, nvml: Nvml, driver: SimDriver) -> None:
        """A whole probe: one batch of fields, the recovery action (field 230) among them."""
        calls: list[list[int]] = []
        real = pynvml.nvmlDeviceGetFieldValues

        def spy(handle: Any, ids: list[Any]) -> Any:
            calls.append([i[0] if isinstance(i, tuple) else i for i in ids])
            return real(handle, ids)

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(pynvml, "nvmlDeviceGetFieldValues", spy)
            nvml.probe(0)
        assert calls == [[fid for _, fid, _ in FIELDS]]
        assert pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION in calls[0]


def test_reader_close_is_idempotent(nvml: Nvml, driver: SimDriver, clock: FakeClock) -> None:
    """Closing twice frees each sample once; a read after close allocates afresh."""
    reader = TelemetryReader(nvml.calls, clock)
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    read: Callable[[], Telemetry] = lambda: reader.read(0, handle).telemetry  # noqa: E731
    read()
    reader.close()
    reader.close()
    assert driver.calls["nvmlGpmSampleFree"] == 2
    read()
    clock.now += 1.0
    assert missing(read()) == set()
    reader.close()
    assert driver.calls["nvmlGpmSampleFree"] == 4
