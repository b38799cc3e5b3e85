"""What a probe leaves out: a value the GPU or driver does not offer, a field slot it cannot read,
a field-values call that fails, the v1 memory call; each value absent, never zero.
"""

from __future__ import annotations

from typing import Any

import pynvml
import pytest
import structlog.testing
from support.clock import FakeClock

from gpu.telemetry.probes import (
    FIELD_BASED,
    GPM_FIELDS,
    GPU_IS_LOST,
    GPUS,
    MIB,
    NOT_SUPPORTED,
    SLOT_LOG,
    START,
    UNKNOWN,
    absent_logs,
    missing,
)
from gpuagent.domain.health import GpuLost, Responding
from gpuagent.gpu.nvml import Nvml
from gpuagent.gpu.sim import (
    SimDriver,
    _api_device,
)
from gpuagent.gpu.sim import telemetry as sim_telemetry
from gpuagent.gpu.telemetry import FIELDS


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
