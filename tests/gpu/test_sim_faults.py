"""Faults and test hooks of the simulated driver, observed through the real pynvml wrappers."""

from __future__ import annotations

import ctypes
import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pynvml
import pytest
from support.clock import WAIT_S, blocked_in

from gpuagent.gpu.sim import SimDriver, installed, node_from_count, node_from_mapping
from gpuagent.gpu.sim.state import RESET_XIDS

XID = pynvml.nvmlEventTypeXidCriticalError
DBE = pynvml.nvmlEventTypeDoubleBitEccError
RECOVERY = pynvml.nvmlEventTypeGpuRecoveryAction
HEALTH = XID | DBE | RECOVERY
GPU_RESET = pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET
NONE = pynvml.NVML_GPU_RECOVERY_ACTION_NONE


@pytest.fixture
def driver() -> Iterator[SimDriver]:
    """A 4-GPU node, installed below pynvml and initialised."""
    with installed(SimDriver(node_from_count(4))) as drv:
        pynvml.nvmlInit()
        yield drv


@pytest.fixture
def events(driver: SimDriver) -> Iterator[Any]:
    """An event set with every GPU registered for XID, double-bit ECC and recovery events."""
    event_set = pynvml.nvmlEventSetCreate()
    for index in range(4):
        pynvml.nvmlDeviceRegisterEvents(handle(index), HEALTH, event_set)
    yield event_set
    pynvml.nvmlEventSetFree(event_set)


def handle(index: int) -> Any:
    return pynvml.nvmlDeviceGetHandleByIndex(index)


def drain(event_set: Any, *, until_lost: bool = False) -> list[tuple[int, int, int]]:
    """Every queued event as ``(gpu index, event type, event data)``, until a wait times out
    (``until_lost``: until the wait answers GPU_IS_LOST, as for a set holding a lost GPU)."""
    end, wait_ms = (
        (pynvml.NVMLError_GpuIsLost, 1000) if until_lost else (pynvml.NVMLError_Timeout, 0)
    )
    addresses = {ctypes.addressof(handle(i).contents): i for i in range(4)}
    seen: list[tuple[int, int, int]] = []
    while True:
        try:
            data = pynvml.nvmlEventSetWait_v2(event_set, wait_ms)
        except end:
            return seen
        gpu = addresses[ctypes.addressof(data.device.contents)]
        seen.append((gpu, int(data.eventType), int(data.eventData)))


def volatile_dbe(index: int) -> int:
    (count,) = pynvml.nvmlDeviceGetFieldValues(
        handle(index), [pynvml.NVML_FI_DEV_ECC_DBE_VOL_TOTAL]
    )
    return int(count.value.ullVal)


def recovery_action(index: int) -> int:
    (value,) = pynvml.nvmlDeviceGetFieldValues(
        handle(index), [pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION]
    )
    assert value.nvmlReturn == pynvml.NVML_SUCCESS
    return int(value.value.uiVal)


def blocked_wait(timeout_ms: int = 600_000) -> tuple[Any, threading.Thread, list[BaseException]]:
    """A fresh event set (GPU 0's XIDs) and a thread blocked in its wait (shown by its stack);
    what the wait raises is appended to the list."""
    event_set = pynvml.nvmlEventSetCreate()
    pynvml.nvmlDeviceRegisterEvents(handle(0), XID, event_set)
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            pynvml.nvmlEventSetWait_v2(event_set, timeout_ms)
        except pynvml.NVMLError as exc:
            errors.append(exc)

    thread = threading.Thread(target=wait)
    thread.start()
    assert thread.ident is not None
    assert blocked_in(thread.ident, "_wait", via=("wait", "wait_for")), "the wait never blocked"
    return event_set, thread, errors


