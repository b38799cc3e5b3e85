"""The NVML backend's health events: registered per GPU, waited for, and turned into the domain's
health events.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import structlog.testing

from gpu.nvml.rig import ACTION_NONE, GPU_IS_LOST, GPU_RESET, GPUS, NOT_SUPPORTED, UNKNOWN
from gpuagent.domain.health import (
    DoubleBitEccError,
    GpuLost,
    HealthEvent,
    RecoveryActionChanged,
    Responding,
    XidError,
)
from gpuagent.gpu.backend import DriverEvent
from gpuagent.gpu.nvml import (
    EventWaitError,
    Nvml,
)
from gpuagent.gpu.sim import SimDriver, install, node_from_count, node_from_mapping, uninstall


# ----- events ------------------------------------------------------------------------------------
class TestEvents:
    @pytest.mark.parametrize(
        ("gpu", "fault", "params", "expected"),
        [
            (1, "xid", {"xid": 13}, [XidError(13)]),
            (3, "xid", {"xid": 31}, [XidError(31)]),
            (2, "xid", {"xid": 79}, [XidError(79), RecoveryActionChanged(GPU_RESET)]),
            (0, "ecc_dbe", {}, [DoubleBitEccError(), RecoveryActionChanged(GPU_RESET)]),
            (3, "recover", {}, [RecoveryActionChanged(ACTION_NONE)]),
            (2, "recovery_action", {"action": "node_reboot"}, [RecoveryActionChanged(2)]),
            (2, "recovery_action", {"action": "drain_and_reset"}, [RecoveryActionChanged(4)]),
        ],
    )
    def test_events_name_the_gpu(
        self,
        ready: Nvml,
        driver: SimDriver,
        gpu: int,
        fault: str,
        params: dict[str, object],
        expected: list[HealthEvent],
    ) -> None:
        """Driver events become domain health events on the right GPU, in order.

        The recovery action is read from its field when its event arrives: the event's data is 0.
        """
        driver.inject(gpu, fault, **params)  # type: ignore[arg-type]
        received = [ready.wait_event(1000) for _ in expected]
        assert received == [DriverEvent(gpu, event) for event in expected]
        assert ready.wait_event(0) is None

    def test_lost_gpu_events_then_lost_waits(self, ready: Nvml, driver: SimDriver) -> None:
        """A lost GPU's events come first; then every wait reports the lost GPU.

        The recovery-action event's field cannot be read from a lost GPU: that says it is lost.
        """
        driver.inject(1, "lost")
        assert ready.wait_event(1000) == DriverEvent(1, XidError(79))
        assert ready.wait_event(1000) == DriverEvent(1, GpuLost())
        with pytest.raises(EventWaitError) as caught:
            ready.wait_event(1000)
        assert caught.value.lost

    def test_rebuilt_set_leaves_out_the_lost_gpu(self, ready: Nvml, driver: SimDriver) -> None:
        """A set registered again without the lost GPU waits normally; with it back, it hears it."""
        driver.inject(1, "lost")
        while True:
            try:
                ready.wait_event(0)
            except EventWaitError:
                break
        assert ready.rebuild_events((0, 2, 3)) == {}
        driver.inject(2, "xid", 13)
        assert ready.wait_event(1000) == DriverEvent(2, XidError(13))
        assert ready.wait_event(0) is None
        driver.inject(1, "recover")
        assert ready.rebuild_events((0, 1, 2, 3)) == {}
        driver.inject(1, "xid", 13)
        assert ready.wait_event(1000) == DriverEvent(1, XidError(13))
        assert driver.calls["nvmlEventSetFree"] == 2

    @pytest.mark.parametrize("xid", [0, 1000, 2**32, 2**64 - 1])
    def test_xid_out_of_range_is_refused(self, ready: Nvml, driver: SimDriver, xid: int) -> None:
        """An XID value that cannot be one is no event; it is counted and logged once."""
        with structlog.testing.capture_logs() as logs:
            for _ in range(2):
                driver.inject(0, "xid", xid)
                assert ready.wait_event(1000) is None
        assert dict(ready.calls.stats())["nvmlEventSetWait_v2:refused"].errors == 2
        assert [e["event"] for e in logs] == ["nvml value refused"]

    def test_event_matched_by_uuid_when_the_handle_is_new(
        self, ready: Nvml, driver: SimDriver
    ) -> None:
        """An event whose device handle the backend has not seen is matched by its UUID."""
        ready._events._by_address.clear()  # as if the driver handed out a new handle for the GPU
        driver.inject(3, "xid", 48)
        assert ready.wait_event(1000) == DriverEvent(3, XidError(48))

    def test_mig_instance_ids(self, tmp_path: Path) -> None:
        """An XID on a MIG instance carries its GPU and compute instance IDs; others none."""
        node = node_from_mapping({"version": "v1", "gpus": [{"mig": ["3g.40gb", "3g.40gb"]}]})
        drv = SimDriver(node)
        install(drv)
        backend = Nvml(sysfs_root=tmp_path)
        try:
            backend.init()
            (gpu,) = backend.discover()
            assert backend.open_events() == {}
            gis = sorted(m.gpu_instance_id for m in gpu.mig_devices)
            drv.inject(0, "xid", 31, gpu_instance=gis[1], compute_instance=0)
            drv.inject(0, "xid", 43, gpu_instance=gis[0])
            drv.inject(0, "xid", 79 - 1)
            assert [backend.wait_event(1000) for _ in range(3)] == [
                DriverEvent(0, XidError(31, gis[1], 0)),
                DriverEvent(0, XidError(43, gis[0], None)),
                DriverEvent(0, XidError(78, None, None)),
            ]
        finally:
            backend.shutdown()
            uninstall()

    def test_driver_before_r565(self, tmp_path: Path) -> None:
        """R560: no recovery-action event or field; XIDs still arrive, probes read no action."""
        node = dataclasses.replace(node_from_count(2), driver_version="560.35.03")
        drv = SimDriver(node)
        install(drv)
        backend = Nvml(sysfs_root=tmp_path)
        try:
            backend.init()
            backend.discover()
            assert backend.open_events() == {}
            drv.inject(1, "xid", 79)
            assert backend.wait_event(1000) == DriverEvent(1, XidError(79))
            assert backend.wait_event(0) is None
            probe = backend.probe(0)
            assert probe.recovery_action is None
            assert probe.events == (Responding(),)
        finally:
            backend.shutdown()
            uninstall()

    def test_timeout_is_none(self, ready: Nvml) -> None:
        """A wait that sees no event within the timeout returns None: an answer, not a failed
        NVML call (gpuagent_nvml_calls_total{result="error"} does not grow with every wait)."""
        assert ready.wait_event(10) is None
        waits = dict(ready.calls.stats())["nvmlEventSetWait_v2"]
        assert waits.count >= 1
        assert waits.errors == 0

    @pytest.mark.parametrize(
        ("code", "lost", "text"),
        [
            (GPU_IS_LOST, True, "GPU is lost (NVML 15)"),
            (UNKNOWN, False, "Unknown Error (NVML 999)"),
        ],
    )
    def test_wait_failure(
        self, ready: Nvml, driver: SimDriver, code: int, lost: bool, text: str
    ) -> None:
        """A failed wait raises EventWaitError; ``lost`` says whether NVML reported a lost GPU."""
        driver.fail("nvmlEventSetWait_v2", code, count=1)
        with pytest.raises(EventWaitError) as caught:
            ready.wait_event(100)
        assert caught.value.lost is lost
        assert str(caught.value) == text
        assert ready.wait_event(0) is None  # the failure was one wait's, not the set's

    def test_wait_before_open(self, nvml: Nvml) -> None:
        """Waiting without an event set is an error, not a hang or a crash inside pynvml."""
        nvml.init()
        nvml.discover()
        with pytest.raises(EventWaitError) as caught:
            nvml.wait_event(10)
        assert caught.value.lost is False

    def test_registration_not_supported_is_no_failure(self, nvml: Nvml, driver: SimDriver) -> None:
        """A GPU without event support is left to the probe; the others still get events."""
        driver.fail("nvmlDeviceRegisterEvents", NOT_SUPPORTED, gpu=1)
        nvml.init()
        nvml.discover()
        assert nvml.open_events() == {}
        driver.inject(1, "xid", 13)
        driver.inject(2, "xid", 13)
        assert nvml.wait_event(1000) == DriverEvent(2, XidError(13))
        assert nvml.wait_event(0) is None

    def test_registration_error_is_returned_for_that_gpu(
        self, nvml: Nvml, driver: SimDriver
    ) -> None:
        """Any other registration error is reported for that GPU only."""
        driver.fail("nvmlDeviceRegisterEvents", UNKNOWN, gpu=2)
        nvml.init()
        nvml.discover()
        assert nvml.open_events() == {2: "Unknown Error (NVML 999)"}
        driver.inject(0, "xid", 13)
        assert nvml.wait_event(1000) == DriverEvent(0, XidError(13))

    def test_supported_types_not_supported_is_no_failure(
        self, nvml: Nvml, driver: SimDriver
    ) -> None:
        """A GPU that cannot even list its event types counts as one without event support."""
        driver.remove("nvmlDeviceGetSupportedEventTypes")
        nvml.init()
        nvml.discover()
        assert nvml.open_events() == {}

    def test_event_set_creation_failure_fails_every_gpu(
        self, nvml: Nvml, driver: SimDriver
    ) -> None:
        """Without an event set every GPU is reported as unregistered."""
        driver.fail("nvmlEventSetCreate", UNKNOWN)
        nvml.init()
        nvml.discover()
        assert nvml.open_events() == dict.fromkeys(range(GPUS), "Unknown Error (NVML 999)")
