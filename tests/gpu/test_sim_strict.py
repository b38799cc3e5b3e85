"""The simulator as strict as nvml.h: what a real driver answers that the agent must cope with.

Event data, MIG instance IDs, privileges under MIG, drivers before R565, injected call errors,
call latency and cold GPUs — each through the real pynvml wrappers.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import pynvml
import pytest
from support.clock import WAIT_S, Sleeps, blocked_in
from support.simnvml import Run

from gpuagent.gpu.sim import SimDriver, installed, node_from_count, node_from_mapping
from gpuagent.gpu.sim.config import load_sim_config
from gpuagent.gpu.sim.spec import SimConfigError, SimLatency

XID = pynvml.nvmlEventTypeXidCriticalError
DBE = pynvml.nvmlEventTypeDoubleBitEccError
RECOVERY = pynvml.nvmlEventTypeGpuRecoveryAction
NO_INSTANCE = 0xFFFF_FFFF


def handle(index: int) -> Any:
    return pynvml.nvmlDeviceGetHandleByIndex(index)


def recovery_field(index: int) -> tuple[int, int]:
    """``(nvmlReturn, value)`` of the recovery-action field."""
    (slot,) = pynvml.nvmlDeviceGetFieldValues(
        handle(index), [pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION]
    )
    return int(slot.nvmlReturn), int(slot.value.uiVal)


def events(driver: SimDriver, mask: int, gpus: range) -> Any:
    event_set = pynvml.nvmlEventSetCreate()
    for index in gpus:
        pynvml.nvmlDeviceRegisterEvents(handle(index), mask, event_set)
    return event_set


def drain(event_set: Any) -> list[tuple[int, int, int, int]]:
    """``(type, data, gpu instance, compute instance)`` of every queued event."""
    seen: list[tuple[int, int, int, int]] = []
    while True:
        try:
            data = pynvml.nvmlEventSetWait_v2(event_set, 0)
        except pynvml.NVMLError_Timeout:
            return seen
        seen.append(
            (
                int(data.eventType),
                int(data.eventData),
                int(data.gpuInstanceId),
                int(data.computeInstanceId),
            )
        )


class TestRecoveryAction:
    @pytest.mark.parametrize(
        ("action", "value"),
        [
            ("none", 0),
            ("gpu_reset", 1),
            ("node_reboot", 2),
            ("drain_p2p", 3),
            ("drain_and_reset", 4),
        ],
    )
    def test_sets_the_field_and_announces_it_with_data_0(
        self, run: Run, action: str, value: int
    ) -> None:
        driver = run(node_from_count(2))
        event_set = events(driver, XID | DBE | RECOVERY, range(2))
        state = driver.inject(1, "recovery_action", action=action)
        assert state["recovery_action"] == action
        assert recovery_field(1) == (pynvml.NVML_SUCCESS, value)
        assert drain(event_set) == [(RECOVERY, 0, NO_INSTANCE, NO_INSTANCE)]

    def test_driver_before_r565(self, run: Run) -> None:
        """R560: no recovery-action event type, no field; an XID still arrives."""
        driver = run(replace(node_from_count(2), driver_version="560.35.03"))
        supported = pynvml.nvmlDeviceGetSupportedEventTypes(handle(0))
        assert not supported & RECOVERY
        assert supported & (XID | DBE) == XID | DBE
        with pytest.raises(pynvml.NVMLError_NotSupported):
            pynvml.nvmlDeviceRegisterEvents(handle(0), XID | RECOVERY, pynvml.nvmlEventSetCreate())
        assert recovery_field(0)[0] == pynvml.NVML_ERROR_NOT_SUPPORTED
        event_set = events(driver, XID | DBE, range(2))
        driver.inject(0, "xid", 79)
        driver.inject(0, "recovery_action", action="gpu_reset")  # nothing to show on this driver
        assert drain(event_set) == [(XID, 79, NO_INSTANCE, NO_INSTANCE)]


MIG_NODE = {"version": "v1", "gpus": [{"mig": ["3g.40gb", "2g.20gb", "1g.10gb"]}, {}]}


class TestMigEvents:
    def test_instance_ids_on_the_event(self, run: Run) -> None:
        driver = run(node_from_mapping(MIG_NODE))
        event_set = events(driver, XID, range(2))
        devices: Any = driver.describe()[0]["mig_devices"]
        gis = [m["gpu_instance"] for m in devices]
        driver.inject(0, "xid", 31, gpu_instance=gis[1], compute_instance=0)
        driver.inject(0, "xid", 43, gpu_instance=gis[2])
        driver.inject(0, "xid", 13)
        assert drain(event_set) == [
            (XID, 31, gis[1], 0),
            (XID, 43, gis[2], NO_INSTANCE),
            (XID, 13, NO_INSTANCE, NO_INSTANCE),
        ]

    @pytest.mark.parametrize(
        ("gpu", "params", "message"),
        [
            (1, {"gpu_instance": 1}, "has no GPU instance"),
            (0, {"gpu_instance": 5}, "has no GPU instance"),
            (0, {"gpu_instance": "1"}, "must be an instance ID"),
            (0, {"compute_instance": 0}, "needs a gpu_instance"),
            (0, {"gpu_instance": -1}, "must be from 0"),
        ],
    )
    def test_instances_that_do_not_exist(
        self, run: Run, gpu: int, params: dict[str, object], message: str
    ) -> None:
        driver = run(node_from_mapping(MIG_NODE))
        with pytest.raises(ValueError, match=message):
            driver.inject(gpu, "xid", 31, **params)

    def test_describe_names_instance_ids(self, run: Run) -> None:
        driver = run(node_from_mapping(MIG_NODE))
        devices: Any = driver.describe()[0]["mig_devices"]
        assert sorted(d["profile"] for d in devices) == ["1g.10gb", "2g.20gb", "3g.40gb"]
        for device in devices:
            mig = pynvml.nvmlDeviceGetHandleByUUID(device["uuid"])
            assert pynvml.nvmlDeviceGetGpuInstanceId(mig) == device["gpu_instance"]
            assert pynvml.nvmlDeviceGetComputeInstanceId(mig) == device["compute_instance"]


class TestCallErrors:
    @pytest.mark.parametrize(
        ("error", "raised"),
        [
            ("unknown", pynvml.NVMLError_Unknown),
            ("no_permission", pynvml.NVMLError_NoPermission),
            ("timeout", pynvml.NVMLError_Timeout),
        ],
    )
    def test_on_one_gpu_until_recover(self, run: Run, error: str, raised: type) -> None:
        driver = run(node_from_count(2))
        state = driver.inject(1, "call_error", symbol="nvmlDeviceGetPowerUsage", error=error)
        assert state["call_errors"] == ["nvmlDeviceGetPowerUsage"]
        for _ in range(3):
            with pytest.raises(raised):
                pynvml.nvmlDeviceGetPowerUsage(handle(1))
        assert pynvml.nvmlDeviceGetPowerUsage(handle(0)) > 0
        driver.inject(1, "recover")
        assert pynvml.nvmlDeviceGetPowerUsage(handle(1)) > 0
        assert driver.describe()[1]["call_errors"] == []

    def test_a_call_for_no_gpu_fails_driver_wide(self, run: Run) -> None:
        """An event wait names no GPU: its error applies to every wait, until that GPU recovers."""
        driver = run(node_from_count(2))
        event_set = events(driver, XID, range(2))
        driver.inject(0, "call_error", symbol="nvmlEventSetWait_v2", error="unknown")
        assert driver.describe()[0]["call_errors"] == ["nvmlEventSetWait_v2"]
        with pytest.raises(pynvml.NVMLError_Unknown):
            pynvml.nvmlEventSetWait_v2(event_set, 0)
        driver.inject(1, "recover")  # another GPU's recovery does not end it
        with pytest.raises(pynvml.NVMLError_Unknown):
            pynvml.nvmlEventSetWait_v2(event_set, 0)
        driver.inject(0, "recover")
        with pytest.raises(pynvml.NVMLError_Timeout):
            pynvml.nvmlEventSetWait_v2(event_set, 0)


class TestPrivileges:
    def test_default_is_the_base_manifests(self) -> None:
        assert node_from_count(1).cap_sys_admin is False

    def test_liveness_call(self, run: Run) -> None:
        run(node_from_count(1))
        assert pynvml.nvmlDeviceGetPerformanceState(handle(0)) == pynvml.NVML_PSTATE_0


class TestLatency:
    """Latencies are asked of the driver's ``sleep``; the tests record what was asked."""

    def test_each_call_takes_its_time(self, run: Run) -> None:
        node = node_from_count(1)
        sleeps = Sleeps()
        latency = SimLatency(default_s=0.0, calls={"nvmlDeviceGetPowerUsage": 0.05})
        run(replace(node, latency=latency), sleep=sleeps)
        h = handle(0)
        assert sleeps.seconds == []  # calls without a latency ask for no sleep
        pynvml.nvmlDeviceGetPowerUsage(h)
        pynvml.nvmlDeviceGetPowerUsage(h)
        assert sleeps.seconds == [0.05, 0.05]

    def test_the_default_applies_to_calls_not_named(self, run: Run) -> None:
        node = node_from_count(1)
        sleeps = Sleeps()
        latency = SimLatency(default_s=0.001, calls={"nvmlDeviceGetPowerUsage": 0.05})
        run(replace(node, latency=latency), sleep=sleeps)
        sleeps.asked.clear()  # nvmlInit's
        pynvml.nvmlDeviceGetTemperature(handle(0), pynvml.NVML_TEMPERATURE_GPU)
        assert sleeps.seconds == [0.001, 0.001]  # the handle lookup, then the call

    def test_a_field_adds_its_cost_to_a_field_values_call(self, run: Run) -> None:
        """The energy counter costs as much through a field as through its own call (3.2 ms on
        the real H200): a field-values call asking for it takes that much longer, once."""
        node = node_from_count(1)
        sleeps = Sleeps()
        energy = pynvml.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION
        latency = SimLatency(
            default_s=0.0, calls={"nvmlDeviceGetFieldValues": 0.001}, fields={energy: 0.003}
        )
        run(replace(node, latency=latency), sleep=sleeps)
        h = handle(0)
        pynvml.nvmlDeviceGetFieldValues(h, [pynvml.NVML_FI_DEV_MEMORY_TEMP])
        pynvml.nvmlDeviceGetFieldValues(h, [energy, pynvml.NVML_FI_DEV_MEMORY_TEMP, energy])
        assert sleeps.seconds == [0.001, pytest.approx(0.004)]

    def test_microsecond_calls_are_not_slept(self, run: Run) -> None:
        """A sleep of a few microseconds would take 50-100: calls the real driver answers that
        fast (the built-in default) ask for no sleep at all."""
        sleeps = Sleeps()
        run(node_from_count(1), sleep=sleeps)
        sleeps.asked.clear()  # nvmlInit's
        pynvml.nvmlDeviceGetPowerUsage(handle(0))
        assert sleeps.seconds == []
        pynvml.nvmlDeviceGetTotalEnergyConsumption(handle(0))
        assert sleeps.seconds == [pytest.approx(0.00319)]

    def test_the_builtin_latencies_are_the_real_h200s(self) -> None:
        """Measured on the real H200 (../shared/reference/real-h200/README.md): per-process
        utilisation costs milliseconds even when it answers NOT_FOUND, and so does energy."""
        latency = node_from_count(1).latency
        assert latency.of("nvmlDeviceGetProcessesUtilizationInfo") == pytest.approx(0.0025)
        assert latency.of("nvmlDeviceGetProcessUtilization") == pytest.approx(0.00241)
        assert latency.of("nvmlDeviceGetTotalEnergyConsumption") == pytest.approx(0.00319)
        energy = pynvml.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION
        assert latency.of_fields([energy]) == pytest.approx(0.0032)
        assert latency.of("nvmlDeviceGetPowerUsage") <= 0.00001

    def test_a_cold_gpu_is_brought_up_by_its_first_call(self, run: Run) -> None:
        """The first call on each GPU pays the bring-up; other calls on it wait for it."""
        node = node_from_count(2)
        sleeps = Sleeps(hold=0.2)
        run(replace(node, latency=SimLatency(default_s=0.0, calls={}, cold_start_s=0.2)), sleeps)
        assert sleeps.seconds == []  # nvmlInit touches no GPU
        returned: list[int] = []

        def bring_up_gpu1() -> None:
            handle(1)
            returned.append(threading.get_ident())

        threads = [threading.Thread(target=bring_up_gpu1, daemon=True) for _ in range(2)]
        for thread in threads:
            thread.start()
        try:
            assert sleeps.holding.wait(WAIT_S)  # one of them is bringing GPU 1 up
            ((_, bringing),) = sleeps.asked
            (other,) = [t.ident for t in threads if t.ident != bringing]
            # The other is held at GPU 1's bring-up, not past it.
            assert other is not None
            assert blocked_in(other, "_bring_up"), "the second call did not wait for the bring-up"
            assert returned == []
        finally:
            sleeps.release()
            for thread in threads:
                thread.join(WAIT_S)
        assert len(returned) == 2  # both calls returned, after the one bring-up
        assert sleeps.seconds == [0.2]  # one bring-up for both calls
        first = handle(0)
        pynvml.nvmlDeviceGetPowerUsage(first)
        pynvml.nvmlDeviceGetPowerUsage(handle(1))
        assert sleeps.seconds == [0.2, 0.2]  # GPU 0's, once; warm GPUs cost nothing more

    def test_cold_again_after_the_last_client_leaves(self, run: Run) -> None:
        node = node_from_count(1)
        sleeps = Sleeps()
        latency = SimLatency(default_s=0.0, calls={}, cold_start_s=0.1)
        driver = run(replace(node, latency=latency), sleep=sleeps)
        handle(0)
        handle(0)
        assert sleeps.seconds == [0.1]
        pynvml.nvmlShutdown()
        pynvml.nvmlInit()
        handle(0)
        assert sleeps.seconds == [0.1, 0.1]
        assert driver.calls["nvmlDeviceGetHandleByIndex_v2"] == 3


