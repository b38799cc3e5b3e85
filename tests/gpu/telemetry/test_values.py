"""Telemetry through the real pynvml wrappers (``Nvml.probe`` → ``gpuagent.gpu.telemetry``) on the
simulated driver: every field read with its unit, as the simulator's model says it must be.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import pynvml
import pytest
from support.clock import FakeClock

from gpu.telemetry.probes import GPUS, MIB, missing, model, two_probes
from gpuagent.gpu.nvml import Nvml
from gpuagent.gpu.sim import (
    SimDriver,
)
from gpuagent.gpu.sim import telemetry as sim_telemetry


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
