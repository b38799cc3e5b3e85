"""The NVML backend (``Nvml``) on the real pynvml wrappers, over the simulated driver: its start
(the library found or not, the driver's answers at init) and its shutdown.
"""

from __future__ import annotations

import ctypes

import pynvml
import pytest
import structlog.testing

from gpu.nvml.rig import UNKNOWN
from gpuagent.domain.devices import DriverState
from gpuagent.gpu.nvml import (
    DriverUnavailable,
    EventWaitError,
    Nvml,
    cuda_version,
)
from gpuagent.gpu.sim import SimDriver
from gpuagent.overrides.nvml import nvml_library_users


# ----- init --------------------------------------------------------------------------------------
class TestInit:
    def test_returns_driver_version(self, nvml: Nvml, driver: SimDriver) -> None:
        """``init()`` returns the driver up, with the version and CUDA version it reports."""
        state = nvml.init()
        assert state == DriverState(up=True, version="580.95.05", cuda_version=(13, 0))
        assert state.version == driver.node.driver_version

    def test_cuda_version_absent_on_an_old_driver(self, nvml: Nvml, driver: SimDriver) -> None:
        """A driver without nvmlSystemGetCudaDriverVersion leaves the CUDA version unknown."""
        driver.remove("nvmlSystemGetCudaDriverVersion")
        driver.remove("nvmlSystemGetCudaDriverVersion_v2")
        assert nvml.init() == DriverState(up=True, version="580.95.05", cuda_version=None)

    @pytest.mark.parametrize(
        ("value", "expected"), [(13000, (13, 0)), (12040, (12, 4)), (11080, (11, 8)), (0, None)]
    )
    def test_cuda_version_decoding(self, value: int, expected: tuple[int, int] | None) -> None:
        """NVML's ``major * 1000 + minor * 10`` as ``(major, minor)``."""
        assert cuda_version(value) == expected

    @pytest.mark.parametrize(
        ("code", "text"),
        [
            (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, "Driver Not Loaded (NVML 9)"),
            (
                pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH,
                "RM has detected an NVML/RM version mismatch. (NVML 18)",
            ),
            (pynvml.NVML_ERROR_NO_PERMISSION, "Insufficient Permissions (NVML 4)"),
            (pynvml.NVML_ERROR_UNKNOWN, "Unknown Error (NVML 999)"),
        ],
    )
    def test_failure_is_driver_unavailable(
        self, nvml: Nvml, driver: SimDriver, code: int, text: str
    ) -> None:
        """An init failure surfaces as DriverUnavailable carrying NVML's text and code."""
        driver.fail("nvmlInitWithFlags", code)
        with pytest.raises(DriverUnavailable) as caught:
            nvml.init()
        assert str(caught.value) == text
        assert isinstance(caught.value.__cause__, pynvml.NVMLError)

    def test_recovers_once_the_driver_answers(self, nvml: Nvml, driver: SimDriver) -> None:
        """A failed init leaves nothing behind: the next init succeeds."""
        driver.fail("nvmlInitWithFlags", pynvml.NVML_ERROR_DRIVER_NOT_LOADED, count=1)
        with pytest.raises(DriverUnavailable):
            nvml.init()
        assert nvml.init().version == driver.node.driver_version


def _real_nvml_present() -> bool:
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


@pytest.mark.skipif(_real_nvml_present(), reason="this machine has a real libnvidia-ml")
def test_init_without_any_library(monkeypatch: pytest.MonkeyPatch) -> None:
    """With no simulated driver and no libnvidia-ml, init raises DriverUnavailable."""
    # monkeypatch puts pynvml's library state back exactly as it was, whatever happens here.
    monkeypatch.setattr(pynvml, "nvmlLib", None)
    monkeypatch.setattr(pynvml, "_nvmlGetFunctionPointer_cache", {})
    monkeypatch.setattr(pynvml, "_nvmlLib_refcount", 0)
    with pytest.raises(DriverUnavailable, match=r"^NVML Shared Library Not Found \(NVML 12\)$"):
        Nvml().init()
    assert pynvml.nvmlLib is None
    assert nvml_library_users() == 0


# ----- shutdown ----------------------------------------------------------------------------------
class TestShutdown:
    def test_frees_events_and_shuts_down(self, ready: Nvml, driver: SimDriver) -> None:
        """shutdown() frees the event set and shuts NVML down."""
        ready.shutdown()
        assert driver.calls["nvmlEventSetFree"] == 1
        assert driver.calls["nvmlShutdown"] == 1
        with pytest.raises(pynvml.NVMLError_Uninitialized):
            pynvml.nvmlDeviceGetCount()
        with pytest.raises(EventWaitError):
            ready.wait_event(0)

    def test_errors_are_not_raised(self, nvml: Nvml, driver: SimDriver) -> None:
        """A failing nvmlShutdown is logged, not raised."""
        nvml.init()
        driver.fail("nvmlShutdown", UNKNOWN, count=1)
        with structlog.testing.capture_logs() as logs:
            nvml.shutdown()
        assert [e["event"] for e in logs] == ["nvml shutdown failed"]
        nvml.shutdown()  # the real one, so the simulated driver ends uninitialised

    def test_shuts_down_even_if_freeing_events_fails(self, ready: Nvml, driver: SimDriver) -> None:
        """A failure to free the event set does not keep NVML initialised."""
        driver.fail("nvmlEventSetFree", UNKNOWN)
        ready.shutdown()
        assert driver.calls["nvmlShutdown"] == 1
        with pytest.raises(pynvml.NVMLError_Uninitialized):
            pynvml.nvmlDeviceGetCount()