class TestSimConfig:
    def write(self, tmp_path: Path, text: str) -> Path:
        path = tmp_path / "node.yaml"
        path.write_text(text)
        return path

    def test_driver_privileges_and_latency(self, tmp_path: Path) -> None:
        node = load_sim_config(
            self.write(
                tmp_path,
                "version: v1\ngpus: [{}]\ndriver_version: 560.35.03\ncap_sys_admin: true\n"
                "latency: {default_ms: 0.5, calls: {nvmlDeviceGetFieldValues: 2},"
                " cold_start_ms: 1500, fields: {83: 4}}\n",
            )
        )
        assert node.driver_version == "560.35.03"
        assert not node.has_recovery_action
        assert node.cap_sys_admin
        assert node.latency.of("nvmlDeviceGetPowerUsage") == pytest.approx(0.0005)
        assert node.latency.of("nvmlDeviceGetFieldValues") == pytest.approx(0.002)
        assert node.latency.cold_start_s == pytest.approx(1.5)
        assert node.latency.of_fields([83]) == pytest.approx(0.004)

    @pytest.mark.parametrize(
        ("text", "key"),
        [
            ("driver_version: latest", "driver_version"),
            ("cap_sys_admin: yes please", "cap_sys_admin"),
            ("latency: 3", "latency"),
            ("latency: {slow: 1}", "latency.slow"),
            ("latency: {default_ms: -1}", "latency.default_ms"),
            ("latency: {default_ms: .nan}", "latency.default_ms"),
            ("latency: {calls: {nvmlMadeUp: 1}}", "latency.calls.nvmlMadeUp"),
            ("latency: {cold_start_ms: true}", "latency.cold_start_ms"),
            ("latency: {fields: [83]}", "latency.fields"),
            ("latency: {fields: {energy: 1}}", "latency.fields.energy"),
            ("latency: {fields: {0: 1}}", "latency.fields.0"),
            ("latency: {fields: {83: -1}}", "latency.fields.83"),
            ("capture: 7", "capture"),
            ("capture: missing.json", "capture"),
            ("numa_from_nvml: 1", "numa_from_nvml"),
            ("host: vm", "host"),
            ("host: {bios: x}", "host.bios"),
            ("host: {product_name: 7}", "host.product_name"),
            ('host: {product_name: "a\\nb"}', "host.product_name"),
            ("host: {numa: maybe}", "host.numa"),
        ],
    )
    def test_errors_name_the_key(self, tmp_path: Path, text: str, key: str) -> None:
        with pytest.raises(SimConfigError) as caught:
            load_sim_config(self.write(tmp_path, f"version: v1\ngpus: [{{}}]\n{text}\n"))
        assert caught.value.key == key

    @pytest.mark.parametrize(
        ("gpu", "key"),
        [
            ("{nvlink: no-thanks}", "gpus[0].nvlink"),
            ("{pci_class: 3D}", "gpus[0].pci_class"),
            ('{pci_class: "0x0302"}', "gpus[0].pci_class"),
            ("{pci_class: 0x1000000}", "gpus[0].pci_class"),
            ("{colour: green}", "gpus[0].colour"),
        ],
    )
    def test_gpu_errors_name_the_key(self, tmp_path: Path, gpu: str, key: str) -> None:
        with pytest.raises(SimConfigError) as caught:
            load_sim_config(self.write(tmp_path, f"version: v1\ngpus: [{gpu}]\n"))
        assert caught.value.key == key

    def test_host_and_gpu_facts(self, tmp_path: Path) -> None:
        node = load_sim_config(
            self.write(
                tmp_path,
                "version: v1\ngpus: [{pci_class: 0x030000}, {nvlink: false}]\n"
                "host: {product_name: DGX H100, numa: false}\nnuma_from_nvml: true\n",
            )
        )
        assert [g.pci_class for g in node.gpus] == ["0x030000", "0x030200"]
        assert [g.nvlink_slots for g in node.gpus] == [18, 0]
        assert (node.host.product_name, node.host.numa, node.numa_from_nvml) == (
            "DGX H100",
            False,
            True,
        )

    def test_a_gpu_without_nvlink_cannot_be_linked(self, tmp_path: Path) -> None:
        text = "version: v1\ngpus: [{}, {nvlink: false}]\nnvlinks: [[0, 1, 2]]\n"
        with pytest.raises(SimConfigError) as caught:
            load_sim_config(self.write(tmp_path, text))
        assert caught.value.key == "nvlinks[0]"


