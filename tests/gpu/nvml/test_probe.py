"""The NVML backend's probe: each GPU's readings, their absence, and the errors a GPU answers."""

from __future__ import annotations

import dataclasses

import pynvml
import pytest
import structlog.testing
from support.clock import FakeClock

from gpu.nvml.rig import (
    ABSENT_LOG,
    ACTION_NONE,
    GPU_IS_LOST,
    GPU_RESET,
    GPUS,
    MIB,
    NOT_SUPPORTED,
    PLAUSIBLE,
    UNKNOWN,
)
from gpuagent.domain.devices import Telemetry
from gpuagent.domain.health import (
    GpuLost,
    LivenessFailed,
    Responding,
)
from gpuagent.gpu.cadence import ENERGY
from gpuagent.gpu.nvml import (
    Nvml,
)
from gpuagent.gpu.sim import SimDriver
from gpuagent.gpu.sim import telemetry as sim_telemetry


# ----- probe -------------------------------------------------------------------------------------
class TestProbe:
    def test_telemetry(self, ready: Nvml, driver: SimDriver, clock: FakeClock) -> None:
        """Every value is read, in the agent's units (W, MiB), and equals the driver's."""
        clock.now += 42.0
        spec = driver.node.gpus[2]
        want = sim_telemetry.sample(spec.profile, 2, spec.memory_mib, 42.0)
        probe = ready.probe(2)
        assert probe.events == (Responding(),)
        assert probe.recovery_action == ACTION_NONE
        expected = {
            "temperature_c": want.temperature_c,
            "power_w": want.power_mw / 1000,
            "sm_clock_mhz": want.sm_clock_mhz,
            "mem_clock_mhz": want.mem_clock_mhz,
            "gpu_util_pct": want.gpu_util_pct,
            "mem_util_pct": want.mem_util_pct,
            "fb_used_mib": want.fb_used_bytes // MIB,
            "fb_free_mib": want.fb_free_bytes // MIB,
            "energy_mj": want.energy_mj,
        }
        # The other fields are checked against the simulated model in test_telemetry.py.
        assert {name: getattr(probe.telemetry, name) for name in expected} == expected

    def test_telemetry_is_plausible(self, ready: Nvml, clock: FakeClock) -> None:
        """Readings are in sane ranges for an H100 (watts, not milliwatts; MiB, not bytes)."""
        for index in range(GPUS):
            clock.now += 17.0
            t = ready.probe(index).telemetry
            for name, (low, high) in PLAUSIBLE.items():
                value = getattr(t, name)
                assert value is not None, name
                assert low <= value <= high, (name, value)
            assert t.fb_used_mib is not None
            assert t.fb_free_mib is not None
            assert 81559 - 1536 <= t.fb_used_mib + t.fb_free_mib <= 81559

    def test_energy_only_grows(self, ready: Nvml, clock: FakeClock) -> None:
        """Successive probes read a growing energy counter (fresh values, not cached ones)."""
        readings: list[float] = []
        for _ in range(3):
            clock.now += 5.0
            energy = ready.probe(0).telemetry.energy_mj
            assert energy is not None
            readings.append(energy)
        assert readings[0] < readings[1] < readings[2]

    @pytest.mark.parametrize(
        ("symbol", "how", "absent"),
        [
            ("nvmlDeviceGetTemperature", "not_supported", {"temperature_c"}),
            ("nvmlDeviceGetTemperature", "removed", {"temperature_c"}),
            ("nvmlDeviceGetTotalEnergyConsumption", "not_supported", {"energy_mj"}),
            ("nvmlDeviceGetTotalEnergyConsumption", "removed", {"energy_mj"}),
            ("nvmlDeviceGetPowerUsage", "not_supported", {"power_w"}),
            ("nvmlDeviceGetClockInfo", "removed", {"sm_clock_mhz", "mem_clock_mhz"}),
            ("nvmlDeviceGetUtilizationRates", "not_supported", {"gpu_util_pct", "mem_util_pct"}),
        ],
    )
    def test_value_not_offered_is_none(
        self,
        ready: Nvml,
        driver: SimDriver,
        clock: FakeClock,
        symbol: str,
        how: str,
        absent: set[str],
    ) -> None:
        """A value the GPU does not offer is None; every other value is still read (probes a
        period of the costly readings apart: the energy counter is read once in that period)."""

        def missing(telemetry: object) -> set[str]:
            return {
                f.name
                for f in dataclasses.fields(telemetry)  # type: ignore[arg-type]
                if getattr(telemetry, f.name) is None
            }

        ready.probe(1)
        clock.now += ENERGY.period_s
        baseline = missing(ready.probe(1).telemetry)
        assert not baseline & absent
        if how == "removed":
            driver.remove(symbol)
        else:
            driver.fail(symbol, NOT_SUPPORTED)
        clock.now += ENERGY.period_s
        probe = ready.probe(1)
        assert probe.events == (Responding(),)
        assert missing(probe.telemetry) == baseline | absent

    def test_absent_value_logged_once(self, ready: Nvml, driver: SimDriver) -> None:
        """A missing value is logged once per GPU and call, however often it is probed."""
        driver.fail("nvmlDeviceGetTemperature", NOT_SUPPORTED)
        driver.remove("nvmlDeviceGetTotalEnergyConsumption")
        with structlog.testing.capture_logs() as logs:
            for _ in range(3):
                ready.probe(0)
                ready.probe(1)
        absent = sorted(
            (entry["gpu"], entry["call"]) for entry in logs if entry["event"] == ABSENT_LOG
        )
        assert absent == [
            (0, "nvmlDeviceGetTemperature"),
            (0, "nvmlDeviceGetTotalEnergyConsumption"),
            (1, "nvmlDeviceGetTemperature"),
            (1, "nvmlDeviceGetTotalEnergyConsumption"),
        ]

    def test_lost_gpu(self, ready: Nvml, driver: SimDriver) -> None:
        """A lost GPU probes as GpuLost with no telemetry; its neighbours are unaffected."""
        driver.inject(3, "lost")
        probe = ready.probe(3)
        assert probe.events == (GpuLost(),)
        assert probe.telemetry == Telemetry()
        assert probe.recovery_action is None
        assert ready.probe(2).events == (Responding(),)

    @pytest.mark.parametrize(
        ("symbol", "code", "call", "absent"),
        [
            ("nvmlDeviceGetPowerUsage", UNKNOWN, "nvmlDeviceGetPowerUsage", {"power_w"}),
            ("nvmlDeviceGetTemperature", UNKNOWN, "nvmlDeviceGetTemperature", {"temperature_c"}),
            (
                "nvmlDeviceGetTemperature",
                pynvml.NVML_ERROR_TIMEOUT,
                "nvmlDeviceGetTemperature",
                {"temperature_c"},
            ),
            (
                "nvmlDeviceGetMemoryInfo_v2",
                pynvml.NVML_ERROR_NO_PERMISSION,
                "nvmlDeviceGetMemoryInfo_v2",
                {"fb_used_mib", "fb_free_mib", "fb_reserved_mib"},
            ),
            (
                "nvmlDeviceGetFieldValues",
                UNKNOWN,
                "nvmlDeviceGetFieldValues",
                {"memory_temperature_c", "nvlink_crc_flit_errors"},
            ),
        ],
    )
    def test_failing_reading_is_absent_not_evidence(
        self, ready: Nvml, driver: SimDriver, symbol: str, code: int, call: str, absent: set[str]
    ) -> None:
        """A telemetry call that fails leaves its values absent, counts the error, logs it once.

        The GPU still answers its liveness check: a metric is not evidence about the GPU.
        """
        driver.fail(symbol, code, gpu=0)
        with structlog.testing.capture_logs() as logs:
            probes = [ready.probe(0) for _ in range(3)]
        assert all(p.events == (Responding(),) for p in probes)
        for name in absent:
            assert getattr(probes[-1].telemetry, name) is None, name
        assert probes[-1].telemetry.sm_clock_mhz is not None
        assert dict(ready.calls.stats())[call].errors == 3
        failed = [e for e in logs if e["event"] == "nvml call failed; value left out"]
        assert [(e["gpu"], e["call"]) for e in failed] == [(0, call)]
        assert ready.probe(1).events == (Responding(),)

    @pytest.mark.parametrize(
        ("code", "events"),
        [
            (UNKNOWN, (LivenessFailed("Unknown Error (NVML 999)"),)),
            (pynvml.NVML_ERROR_TIMEOUT, (LivenessFailed("Timeout (NVML 10)"),)),
            (NOT_SUPPORTED, (Responding(),)),  # no liveness check to fail; hangs still count
            (GPU_IS_LOST, (GpuLost(),)),
        ],
    )
    def test_liveness_check(
        self, ready: Nvml, driver: SimDriver, code: int, events: tuple[object, ...]
    ) -> None:
        """The designated liveness call decides; its failure is one strike, not a verdict."""
        driver.fail("nvmlDeviceGetPerformanceState", code, gpu=2)
        probe = ready.probe(2)
        assert probe.events == events
        if code != GPU_IS_LOST:
            assert probe.telemetry.power_w is not None  # readings are kept either way

    def test_recovery_action_from_field(self, ready: Nvml, driver: SimDriver) -> None:
        """The driver's recovery action (field 230) is read with each probe."""
        assert pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION == 230
        driver.inject(1, "xid", 79)
        assert ready.probe(1).recovery_action == GPU_RESET
        assert ready.probe(0).recovery_action == ACTION_NONE
        driver.inject(1, "recover")
        assert ready.probe(1).recovery_action == ACTION_NONE

    def test_recovery_action_without_field_values(self, ready: Nvml, driver: SimDriver) -> None:
        """An older driver without nvmlDeviceGetFieldValues: no recovery action, telemetry kept."""
        driver.inject(1, "xid", 79)
        driver.remove("nvmlDeviceGetFieldValues")
        probe = ready.probe(1)
        assert probe.recovery_action is None
        assert probe.events == (Responding(),)
        assert probe.telemetry.power_w is not None
