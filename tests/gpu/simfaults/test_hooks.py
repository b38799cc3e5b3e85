"""The simulated driver's test hooks (a call made to fail, a function removed, calls counted) and
its control plane, through the real pynvml wrappers.
"""

from __future__ import annotations

import json
from typing import Any

import pynvml
import pytest

from gpu.simfaults.nvmlevents import XID, drain, handle
from gpuagent.gpu.sim import SimDriver


class TestHooks:
    @pytest.mark.parametrize(
        ("code", "error"),
        [
            (pynvml.NVML_ERROR_TIMEOUT, pynvml.NVMLError_Timeout),
            (pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVMLError_NotSupported),
            (pynvml.NVML_ERROR_UNKNOWN, pynvml.NVMLError_Unknown),
            (pynvml.NVML_ERROR_GPU_IS_LOST, pynvml.NVMLError_GpuIsLost),
        ],
    )
    def test_fail(self, driver: SimDriver, code: int, error: type[Exception]) -> None:
        """fail() makes a symbol return the code until cleared."""
        driver.fail("nvmlDeviceGetPowerUsage", code)
        for _ in range(3):
            with pytest.raises(error):
                pynvml.nvmlDeviceGetPowerUsage(handle(0))
        driver.clear_failures()
        assert pynvml.nvmlDeviceGetPowerUsage(handle(0)) > 0

    def test_fail_one_gpu_for_a_count(self, driver: SimDriver) -> None:
        """A per-GPU failure spares the other GPUs and ends after ``count`` calls."""
        driver.fail("nvmlDeviceGetTemperature", pynvml.NVML_ERROR_TIMEOUT, gpu=1, count=2)
        for _ in range(2):
            assert pynvml.nvmlDeviceGetTemperature(handle(0), 0) > 0
            with pytest.raises(pynvml.NVMLError_Timeout):
                pynvml.nvmlDeviceGetTemperature(handle(1), 0)
        assert pynvml.nvmlDeviceGetTemperature(handle(1), 0) > 0

    def test_fail_handle_lookup_by_index(self, driver: SimDriver) -> None:
        """A per-GPU failure on a lookup applies to that GPU's index."""
        driver.fail("nvmlDeviceGetHandleByIndex_v2", pynvml.NVML_ERROR_UNKNOWN, gpu=2)
        handle(1)
        with pytest.raises(pynvml.NVMLError_Unknown):
            handle(2)

    def test_fail_init(self, driver: SimDriver) -> None:
        """Init itself can fail, e.g. as with an unloaded kernel module."""
        driver.fail("nvmlInitWithFlags", pynvml.NVML_ERROR_DRIVER_NOT_LOADED, count=1)
        with pytest.raises(pynvml.NVMLError_DriverNotLoaded):
            pynvml.nvmlInit()
        pynvml.nvmlInit()

    def test_fail_wait(self, driver: SimDriver, events: Any) -> None:
        """An injected wait failure is returned without consuming queued events."""
        driver.inject(0, "xid", 13)
        driver.fail("nvmlEventSetWait_v2", pynvml.NVML_ERROR_GPU_IS_LOST, count=1)
        with pytest.raises(pynvml.NVMLError_GpuIsLost):
            pynvml.nvmlEventSetWait_v2(events, 0)
        assert drain(events) == [(0, XID, 13)]

    @pytest.mark.parametrize("warm", [False, True])
    def test_remove(self, driver: SimDriver, warm: bool) -> None:
        """A removed symbol is missing (looked up or already cached) until cleared."""
        if warm:
            pynvml.nvmlDeviceGetMemoryInfo(handle(0), version=pynvml.nvmlMemory_v2)
        driver.remove("nvmlDeviceGetMemoryInfo_v2")
        assert not hasattr(driver, "nvmlDeviceGetMemoryInfo_v2")
        with pytest.raises(pynvml.NVMLError_FunctionNotFound):
            pynvml.nvmlDeviceGetMemoryInfo(handle(0), version=pynvml.nvmlMemory_v2)
        assert pynvml.nvmlDeviceGetMemoryInfo(handle(0)).total > 0
        driver.clear_failures()
        assert hasattr(driver, "nvmlDeviceGetMemoryInfo_v2")
        assert pynvml.nvmlDeviceGetMemoryInfo(handle(0), version=pynvml.nvmlMemory_v2).total > 0

    def test_calls_counted(self, driver: SimDriver) -> None:
        """Every call of a symbol is counted, failed ones included."""
        before = driver.calls["nvmlDeviceGetPowerUsage"]
        h = handle(0)
        pynvml.nvmlDeviceGetPowerUsage(h)
        driver.fail("nvmlDeviceGetPowerUsage", pynvml.NVML_ERROR_UNKNOWN)
        with pytest.raises(pynvml.NVMLError_Unknown):
            pynvml.nvmlDeviceGetPowerUsage(h)
        assert driver.calls["nvmlDeviceGetPowerUsage"] == before + 2

    @pytest.mark.parametrize(
        ("args", "error"),
        [
            (("nvmlNoSuchThing", 3), ValueError),
            (("nvmlDeviceGetCount_v2", 3, 0), ValueError),
            (("nvmlDeviceGetPowerUsage", 3, 4), LookupError),
            (("nvmlDeviceGetPowerUsage", 3, None, 0), ValueError),
        ],
    )
    def test_fail_rejects(self, driver: SimDriver, args: tuple[Any, ...], error: type) -> None:
        """fail() refuses unknown symbols, GPUs and counts."""
        with pytest.raises(error):
            driver.fail(*args)

    def test_remove_rejects_unknown(self, driver: SimDriver) -> None:
        """remove() refuses a symbol the driver never had."""
        with pytest.raises(ValueError, match="nvmlNoSuchThing"):
            driver.remove("nvmlNoSuchThing")