class TestWithoutNvlink:
    """A GPU whose NVLinks the driver does not show answers NOT_SUPPORTED for every NVLink call
    and field, as the real H200 (a VM's passed-through GPU) did."""

    FIELDS = (
        pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX,
        pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX,
        pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT,
        pynvml.NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL,
        pynvml.NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL,
        pynvml.NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL,
        pynvml.NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL,
    )

    def returns(self, index: int) -> list[int]:
        ids = [*self.FIELDS, *([pynvml.NVML_FI_DEV_NVLINK_GET_STATE] * 3)]
        requests = [(f, 0xFFFF_FFFF if f in self.FIELDS[:2] else 0) for f in ids]
        requests[-3:] = [(pynvml.NVML_FI_DEV_NVLINK_GET_STATE, link) for link in range(3)]
        slots = pynvml.nvmlDeviceGetFieldValues(handle(index), requests)
        return [int(slot.nvmlReturn) for slot in slots]

    def test_every_nvlink_field_and_call(self, run: Run) -> None:
        node = node_from_mapping({"version": "v1", "gpus": [{}, {"nvlink": False}]})
        run(node)
        assert set(self.returns(1)) == {pynvml.NVML_ERROR_NOT_SUPPORTED}
        with pytest.raises(pynvml.NVMLError_NotSupported):
            pynvml.nvmlDeviceGetNvLinkState(handle(1), 0)
        # The SXM GPU beside it has 18 links, none active: the counters answer, zero.
        assert set(self.returns(0)) == {pynvml.NVML_SUCCESS}
        assert pynvml.nvmlDeviceGetNvLinkState(handle(0), 0) == pynvml.NVML_FEATURE_DISABLED


def test_handles_stay_put() -> None:
    """A GPU's handle is the same object for every lookup (events are matched by it first)."""
    with installed(SimDriver(node_from_count(2))):
        pynvml.nvmlInit()
        try:
            a = ctypes.addressof(handle(1).contents)
            b = ctypes.addressof(
                pynvml.nvmlDeviceGetHandleByUUID(pynvml.nvmlDeviceGetUUID(handle(1))).contents
            )
            assert a == b
        finally:
            pynvml.nvmlShutdown()