class TestXid:
    def test_plain_xid(self, driver: SimDriver, events: Any) -> None:
        """An XID that needs no reset is one XID event; the recovery action stays NONE."""
        state = driver.inject(1, "xid", 13)
        assert drain(events) == [(1, XID, 13)]
        assert recovery_action(1) == NONE
        assert (state["last_xid"], state["xid_count"], state["recovery_action"]) == (13, 1, "none")

    @pytest.mark.parametrize("xid", sorted(RESET_XIDS))
    def test_reset_xid(self, driver: SimDriver, events: Any, xid: int) -> None:
        """An XID that needs a GPU reset also sets and announces recovery action GPU_RESET."""
        state = driver.inject(2, "xid", xid)
        # eventData is the XID for an XID event and 0 for every other type (nvml.h): the action
        # itself is read from the recovery-action field.
        assert drain(events) == [(2, XID, xid), (2, RECOVERY, 0)]
        assert recovery_action(2) == GPU_RESET
        assert state["recovery_action"] == "gpu_reset"
        assert recovery_action(1) == NONE

    def test_event_data_of_every_gpu(self, driver: SimDriver, events: Any) -> None:
        """Each event names the GPU it happened on through the device handle."""
        for index in range(4):
            driver.inject(index, "xid", 31 + index)
        assert drain(events) == [(i, XID, 31 + i) for i in range(4)]

    def test_counts(self, driver: SimDriver) -> None:
        """describe() keeps the last XID and how many XIDs there were."""
        for xid in (13, 43, 45):
            driver.inject(0, "xid", xid)
        state = driver.describe()[0]
        assert (state["last_xid"], state["xid_count"]) == (45, 3)
        assert driver.describe()[1]["xid_count"] == 0


class TestLost:
    @pytest.mark.parametrize(
        "call",
        [
            pynvml.nvmlDeviceGetUUID,
            pynvml.nvmlDeviceGetName,
            pynvml.nvmlDeviceGetMemoryInfo,
            pynvml.nvmlDeviceGetPciInfo,
            pynvml.nvmlDeviceGetPowerUsage,
            pynvml.nvmlDeviceGetUtilizationRates,
            pynvml.nvmlDeviceGetTotalEnergyConsumption,
            pynvml.nvmlDeviceGetSupportedEventTypes,
            lambda h: pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU),
            lambda h: pynvml.nvmlDeviceGetFieldValues(h, [230]),
            lambda h: pynvml.nvmlDeviceGetTopologyCommonAncestor(handle(0), h),
        ],
    )
    def test_device_calls_fail(self, driver: SimDriver, call: Callable[[Any], object]) -> None:
        """Once lost, per-device calls on the GPU raise NVMLError_GpuIsLost."""
        driver.inject(3, "lost")
        with pytest.raises(pynvml.NVMLError_GpuIsLost):
            call(handle(3))

    def test_event_and_state(self, driver: SimDriver, events: Any) -> None:
        """Losing a GPU raises XID 79 (which needs a reset) and shows it lost."""
        state = driver.inject(3, "lost")
        assert drain(events, until_lost=True) == [(3, XID, 79), (3, RECOVERY, 0)]
        assert (state["state"], state["last_xid"]) == ("lost", 79)

    def test_waits_keep_answering_lost(self, driver: SimDriver, events: Any) -> None:
        """After its events, a set holding a lost GPU answers every wait with GPU_IS_LOST at once.

        As a real driver does: a caller that retries at once spins.
        """
        driver.inject(3, "lost")
        drain(events, until_lost=True)
        for _ in range(3):
            # At once: with a ten-minute timeout, a wait that blocked would outlast the test.
            with pytest.raises(pynvml.NVMLError_GpuIsLost):
                in_thread(lambda: pynvml.nvmlEventSetWait_v2(events, 600_000))
        driver.inject(3, "recover")
        drain(events)  # times out again: the GPU answers

    def test_lookups_and_others_still_answer(self, driver: SimDriver) -> None:
        """Handles can still be looked up, other GPUs are unaffected."""
        uuid = driver.node.gpus[3].uuid
        driver.inject(3, "lost")
        lost = handle(3)
        by_uuid = pynvml.nvmlDeviceGetHandleByUUID(uuid)
        assert ctypes.addressof(by_uuid.contents) == ctypes.addressof(lost.contents)
        assert pynvml.nvmlDeviceGetCount() == 4
        assert pynvml.nvmlDeviceGetUUID(handle(2)) == driver.node.gpus[2].uuid

    def test_recover(self, driver: SimDriver, events: Any) -> None:
        """Recovering answers again, clears the recovery action and announces NONE."""
        driver.inject(3, "lost")
        drain(events, until_lost=True)
        state = driver.inject(3, "recover")
        assert pynvml.nvmlDeviceGetUUID(handle(3)) == driver.node.gpus[3].uuid
        assert recovery_action(3) == NONE
        assert drain(events) == [(3, RECOVERY, 0)]
        assert (state["state"], state["recovery_action"]) == ("ok", "none")


