"""The simulated driver's faults seen as NVML events through the real pynvml wrappers: XIDs, a
lost GPU, double-bit ECC errors, and the event sets that carry them.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable
from typing import Any

import pynvml
import pytest
from support.clock import WAIT_S, blocked_in

from gpu.simfaults.nvmlevents import (
    DBE,
    GPU_RESET,
    HEALTH,
    NONE,
    RECOVERY,
    XID,
    blocked_wait,
    drain,
    handle,
    in_thread,
    recovery_action,
    volatile_dbe,
)
from gpuagent.gpu.sim import SimDriver, installed, node_from_mapping
from gpuagent.gpu.sim.state import RESET_XIDS


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
