"""The simulated driver seen through the real pynvml wrappers: discovery, telemetry, topology."""

from __future__ import annotations

import ctypes
import dataclasses
from collections.abc import Iterator
from typing import Any

import pynvml
import pytest
from support.clock import FakeClock
from support.simnvml import nvml_on

from gpuagent.gpu.sim import SimDriver, installed, node_from_count, node_from_mapping
from gpuagent.gpu.sim.profiles import H100_80GB

MIB = 1024 * 1024


@pytest.fixture
def driver(clock: FakeClock) -> Iterator[SimDriver]:
    """An 8-GPU HGX-like node, installed below pynvml and initialised."""
    with installed(SimDriver(node_from_count(8), clock=clock)) as drv:
        pynvml.nvmlInit()
        yield drv


def handle(index: int) -> Any:
    return pynvml.nvmlDeviceGetHandleByIndex(index)


class TestDiscovery:
    def test_system(self, driver: SimDriver) -> None:
        """Driver, NVML and CUDA versions come from the node description."""
        assert pynvml.nvmlSystemGetDriverVersion() == driver.node.driver_version
        assert pynvml.nvmlSystemGetNVMLVersion().endswith(driver.node.driver_version)
        assert pynvml.nvmlSystemGetCudaDriverVersion() == driver.node.cuda_driver_version
        assert pynvml.nvmlSystemGetCudaDriverVersion_v2() == driver.node.cuda_driver_version

    def test_devices(self, driver: SimDriver) -> None:
        """Count, identity and static properties match the spec of each GPU."""
        assert pynvml.nvmlDeviceGetCount() == 8
        for spec in driver.node.gpus:
            h = handle(spec.index)
            assert pynvml.nvmlDeviceGetUUID(h) == spec.uuid
            assert pynvml.nvmlDeviceGetName(h) == "NVIDIA H100 80GB HBM3"
            assert pynvml.nvmlDeviceGetIndex(h) == spec.index
            assert pynvml.nvmlDeviceGetMinorNumber(h) == spec.index
            # An x86 HGX board's GPUs are not NUMA nodes: nvml.h's NOT_SUPPORTED, as on the
            # real H200; the host's sysfs says where they are (test_numa_is_the_hosts).
            with pytest.raises(pynvml.NVMLError_NotSupported):
                pynvml.nvmlDeviceGetNumaNodeId(h)
            assert pynvml.nvmlDeviceGetArchitecture(h) == pynvml.NVML_DEVICE_ARCH_HOPPER
            assert pynvml.nvmlDeviceGetCudaComputeCapability(h) == (9, 0)
            assert pynvml.nvmlDeviceGetEnforcedPowerLimit(h) == 700_000
            assert pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_SM) == 1980
            assert pynvml.nvmlDeviceGetMigMode(h) == [0, 0]

    def test_numa_is_the_hosts(self, driver: SimDriver) -> None:
        """The simulated host's sysfs holds each GPU's NUMA node, PCI class and IDs."""
        root = driver.sys_root
        for spec in driver.node.gpus:
            device = root / "bus/pci/devices" / spec.pci_bus_id[4:].lower()
            assert (device / "numa_node").read_text() == f"{spec.numa_node}\n"
            assert (device / "class").read_text() == "0x030200\n"
            assert (device / "vendor").read_text() == "0x10de\n"
            assert (device / "device").read_text() == "0x2330\n"
            assert len((device / "config").read_bytes()) == 256
        assert [s.numa_node for s in driver.node.gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
        assert not (root / "class/dmi/id/product_name").exists()  # no machine type given

    def test_numa_from_nvml_where_gpus_are_numa_nodes(self) -> None:
        node = node_from_mapping(
            {"version": "v1", "gpus": [{"numa_node": 4}], "numa_from_nvml": True}
        )
        with nvml_on(SimDriver(node)):
            assert pynvml.nvmlDeviceGetNumaNodeId(handle(0)) == 4

    def test_handles_are_stable(self, driver: SimDriver) -> None:
        """Index, UUID and bus-ID lookups yield the same opaque handle for a GPU."""
        spec = driver.node.gpus[5]
        address = ctypes.addressof(handle(5).contents)
        assert ctypes.addressof(handle(5).contents) == address
        assert ctypes.addressof(handle(4).contents) != address
        by_uuid = pynvml.nvmlDeviceGetHandleByUUID(spec.uuid)
        assert ctypes.addressof(by_uuid.contents) == address
        short = spec.pci_bus_id[4:].lower()
        for bus_id in (spec.pci_bus_id, short):
            by_bus = pynvml.nvmlDeviceGetHandleByPciBusId(bus_id)
            assert ctypes.addressof(by_bus.contents) == address

    def test_lookup_misses(self, driver: SimDriver) -> None:
        """Unknown index, UUID or bus ID fail as NVML does."""
        with pytest.raises(pynvml.NVMLError_InvalidArgument):
            handle(8)
        with pytest.raises(pynvml.NVMLError_NotFound):
            pynvml.nvmlDeviceGetHandleByUUID("GPU-00000000-0000-0000-0000-000000000000")
        with pytest.raises(pynvml.NVMLError_NotFound):
            pynvml.nvmlDeviceGetHandleByPciBusId("00000000:FF:00.0")

    def test_pci_info(self, driver: SimDriver) -> None:
        """The v3 PCI info carries the 8-hex-digit-domain busId and the H100 device ID."""
        spec = driver.node.gpus[2]
        info = pynvml.nvmlDeviceGetPciInfo(handle(2))
        assert info.busId == spec.pci_bus_id
        assert info.busIdLegacy == spec.pci_bus_id[4:]
        assert (info.domain, info.bus, info.device) == (0, 0x16, 0)
        assert info.pciDeviceId == 0x233010DE

    def test_pci_info_of_a_device_other_than_zero(self) -> None:
        """A replayed GPU keeps its captured address: the real H200 sat at 00000000:00:06.0."""
        node = node_from_mapping({"version": "v1", "gpus": [{"name": "H200"}]})
        gpu = dataclasses.replace(node.gpus[0], pci_bus_id="00000000:00:06.0")
        with nvml_on(SimDriver(dataclasses.replace(node, gpus=(gpu,)))):
            info = pynvml.nvmlDeviceGetPciInfo(handle(0))
            assert (info.busId, info.busIdLegacy) == ("00000000:00:06.0", "0000:00:06.0")
            assert (info.domain, info.bus, info.device) == (0, 0, 6)
            by_bus = pynvml.nvmlDeviceGetHandleByPciBusId("0000:00:06.0")
            assert pynvml.nvmlDeviceGetIndex(by_bus) == 0

    def test_memory_v1_and_v2(self, driver: SimDriver) -> None:
        """v1 counts reserved memory as used; v2 reports it apart; both add up to the total."""
        h = handle(0)
        v1 = pynvml.nvmlDeviceGetMemoryInfo(h)
        v2 = pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
        assert v1.total == v2.total == 81559 * MIB
        assert v2.reserved > 0
        assert v2.used + v2.reserved + v2.free == v2.total
        assert v1.used + v1.free == v1.total
        assert v1.used == v2.used + v2.reserved

    def test_memory_v2_checks_the_struct_version(self, driver: SimDriver) -> None:
        """A wrong struct version is rejected as by the real library."""
        with pytest.raises(pynvml.NVMLError_ArgumentVersionMismatch):
            pynvml.nvmlDeviceGetMemoryInfo(handle(0), version=1)

    def test_small_buffer(self, driver: SimDriver) -> None:
        """A string buffer too small for the answer gives INSUFFICIENT_SIZE."""
        buffer = ctypes.create_string_buffer(8)
        code = driver.nvmlDeviceGetUUID(handle(0), buffer, ctypes.c_uint(8))  # type: ignore[attr-defined]
        assert code == pynvml.NVML_ERROR_INSUFFICIENT_SIZE

    def test_invalid_handle(self, driver: SimDriver) -> None:
        """A handle the driver never gave out is an invalid argument."""
        stranger = pynvml.c_nvmlDevice_t(pynvml.struct_c_nvmlDevice_t())
        with pytest.raises(pynvml.NVMLError_InvalidArgument):
            pynvml.nvmlDeviceGetUUID(stranger)
        with pytest.raises(pynvml.NVMLError_InvalidArgument):
            pynvml.nvmlDeviceGetUUID(pynvml.c_nvmlDevice_t())

    def test_mig_mode_follows_config(self) -> None:
        """A GPU configured with MIG profiles reports MIG mode enabled."""
        node = node_from_mapping({"version": "v1", "gpus": [{"mig": ["3g.40gb"]}, {}]})
        with installed(SimDriver(node)):
            pynvml.nvmlInit()
            assert pynvml.nvmlDeviceGetMigMode(handle(0)) == [1, 1]
            assert pynvml.nvmlDeviceGetMigMode(handle(1)) == [0, 0]


class TestLifecycle:
    def test_calls_need_init(self) -> None:
        """Before nvmlInit and after the last nvmlShutdown calls are UNINITIALIZED."""
        with installed(SimDriver(node_from_count(1))):
            with pytest.raises(pynvml.NVMLError_Uninitialized):
                pynvml.nvmlDeviceGetCount()
            pynvml.nvmlInit()
            pynvml.nvmlInit()
            pynvml.nvmlShutdown()
            assert pynvml.nvmlDeviceGetCount() == 1
            pynvml.nvmlShutdown()
            with pytest.raises(pynvml.NVMLError_Uninitialized):
                pynvml.nvmlDeviceGetCount()
            with pytest.raises(pynvml.NVMLError_Uninitialized):
                pynvml.nvmlShutdown()

    def test_error_string(self, driver: SimDriver) -> None:
        """NVMLError.__str__ asks the driver for codes pynvml has no text for."""
        assert str(pynvml.NVMLError(pynvml.NVML_ERROR_NOT_READY)) == "Not ready"
        assert str(pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)) == "GPU is lost"