class TestControlPlane:
    def test_describe(self, driver: SimDriver) -> None:
        """describe() is JSON-ready with one entry per GPU."""
        described = json.loads(json.dumps(driver.describe()))
        assert [d["index"] for d in described] == [0, 1, 2, 3]
        first = described[0]
        spec = driver.node.gpus[0]
        assert first == {
            "index": 0,
            "uuid": spec.uuid,
            "name": "NVIDIA H100 80GB HBM3",
            "memory_mib": 81559,
            "pci_bus_id": spec.pci_bus_id,
            "numa_node": 0,
            "mig": [],
            "mig_mode": "disabled",
            "mig_mode_pending": "disabled",
            "compute_mode": "default",
            "mig_devices": [],
            "gpu_instances_without_compute_instance": [],
            "state": "ok",
            "recovery_action": "none",
            "last_xid": None,
            "xid_count": 0,
            "ecc_dbe_count": 0,
            "hang_s": 0.0,
            "hung_calls": 0,
            "not_supported": [],
            "call_errors": [],
            "function_not_found": [],
        }

    @pytest.mark.parametrize(
        ("gpu", "fault", "xid", "error"),
        [
            (4, "lost", None, LookupError),
            (-1, "recover", None, LookupError),
            (0, "melt", None, ValueError),
            (0, "xid", None, ValueError),
            (0, "xid", -5, ValueError),
            (0, "xid", 2**64, ValueError),
            (0, "xid", True, ValueError),
            (0, "xid", "79", ValueError),
            (0, "lost", 79, ValueError),
            ("0", "lost", None, ValueError),
        ],
    )
    def test_inject_rejects(
        self, driver: SimDriver, gpu: Any, fault: str, xid: Any, error: type
    ) -> None:
        """Unknown GPUs are LookupError; unknown faults and bad XIDs are ValueError."""
        with pytest.raises(error):
            driver.inject(gpu, fault, xid)
        assert driver.describe()[0]["xid_count"] == 0
