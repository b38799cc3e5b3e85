"""The NVML calls a probe makes per cycle: one field-values call per GPU with every field in one
batch; and the reader closed twice.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import pynvml
import pytest
from support.clock import FakeClock

from gpu.telemetry.probes import GPUS, missing
from gpuagent.domain.devices import Telemetry
from gpuagent.gpu.nvml import Nvml
from gpuagent.gpu.sim import (
    SimDriver,
)
from gpuagent.gpu.telemetry import FIELDS, TelemetryReader


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