def telemetry(index: int) -> dict[str, int]:
    h = handle(index)
    util = pynvml.nvmlDeviceGetUtilizationRates(h)
    memory = pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
    return {
        "temperature": pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU),
        "power": pynvml.nvmlDeviceGetPowerUsage(h),
        "sm_clock": pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),
        "gpu_util": util.gpu,
        "mem_util": util.memory,
        "fb_used": memory.used,
        "energy": pynvml.nvmlDeviceGetTotalEnergyConsumption(h),
    }


class TestTelemetry:
    def test_frozen_clock_frozen_values(self, driver: SimDriver) -> None:
        """With the clock standing still every reading repeats exactly."""
        assert telemetry(0) == telemetry(0)

    def test_moves_with_the_clock(self, driver: SimDriver, clock: FakeClock) -> None:
        """Each value changes as the injected clock advances; energy only grows."""
        before = telemetry(0)
        clock.now += 30.0
        after = telemetry(0)
        for key, value in before.items():
            assert after[key] != value, key
        assert after["energy"] > before["energy"]

    def test_gpus_differ(self, driver: SimDriver) -> None:
        """GPUs are out of phase with each other."""
        assert len({telemetry(i)["power"] for i in range(8)}) == 8

    def test_plausible_and_monotonic(self, driver: SimDriver, clock: FakeClock) -> None:
        """Over ten minutes values stay in the H100's range and energy never decreases."""
        energy = 0
        for _ in range(120):
            clock.now += 5.0
            for index in (0, 7):
                t = telemetry(index)
                assert 0 <= t["gpu_util"] <= 100
                assert 0 <= t["mem_util"] <= 100
                assert H100_80GB.idle_power_mw <= t["power"] <= H100_80GB.power_limit_mw
                assert 25 <= t["temperature"] <= 90
                assert 0 < t["sm_clock"] <= H100_80GB.max_sm_clock_mhz
                assert 0 < t["fb_used"] < 81559 * MIB
            current = pynvml.nvmlDeviceGetTotalEnergyConsumption(handle(0))
            assert current > energy
            energy = current

    def test_same_clock_same_values(self, clock: FakeClock) -> None:
        """Two drivers on the same clock report the same telemetry."""
        readings = []
        for _ in range(2):
            with installed(SimDriver(node_from_count(2), clock=clock)):
                pynvml.nvmlInit()
                readings.append(telemetry(1))
        assert readings[0] == readings[1]

    def test_bad_sensor_and_clock_type(self, driver: SimDriver) -> None:
        """Unknown sensors and clock types are invalid arguments."""
        with pytest.raises(pynvml.NVMLError_InvalidArgument):
            pynvml.nvmlDeviceGetTemperature(handle(0), 7)
        with pytest.raises(pynvml.NVMLError_InvalidArgument):
            pynvml.nvmlDeviceGetClockInfo(handle(0), 9)


