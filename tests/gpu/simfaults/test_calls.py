"""Faults of NVML calls on the simulated driver: a call that hangs (only that GPU's), ends by
itself or is released; a function not supported on one GPU or not found on the driver.
"""

from __future__ import annotations

import threading
from typing import Any

import pynvml
import pytest
from support.clock import WAIT_S, blocked_in

from gpuagent.gpu.sim import SimDriver


def call_in_thread(gpu: Any) -> tuple[threading.Thread, threading.Event]:
    """Read ``gpu``'s temperature on a thread of its own; the event is set once it returned."""
    returned = threading.Event()

    def call() -> None:
        pynvml.nvmlDeviceGetTemperature(gpu, pynvml.NVML_TEMPERATURE_GPU)
        returned.set()

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    return thread, returned


class TestCallFaults:
    """Faults in how calls behave: a hung GPU, a call not supported, a function missing."""

    def test_hang_blocks_only_that_gpus_calls(self, driver: SimDriver) -> None:
        """A call on a hung GPU stays blocked in the hang while the other GPUs answer.

        Judged by where the call is blocked, not by elapsed time (the machine may be busy).
        """
        h0 = pynvml.nvmlDeviceGetHandleByIndex(0)
        h1 = pynvml.nvmlDeviceGetHandleByIndex(1)
        driver.inject(1, "hang", seconds=600)
        thread, returned = call_in_thread(h1)
        try:
            assert thread.ident is not None
            assert blocked_in(thread.ident, "hang_if_needed", via=("wait", "wait"))
            pynvml.nvmlDeviceGetTemperature(h0, pynvml.NVML_TEMPERATURE_GPU)
            assert not returned.is_set()  # GPU 0 answered while GPU 1's call is still blocked
            assert [d["hung_calls"] for d in driver.describe()] == [0, 1, 0, 0]
        finally:
            driver.inject(1, "recover")
            thread.join(WAIT_S)
        assert [d["hung_calls"] for d in driver.describe()] == [0, 0, 0, 0]

    def test_a_hang_ends_by_itself(self, driver: SimDriver) -> None:
        """Once its seconds are over, a hung GPU's calls answer (a short hang: only an end)."""
        h1 = pynvml.nvmlDeviceGetHandleByIndex(1)
        driver.inject(1, "hang", seconds=0.05)
        thread, returned = call_in_thread(h1)
        assert returned.wait(WAIT_S)
        thread.join(WAIT_S)
        assert driver.describe()[1]["hang_s"] == 0
        assert driver.calls["nvmlDeviceGetTemperature"] == 1

    def test_recover_releases_a_blocked_call(self, driver: SimDriver) -> None:
        """A call blocked by a hang returns as soon as the GPU recovers."""
        h1 = pynvml.nvmlDeviceGetHandleByIndex(1)
        driver.inject(1, "hang", seconds=600)
        thread, done = call_in_thread(h1)
        assert thread.ident is not None
        assert blocked_in(thread.ident, "hang_if_needed", via=("wait", "wait"))
        assert not done.is_set()
        driver.inject(1, "recover")
        assert done.wait(WAIT_S)
        thread.join(WAIT_S)

    def test_not_supported_on_one_gpu(self, driver: SimDriver) -> None:
        driver.inject(2, "not_supported", symbol="nvmlDeviceGetPowerUsage")
        with pytest.raises(pynvml.NVMLError_NotSupported):
            pynvml.nvmlDeviceGetPowerUsage(pynvml.nvmlDeviceGetHandleByIndex(2))
        assert pynvml.nvmlDeviceGetPowerUsage(pynvml.nvmlDeviceGetHandleByIndex(1)) > 0
        assert driver.describe()[2]["not_supported"] == ["nvmlDeviceGetPowerUsage"]

    def test_function_not_found_is_driver_wide(self, driver: SimDriver) -> None:
        driver.inject(0, "function_not_found", symbol="nvmlDeviceGetNumaNodeId")
        for index in (0, 3):
            with pytest.raises(pynvml.NVMLError_FunctionNotFound):
                pynvml.nvmlDeviceGetNumaNodeId(pynvml.nvmlDeviceGetHandleByIndex(index))

    def test_recover_brings_back_a_function_not_found(self, driver: SimDriver) -> None:
        """Every call fault lasts until its GPU recovers, a missing function too; another GPU's
        recovery does not bring it back, nor one GPU's while another GPU's fault still holds it."""
        power = "nvmlDeviceGetPowerUsage"
        driver.inject(0, "function_not_found", symbol=power)
        driver.inject(1, "function_not_found", symbol=power)
        for gpu in (2, 0):
            driver.inject(gpu, "recover")
            with pytest.raises(pynvml.NVMLError_FunctionNotFound):
                pynvml.nvmlDeviceGetPowerUsage(pynvml.nvmlDeviceGetHandleByIndex(3))
            assert driver.describe()[3]["function_not_found"] == [power]
        driver.inject(1, "recover")
        assert pynvml.nvmlDeviceGetPowerUsage(pynvml.nvmlDeviceGetHandleByIndex(3)) > 0
        assert [d["function_not_found"] for d in driver.describe()] == [[], [], [], []]

    @pytest.mark.parametrize(
        ("fault", "params"),
        [
            ("hang", {}),
            ("hang", {"seconds": 0}),
            ("hang", {"seconds": 4000}),
            ("hang", {"seconds": True}),
            ("hang", {"seconds": 1, "symbol": "nvmlDeviceGetName"}),
            ("not_supported", {}),
            ("not_supported", {"symbol": "nvmlMadeUp"}),
            ("not_supported", {"symbol": "nvmlDeviceGetName", "seconds": 1}),
            ("function_not_found", {"symbol": 3}),
            ("lost", {"seconds": 1}),
            ("xid", {"symbol": "nvmlDeviceGetName"}),
        ],
    )
    def test_bad_parameters(self, driver: SimDriver, fault: str, params: dict[str, object]) -> None:
        with pytest.raises(ValueError, match=fault if fault != "xid" else "takes no"):
            driver.inject(0, fault, 79 if fault == "xid" else None, **params)
