"""The simulated driver's GPM entry points, and the other telemetry entry points added with them
(encoder/decoder utilisation, PCIe replays, remapped rows, NVLink counters by scope), seen
through the real pynvml wrappers."""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable, Iterator
from typing import Any

import pynvml
import pytest
from support.clock import FakeClock
from support.simnvml import nvml_on

from gpuagent.gpu.sim import SimDriver, installed, node_from_count, node_from_mapping
from gpuagent.gpu.sim import telemetry as sim_telemetry
from gpuagent.gpu.sim._api_gpm import samples_of

ALL_LINKS = 0xFFFF_FFFF
MODELS = ("a100", "h100", "h200", "b200")
TX = pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX
RX = pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(500.0)


@pytest.fixture
def driver(clock: FakeClock) -> Iterator[SimDriver]:
    """GPU 0 an A100, 1 an H100, 2 an H200, 3 a B200; GPUs 1 and 2 joined by 4 NVLinks."""
    node = node_from_mapping(
        {
            "version": "v1",
            "gpus": [{"name": name} for name in MODELS],
            "nvlinks": [[1, 2, 4]],
        }
    )
    with nvml_on(SimDriver(node, clock=clock)) as drv:
        yield drv


def handle(index: int) -> Any:
    return pynvml.nvmlDeviceGetHandleByIndex(index)


def metrics(first: Any, second: Any, ids: list[int]) -> Any:
    """``nvmlGpmMetricsGet`` for ``ids`` between two samples; the filled request."""
    request = pynvml.c_nvmlGpmMetricsGet_t()
    request.version = pynvml.NVML_GPM_METRICS_GET_VERSION
    request.numMetrics = len(ids)
    request.sample1 = first
    request.sample2 = second
    for i, metric_id in enumerate(ids):
        request.metrics[i].metricId = metric_id
    return pynvml.nvmlGpmMetricsGet(request)


def sample_pair(index: int, clock: FakeClock, seconds: float) -> tuple[Any, Any]:
    """Two samples of GPU ``index``, ``seconds`` apart on the driver's clock."""
    first = pynvml.nvmlGpmSampleAlloc()
    second = pynvml.nvmlGpmSampleAlloc()
    pynvml.nvmlGpmSampleGet(handle(index), first)
    clock.now += seconds
    pynvml.nvmlGpmSampleGet(handle(index), second)
    return first, second


def simpson(f: Callable[[float], float], a: float, b: float, n: int = 2000) -> float:
    """∫ f over [a, b] by Simpson's rule (n even)."""
    h = (b - a) / n
    total = f(a) + f(b)
    for k in range(1, n):
        total += (4 if k % 2 else 2) * f(a + k * h)
    return total * h / 3


class TestSupport:
    def test_hopper_and_newer_only(self, driver: SimDriver) -> None:
        """isSupportedDevice is 1 on H100, H200 and B200, 0 on the A100."""
        supported = [
            pynvml.nvmlGpmQueryDeviceSupport(handle(i)).isSupportedDevice for i in range(4)
        ]
        assert supported == [0, 1, 1, 1]

    def test_a100_sample_not_supported(self, driver: SimDriver) -> None:
        """Sampling an A100 is NOT_SUPPORTED."""
        sample = pynvml.nvmlGpmSampleAlloc()
        with pytest.raises(pynvml.NVMLError_NotSupported):
            pynvml.nvmlGpmSampleGet(handle(0), sample)
        pynvml.nvmlGpmSampleFree(sample)

    def test_support_version_checked(self, driver: SimDriver) -> None:
        """An unknown version of nvmlGpmSupport_t is ARGUMENT_VERSION_MISMATCH."""
        support = pynvml.c_nvmlGpmSupport_t()
        support.version = pynvml.NVML_GPM_SUPPORT_VERSION + 1
        entry = vars(driver)["nvmlGpmQueryDeviceSupport"]  # the C entry point itself
        code = entry(handle(1), ctypes.byref(support))
        assert code == pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH


