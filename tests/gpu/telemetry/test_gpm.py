"""GPM metrics through the real pynvml wrappers: samples paired per GPU, at least 110 ms apart;
absent on the first probe, on an A100, after an error or across a lost GPU; freed at shutdown.
"""

from __future__ import annotations

from pathlib import Path

import pynvml
import pytest
import structlog.testing
from support.clock import FakeClock

from gpu.telemetry.probes import (
    GPM_FIELDS,
    GPU_IS_LOST,
    GPUS,
    UNKNOWN,
    absent_logs,
    missing,
    model,
    ready,
)
from gpuagent.domain.health import GpuLost, Responding
from gpuagent.gpu.nvml import Nvml
from gpuagent.gpu.sim import (
    SimDriver,
    node_from_mapping,
)
from gpuagent.gpu.sim import telemetry as sim_telemetry


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