class TestEcc:
    def test_double_bit(self, driver: SimDriver, events: Any) -> None:
        """A DBE is an ECC event, counted, and asks for a GPU reset."""
        state = driver.inject(0, "ecc_dbe")
        assert drain(events) == [(0, DBE, 0), (0, RECOVERY, 0)]
        assert recovery_action(0) == GPU_RESET
        assert volatile_dbe(0) == 1
        assert (state["ecc_dbe_count"], state["recovery_action"]) == (1, "gpu_reset")

    def test_reset_zeroes_the_volatile_count(self, driver: SimDriver) -> None:
        """Volatile ECC counts start again from zero after a reset ("recover")."""
        driver.inject(0, "ecc_dbe")
        driver.inject(0, "ecc_dbe")
        assert volatile_dbe(0) == 2
        state = driver.inject(0, "recover")
        assert volatile_dbe(0) == 0
        assert state["ecc_dbe_count"] == 0


class TestEventSets:
    def test_supported_types(self, driver: SimDriver) -> None:
        """The GPU supports the health event types the agent needs."""
        supported = pynvml.nvmlDeviceGetSupportedEventTypes(handle(0))
        assert supported & (HEALTH | pynvml.nvmlEventTypeSingleBitEccError) == (
            HEALTH | pynvml.nvmlEventTypeSingleBitEccError
        )

    def test_every_type_is_supported_as_on_the_real_h200(self, driver: SimDriver) -> None:
        """An R580 Hopper reports every event type as supported (the real H200 did)."""
        assert pynvml.nvmlDeviceGetSupportedEventTypes(handle(0)) == pynvml.nvmlEventTypeAll
        event_set = pynvml.nvmlEventSetCreate()
        pynvml.nvmlDeviceRegisterEvents(handle(0), pynvml.nvmlEventTypeAll, event_set)

    def test_unsupported_types(self) -> None:
        """Registering for a type the GPU lacks is NOT_SUPPORTED, as in NVML: before R565 there
        is no recovery-action event."""
        older = node_from_mapping(
            {"version": "v1", "gpus": [{"name": "H100"}], "driver_version": "560.35.03"}
        )
        with installed(SimDriver(older)):
            pynvml.nvmlInit()
            try:
                event_set = pynvml.nvmlEventSetCreate()
                with pytest.raises(pynvml.NVMLError_NotSupported):
                    pynvml.nvmlDeviceRegisterEvents(handle(0), pynvml.nvmlEventTypeAll, event_set)
            finally:
                pynvml.nvmlShutdown()

    def test_only_registered_gpus_and_bits(self, driver: SimDriver) -> None:
        """Events go to each set registered for that GPU and bit, and nowhere else."""
        xid_only = pynvml.nvmlEventSetCreate()
        everything = pynvml.nvmlEventSetCreate()
        pynvml.nvmlDeviceRegisterEvents(handle(0), XID, xid_only)
        pynvml.nvmlDeviceRegisterEvents(handle(0), HEALTH, everything)
        pynvml.nvmlDeviceRegisterEvents(handle(1), HEALTH, everything)
        driver.inject(0, "xid", 79)
        driver.inject(2, "xid", 79)
        driver.inject(1, "ecc_dbe")
        assert drain(xid_only) == [(0, XID, 79)]
        assert drain(everything) == [
            (0, XID, 79),
            (0, RECOVERY, 0),
            (1, DBE, 0),
            (1, RECOVERY, 0),
        ]

    def test_wait_times_out(self, driver: SimDriver, events: Any) -> None:
        """Without events a wait blocks for its timeout, then raises NVMLError_Timeout."""
        start = time.monotonic()
        with pytest.raises(pynvml.NVMLError_Timeout):
            pynvml.nvmlEventSetWait_v2(events, 30)
        assert time.monotonic() - start >= 0.025

    def test_wait_woken_by_inject(self, driver: SimDriver, events: Any) -> None:
        """A blocked wait returns as soon as another thread injects a fault.

        The wait's timeout is ten minutes: only the injected event can end it within the test.
        """
        woke: list[tuple[int, int]] = []

        def wait() -> None:
            data = pynvml.nvmlEventSetWait_v2(events, 600_000)
            woke.append((int(data.eventType), int(data.eventData)))

        thread = threading.Thread(target=wait, daemon=True)
        thread.start()
        assert thread.ident is not None
        assert blocked_in(thread.ident, "_wait", via=("wait", "wait_for"))
        assert woke == []
        driver.inject(2, "xid", 13)
        thread.join(WAIT_S)
        assert woke == [(XID, 13)]

    def test_free_wakes_waiter(self, driver: SimDriver) -> None:
        """Freeing a set wakes a blocked waiter with INVALID_ARGUMENT; later waits get the same."""
        event_set, thread, errors = blocked_wait()
        pynvml.nvmlEventSetFree(event_set)
        thread.join(timeout=WAIT_S)
        assert not thread.is_alive()
        assert [type(e) for e in errors] == [pynvml.NVMLError_InvalidArgument]
        with pytest.raises(pynvml.NVMLError_InvalidArgument):
            pynvml.nvmlEventSetWait_v2(event_set, 0)
        with pytest.raises(pynvml.NVMLError_InvalidArgument):
            pynvml.nvmlEventSetFree(event_set)

    @pytest.mark.parametrize("release", ["nvmlEventSetFree", "nvmlShutdown"])
    def test_release_under_a_waiter_is_misuse(self, driver: SimDriver, release: str) -> None:
        """nvml.h allows neither freeing a set nor shutting NVML down under a blocked wait: the
        simulator records it (and wakes the waiter, so that a test fails rather than hangs)."""
        event_set, thread, errors = blocked_wait()
        assert driver.misuse == []
        if release == "nvmlEventSetFree":
            pynvml.nvmlEventSetFree(event_set)
            expected = "nvmlEventSetFree while a thread waits on the set"
        else:
            pynvml.nvmlShutdown()
            expected = "nvmlShutdown while a thread waits on an event set"
        thread.join(timeout=WAIT_S)
        assert not thread.is_alive()
        assert len(errors) == 1
        assert driver.misuse == [expected]

    def test_an_interrupt_ends_a_blocked_wait_with_timeout(self, driver: SimDriver) -> None:
        """nvml.h: a wait "can return before specified timeout passes (e.g. when interrupt
        arrives)", with NVML_ERROR_TIMEOUT; interrupt_waits() is that interrupt. Not misuse."""
        event_set, thread, errors = blocked_wait()
        driver.interrupt_waits()
        thread.join(timeout=WAIT_S)
        assert not thread.is_alive(), "the interrupt did not end the wait"
        assert [type(e) for e in errors] == [pynvml.NVMLError_Timeout]
        pynvml.nvmlEventSetFree(event_set)
        assert driver.misuse == []

    def test_concurrent_injects(self, driver: SimDriver, events: Any) -> None:
        """Injections from many threads while telemetry is read all arrive, none twice."""

        def worker(gpu: int) -> None:
            for xid in range(1, 51):
                driver.inject(gpu, "xid", xid)
                pynvml.nvmlDeviceGetPowerUsage(handle(gpu))

        threads = [threading.Thread(target=worker, args=(gpu,)) for gpu in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        seen = drain(events)
        for gpu in range(4):
            assert [data for g, kind, data in seen if g == gpu and kind == XID] == list(
                range(1, 51)
            )
        assert [d["xid_count"] for d in driver.describe()] == [50] * 4


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


def in_thread(call: Callable[[], object]) -> object:
    """``call()`` on a thread of its own, its result or exception here; it must end in time."""
    outcome: list[object] = []
    failed: list[BaseException] = []

    def run() -> None:
        try:
            outcome.append(call())
        except BaseException as exc:
            failed.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(WAIT_S)
    assert not thread.is_alive(), "the call did not return"
    if failed:
        raise failed[0]
    return outcome[0]


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