class TestMetrics:
    @pytest.mark.parametrize("index", [1, 2, 3])
    @pytest.mark.parametrize("metric_id", sorted(sim_telemetry.GPM_MODEL))
    def test_mean_over_the_interval(
        self, driver: SimDriver, clock: FakeClock, index: int, metric_id: int
    ) -> None:
        """Each metric is its instantaneous rate averaged over the interval between samples."""
        start = clock.now - 500.0  # driver time of the first sample
        first, second = sample_pair(index, clock, 37.0)
        (metric,) = metrics(first, second, [metric_id]).metrics[:1]
        assert metric.nvmlReturn == pynvml.NVML_SUCCESS
        nvlink = index in (1, 2)
        mean = (
            simpson(
                lambda t: sim_telemetry.gpm_rate(metric_id, index, t, nvlink=nvlink),
                start,
                start + 37.0,
            )
            / 37.0
        )
        assert metric.value == pytest.approx(mean, rel=1e-9, abs=1e-9)

    def test_percentages_stay_in_range(self, driver: SimDriver, clock: FakeClock) -> None:
        """Over twenty minutes every percentage metric stays within 0..100 and moves."""
        ids = [m for m in sim_telemetry.GPM_MODEL if m < pynvml.NVML_GPM_METRIC_PCIE_TX_PER_SEC]
        seen: dict[int, set[float]] = {m: set() for m in ids}
        first = pynvml.nvmlGpmSampleAlloc()
        second = pynvml.nvmlGpmSampleAlloc()
        pynvml.nvmlGpmSampleGet(handle(1), first)
        for _ in range(120):
            clock.now += 10.3  # not a divisor of the 240 s period: no interval repeats
            pynvml.nvmlGpmSampleGet(handle(1), second)
            got = metrics(first, second, ids)
            for i, metric_id in enumerate(ids):
                value = got.metrics[i].value
                assert 0.0 <= value <= 100.0
                seen[metric_id].add(round(value, 6))
            first, second = second, first
        moving = [m for m in ids if sim_telemetry.GPM_MODEL[m][1] > 0]
        assert all(len(seen[m]) > 50 for m in moving)

    def test_graphics_follows_gpu_utilisation(self, driver: SimDriver, clock: FakeClock) -> None:
        """Over a short interval GRAPHICS_UTIL is close to nvmlDeviceGetUtilizationRates.gpu."""
        first, second = sample_pair(2, clock, 0.5)
        value = metrics(first, second, [pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL]).metrics[0].value
        assert value == pytest.approx(pynvml.nvmlDeviceGetUtilizationRates(handle(2)).gpu, abs=1)

    def test_nvlink_rate_is_the_counters_slope(self, driver: SimDriver, clock: FakeClock) -> None:
        """GPM's NVLink TX/RX MiB/s equal the field counters' growth (KiB) over the interval."""
        ids = [(TX, ALL_LINKS), (RX, ALL_LINKS)]
        before = pynvml.nvmlDeviceGetFieldValues(handle(1), ids)
        first, second = sample_pair(1, clock, 20.0)
        after = pynvml.nvmlDeviceGetFieldValues(handle(1), ids)
        got = metrics(
            first,
            second,
            [
                pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC,
                pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC,
            ],
        )
        for i in range(2):
            kib = after[i].value.ullVal - before[i].value.ullVal
            assert got.metrics[i].value == pytest.approx(kib / 1024 / 20.0, rel=1e-6)

    def test_no_nvlink_no_traffic(self, driver: SimDriver, clock: FakeClock) -> None:
        """A GPU without active NVLinks reports 0 NVLink MiB/s."""
        first, second = sample_pair(3, clock, 5.0)
        got = metrics(first, second, [pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC])
        assert got.metrics[0].nvmlReturn == pynvml.NVML_SUCCESS
        assert got.metrics[0].value == 0.0

    def test_unknown_metric_slot_not_supported(self, driver: SimDriver, clock: FakeClock) -> None:
        """A metric the simulator does not model answers NOT_SUPPORTED in its slot only."""
        first, second = sample_pair(1, clock, 5.0)
        got = metrics(
            first,
            second,
            [pynvml.NVML_GPM_METRIC_NVDEC_0_UTIL, pynvml.NVML_GPM_METRIC_SM_UTIL],
        )
        assert got.metrics[0].nvmlReturn == pynvml.NVML_ERROR_NOT_SUPPORTED
        assert got.metrics[1].nvmlReturn == pynvml.NVML_SUCCESS
        assert got.metrics[1].metricInfo.unit == b"%"

    @pytest.mark.parametrize("apart", [0.0, 0.05, 0.099])
    def test_samples_closer_than_100_ms_are_refused(
        self, driver: SimDriver, clock: FakeClock, apart: float
    ) -> None:
        """The driver needs 100 ms between two samples; the simulator refuses a closer pair."""
        first, second = sample_pair(1, clock, apart)
        with pytest.raises(pynvml.NVMLError_InvalidArgument):
            metrics(first, second, [pynvml.NVML_GPM_METRIC_SM_UTIL])

    def test_samples_100_ms_apart_are_accepted(self, driver: SimDriver, clock: FakeClock) -> None:
        first, second = sample_pair(1, clock, 0.1)
        value = metrics(first, second, [pynvml.NVML_GPM_METRIC_SM_UTIL]).metrics[0].value
        assert math.isfinite(value)

    def test_lost_gpu(self, driver: SimDriver) -> None:
        """Sampling a lost GPU is GPU_IS_LOST."""
        driver.inject(2, "lost")
        sample = pynvml.nvmlGpmSampleAlloc()
        with pytest.raises(pynvml.NVMLError_GpuIsLost):
            pynvml.nvmlGpmSampleGet(handle(2), sample)