class TestFieldValues:
    def test_known_and_unknown_fields(self, driver: SimDriver, clock: FakeClock) -> None:
        """Known fields answer in their slot; an unknown field gets NOT_SUPPORTED in its slot."""
        values = pynvml.nvmlDeviceGetFieldValues(
            handle(0),
            [
                pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION,
                9999,
                pynvml.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION,
                pynvml.NVML_FI_DEV_ECC_DBE_VOL_TOTAL,
            ],
        )
        action, unknown, energy, dbe = values
        assert (action.nvmlReturn, action.value.uiVal) == (pynvml.NVML_SUCCESS, 0)
        assert action.valueType == pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
        assert unknown.nvmlReturn == pynvml.NVML_ERROR_NOT_SUPPORTED
        assert energy.value.ullVal == pynvml.nvmlDeviceGetTotalEnergyConsumption(handle(0))
        assert (dbe.nvmlReturn, dbe.value.ullVal) == (pynvml.NVML_SUCCESS, 0)


class TestTopology:
    def test_common_ancestor(self, driver: SimDriver) -> None:
        """Same GPU is internal, same NUMA node is NODE, across NUMA nodes is SYSTEM."""
        ancestor = pynvml.nvmlDeviceGetTopologyCommonAncestor
        assert ancestor(handle(0), handle(0)) == pynvml.NVML_TOPOLOGY_INTERNAL
        assert ancestor(handle(0), handle(3)) == pynvml.NVML_TOPOLOGY_NODE
        assert ancestor(handle(0), handle(4)) == pynvml.NVML_TOPOLOGY_SYSTEM

    def test_nvlink_reaches_every_peer(self, driver: SimDriver) -> None:
        """On --simulate 8 the active links of each GPU lead to all 7 others."""
        bus_to_index = {g.pci_bus_id: g.index for g in driver.node.gpus}
        for index in range(8):
            h = handle(index)
            peers: dict[int, int] = {}
            for link in range(18):
                if pynvml.nvmlDeviceGetNvLinkState(h, link) != pynvml.NVML_FEATURE_ENABLED:
                    continue
                remote = pynvml.nvmlDeviceGetNvLinkRemotePciInfo(h, link).busId
                peer = bus_to_index[remote]
                peers[peer] = peers.get(peer, 0) + 1
            assert set(peers) == set(range(8)) - {index}
            assert set(peers.values()) == {2}

    def test_configured_links_only(self) -> None:
        """Pairs left out of ``nvlinks`` have no NVLink; inactive links have no remote."""
        node = node_from_mapping({"version": "v1", "gpus": [{}, {}, {}], "nvlinks": [[0, 2, 3]]})
        with installed(SimDriver(node)):
            pynvml.nvmlInit()
            states = [pynvml.nvmlDeviceGetNvLinkState(handle(0), link) for link in range(18)]
            assert states == [1, 1, 1] + [0] * 15
            remote = pynvml.nvmlDeviceGetNvLinkRemotePciInfo(handle(2), 0)
            assert remote.busId == node.gpus[0].pci_bus_id
            assert not any(pynvml.nvmlDeviceGetNvLinkState(handle(1), link) for link in range(18))
            with pytest.raises(pynvml.NVMLError_NotSupported):
                pynvml.nvmlDeviceGetNvLinkRemotePciInfo(handle(1), 0)
            with pytest.raises(pynvml.NVMLError_InvalidArgument):
                pynvml.nvmlDeviceGetNvLinkState(handle(0), 18)