class TestSampleHandles:
    def test_invalid_uses(self, driver: SimDriver, clock: FakeClock) -> None:
        """Unfilled, mixed-GPU, freed and doubly freed samples are INVALID_ARGUMENT."""
        sm = [pynvml.NVML_GPM_METRIC_SM_UTIL]
        empty = pynvml.nvmlGpmSampleAlloc()
        h100, h200 = pynvml.nvmlGpmSampleAlloc(), pynvml.nvmlGpmSampleAlloc()
        pynvml.nvmlGpmSampleGet(handle(1), h100)
        clock.now += 1.0
        pynvml.nvmlGpmSampleGet(handle(2), h200)
        with pytest.raises(pynvml.NVMLError_InvalidArgument):
            metrics(h100, empty, sm)
        with pytest.raises(pynvml.NVMLError_InvalidArgument):
            metrics(h100, h200, sm)
        pynvml.nvmlGpmSampleFree(h200)
        with pytest.raises(pynvml.NVMLError_InvalidArgument):
            pynvml.nvmlGpmSampleFree(h200)
        with pytest.raises(pynvml.NVMLError_InvalidArgument):
            pynvml.nvmlGpmSampleGet(handle(2), h200)

    def test_request_checked(self, driver: SimDriver, clock: FakeClock) -> None:
        """A wrong version or too many metrics is refused."""
        first, second = sample_pair(1, clock, 1.0)
        request = pynvml.c_nvmlGpmMetricsGet_t()
        request.version = pynvml.NVML_GPM_METRICS_GET_VERSION + 1
        request.sample1, request.sample2 = first, second
        with pytest.raises(pynvml.NVMLError_ArgumentVersionMismatch):
            pynvml.nvmlGpmMetricsGet(request)
        request.version = pynvml.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = pynvml.NVML_GPM_METRIC_MAX + 1
        with pytest.raises(pynvml.NVMLError_InvalidArgument):
            pynvml.nvmlGpmMetricsGet(request)

    def test_alloc_and_free_tracked(self, driver: SimDriver) -> None:
        """The driver knows exactly the samples allocated and not yet freed."""
        samples = [pynvml.nvmlGpmSampleAlloc() for _ in range(3)]
        live = samples_of(driver._state)
        assert len(live) == 3
        for sample in samples:
            pynvml.nvmlGpmSampleFree(sample)
        assert len(live) == 0

    def test_needs_init(self, clock: FakeClock) -> None:
        """Like every other call, GPM calls are UNINITIALIZED outside nvmlInit…nvmlShutdown."""
        with (
            installed(SimDriver(node_from_count(1), clock=clock)),
            pytest.raises(pynvml.NVMLError_Uninitialized),
        ):
            pynvml.nvmlGpmSampleAlloc()


class TestOtherEntryPoints:
    def test_encoder_decoder(self, driver: SimDriver, clock: FakeClock) -> None:
        """Encoder/decoder utilisation: percentages with a sampling period, moving in time."""
        readings = set()
        for _ in range(30):
            clock.now += 11.0
            enc, enc_period = pynvml.nvmlDeviceGetEncoderUtilization(handle(1))
            dec, dec_period = pynvml.nvmlDeviceGetDecoderUtilization(handle(1))
            assert 0 <= enc <= 100
            assert 0 <= dec <= 100
            assert enc_period == dec_period == sim_telemetry.ENCODER_SAMPLING_US
            readings.add((enc, dec))
        assert len(readings) > 10

    def test_pcie_replays(self, driver: SimDriver, clock: FakeClock) -> None:
        """The replay counter answers the same by call and by field, and only grows."""
        values = []
        for _ in range(20):
            clock.now += 300.0
            direct = pynvml.nvmlDeviceGetPcieReplayCounter(handle(0))
            (by_field,) = pynvml.nvmlDeviceGetFieldValues(
                handle(0), [pynvml.NVML_FI_DEV_PCIE_REPLAY_COUNTER]
            )
            assert by_field.value.ullVal == direct
            values.append(direct)
        assert values == sorted(values)
        assert values[0] < values[-1]

    def test_remapped_rows(self, driver: SimDriver) -> None:
        """No faults: no remapped rows, by call and by fields 142-145."""
        assert pynvml.nvmlDeviceGetRemappedRows(handle(1)) == (0, 0, 0, 0)
        ids = [
            pynvml.NVML_FI_DEV_REMAPPED_COR,
            pynvml.NVML_FI_DEV_REMAPPED_UNC,
            pynvml.NVML_FI_DEV_REMAPPED_PENDING,
            pynvml.NVML_FI_DEV_REMAPPED_FAILURE,
        ]
        slots = pynvml.nvmlDeviceGetFieldValues(handle(1), ids)
        assert [(s.nvmlReturn, s.value.uiVal) for s in slots] == [(pynvml.NVML_SUCCESS, 0)] * 4

    def test_nvlink_scope(self, driver: SimDriver) -> None:
        """scopeId picks one link (inactive: 0, beyond the last: INVALID_ARGUMENT);
        UINT_MAX sums every link."""
        ids = [(TX, ALL_LINKS), (TX, 0), (TX, 3), (TX, 4), (TX, 18)]
        total, link0, link3, link4, beyond = pynvml.nvmlDeviceGetFieldValues(handle(1), ids)
        assert total.nvmlReturn == link0.nvmlReturn == link4.nvmlReturn == pynvml.NVML_SUCCESS
        assert link0.value.ullVal == link3.value.ullVal == total.value.ullVal // 4
        assert link0.value.ullVal > 0
        assert link4.value.ullVal == 0  # GPU 1 has 4 active links of 18
        assert beyond.nvmlReturn == pynvml.NVML_ERROR_INVALID_ARGUMENT
        (no_links,) = pynvml.nvmlDeviceGetFieldValues(handle(3), [(TX, ALL_LINKS)])
        assert (no_links.nvmlReturn, no_links.value.ullVal) == (pynvml.NVML_SUCCESS, 0)
