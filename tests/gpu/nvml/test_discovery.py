"""What the NVML backend discovers on the simulated driver: each GPU's identity, its NUMA node
(from NVML or sysfs), its static facts and their absence.
"""

from __future__ import annotations

from pathlib import Path

import pynvml
import pytest

from gpu.nvml.rig import GPU_IS_LOST, GPUS, NOT_SUPPORTED, UNKNOWN, discover_on, sysfs_numa
from gpuagent.domain.devices import Condition, GpuHealth
from gpuagent.gpu.nvml import (
    DriverUnavailable,
    Nvml,
    architecture_name,
)
from gpuagent.gpu.sim import SimDriver, node_from_count, node_from_mapping


# ----- discovery ---------------------------------------------------------------------------------
class TestDiscover:
    def test_fields_match_the_driver(self, nvml: Nvml, driver: SimDriver) -> None:
        """Every discovered field equals what the driver describes for that GPU."""
        nvml.init()
        gpus = nvml.discover()
        described = driver.describe()
        assert [g.index for g in gpus] == [d["index"] for d in described] == list(range(GPUS))
        for gpu, want, spec in zip(gpus, described, driver.node.gpus, strict=True):
            got = {
                "index": gpu.index,
                "uuid": gpu.uuid,
                "name": gpu.name,
                "memory_mib": gpu.memory_mib,
                "pci_bus_id": gpu.pci_bus_id,
                "numa_node": gpu.numa_node,
            }
            assert got == {key: want[key] for key in got}
            assert gpu.minor == spec.minor
            assert gpu.health == GpuHealth()
        assert tuple(nvml.indexes) == tuple(range(GPUS))

    def test_configured_node(self, tmp_path: Path) -> None:
        """Non-default names, memory sizes and NUMA nodes come through discovery unchanged."""
        node = node_from_mapping(
            {
                "version": "v1",
                "gpus": [
                    {"name": "NVIDIA A100-SXM4-40GB", "numa_node": 3},
                    {"name": "Acme Accelerator", "memory_mib": 12345, "numa_node": 7},
                ],
            }
        )
        drv = SimDriver(node)
        gpus = discover_on(drv, drv.sys_root)  # NVML has no NUMA node here: the host has
        described = drv.describe()
        assert [(g.name, g.memory_mib, g.numa_node) for g in gpus] == [
            (d["name"], d["memory_mib"], d["numa_node"]) for d in described
        ]
        assert gpus[1].name == "Acme Accelerator"
        assert gpus[1].memory_mib == 12345
        # What node labels need: the architecture by GFD's family name, the compute capability.
        assert (gpus[0].architecture, gpus[0].compute_capability) == ("ampere", "8.0")

    def test_architecture_and_compute_capability(self, nvml: Nvml, driver: SimDriver) -> None:
        """An H100 is "hopper", compute capability "9.0", as the driver reports them."""
        nvml.init()
        gpus = nvml.discover()
        assert {(g.architecture, g.compute_capability) for g in gpus} == {("hopper", "9.0")}

    def test_architecture_not_offered_is_empty(self, nvml: Nvml, driver: SimDriver) -> None:
        """An older driver without the calls leaves both empty; the GPU is still healthy."""
        driver.remove("nvmlDeviceGetArchitecture")
        driver.fail("nvmlDeviceGetCudaComputeCapability", NOT_SUPPORTED)
        nvml.init()
        gpus = nvml.discover()
        assert {(g.architecture, g.compute_capability) for g in gpus} == {("", "")}
        assert all(g.health.healthy for g in gpus)

    @pytest.mark.parametrize(
        ("value", "name"),
        [
            (pynvml.NVML_DEVICE_ARCH_AMPERE, "ampere"),
            (pynvml.NVML_DEVICE_ARCH_ADA, "ada-lovelace"),
            (pynvml.NVML_DEVICE_ARCH_BLACKWELL, "blackwell"),
            (pynvml.NVML_DEVICE_ARCH_UNKNOWN, ""),
            (None, ""),
        ],
    )
    def test_architecture_names(self, value: int | None, name: str) -> None:
        """NVML's architecture constants by GFD's ``gpu.family`` names."""
        assert architecture_name(value) == name

    @pytest.mark.parametrize("how", ["removed", "not_supported"])
    def test_memory_v2_falls_back_to_v1(self, nvml: Nvml, driver: SimDriver, how: str) -> None:
        """Without nvmlDeviceGetMemoryInfo_v2 the total comes from v1; the GPU stays healthy."""
        if how == "removed":
            driver.remove("nvmlDeviceGetMemoryInfo_v2")
        else:
            driver.fail("nvmlDeviceGetMemoryInfo_v2", NOT_SUPPORTED)
        nvml.init()
        gpus = nvml.discover()
        assert [g.memory_mib for g in gpus] == [spec.memory_mib for spec in driver.node.gpus]
        assert all(g.health.healthy for g in gpus)
        assert driver.calls["nvmlDeviceGetMemoryInfo"] >= GPUS

    def test_memory_v2_failure_other_than_absent_is_not_hidden(
        self, nvml: Nvml, driver: SimDriver
    ) -> None:
        """A real v2 error is not papered over by v1: that GPU is advertised as unhealthy."""
        driver.fail("nvmlDeviceGetMemoryInfo_v2", UNKNOWN, gpu=2)
        nvml.init()
        gpus = nvml.discover()
        assert [g.health.healthy for g in gpus] == [True, True, False, True]
        assert gpus[2].health == GpuHealth((Condition("discovery", "Unknown Error (NVML 999)"),))

    def test_numa_from_nvml(self, nvml: Nvml, driver: SimDriver, tmp_path: Path) -> None:
        """NVML's NUMA node wins over sysfs when the driver offers it."""
        for spec in driver.node.gpus:
            sysfs_numa(tmp_path, spec.pci_bus_id, "5")
        nvml.init()
        assert [g.numa_node for g in nvml.discover()] == [0, 0, 1, 1]

    @pytest.mark.parametrize("how", ["removed", "not_supported"])
    def test_numa_from_sysfs(self, tmp_path: Path, how: str) -> None:
        """Without NVML's NUMA node it is read from sysfs (4-digit, lower-case PCI address)."""
        drv = SimDriver(node_from_count(8))
        if how == "removed":
            drv.remove("nvmlDeviceGetNumaNodeId")
        else:
            drv.fail("nvmlDeviceGetNumaNodeId", NOT_SUPPORTED)
        # Buses 0x10, 0x13, …, 0x25: GPUs 4 and 5 sit on 1C and 1F, which sysfs spells lower case.
        for spec in drv.node.gpus:
            sysfs_numa(tmp_path, spec.pci_bus_id, str(10 + spec.index))
        gpus = discover_on(drv, tmp_path)
        assert [g.numa_node for g in gpus] == [10 + i for i in range(8)]
        assert (tmp_path / "bus/pci/devices/0000:1c:00.0/numa_node").exists()

    def test_numa_only_for_the_gpu_without_it(
        self, nvml: Nvml, driver: SimDriver, tmp_path: Path
    ) -> None:
        """NVML is asked per GPU: only the GPU that lacks the value falls back to sysfs."""
        driver.fail("nvmlDeviceGetNumaNodeId", NOT_SUPPORTED, gpu=3)
        for spec in driver.node.gpus:
            sysfs_numa(tmp_path, spec.pci_bus_id, "9")
        nvml.init()
        assert [g.numa_node for g in nvml.discover()] == [0, 0, 1, 9]

    @pytest.mark.parametrize(
        ("sysfs", "expected"),
        [
            (None, None),  # no sysfs entry at all
            ("-1", None),  # the kernel knows no NUMA node
            ("garbage\n", None),
        ],
    )
    def test_numa_unknown(
        self,
        nvml: Nvml,
        driver: SimDriver,
        tmp_path: Path,
        sysfs: str | None,
        expected: int | None,
    ) -> None:
        """With neither NVML nor sysfs offering a NUMA node (or sysfs saying -1) it is None."""
        driver.remove("nvmlDeviceGetNumaNodeId")
        if sysfs is not None:
            for spec in driver.node.gpus:
                sysfs_numa(tmp_path, spec.pci_bus_id, sysfs)
        nvml.init()
        gpus = nvml.discover()
        assert [g.numa_node for g in gpus] == [expected] * GPUS
        assert all(g.health.healthy for g in gpus)

    @pytest.mark.parametrize("code", [GPU_IS_LOST, UNKNOWN])
    def test_unnamed_gpu_is_left_out(self, nvml: Nvml, driver: SimDriver, code: int) -> None:
        """A GPU whose UUID cannot be read is not advertised; the others are."""
        driver.fail("nvmlDeviceGetUUID", code, gpu=1)
        nvml.init()
        gpus = nvml.discover()
        assert [g.index for g in gpus] == [0, 2, 3]
        assert [g.uuid for g in gpus] == [driver.node.gpus[i].uuid for i in (0, 2, 3)]
        assert all(g.health.healthy for g in gpus)
        assert tuple(nvml.indexes) == (0, 2, 3)

    @pytest.mark.parametrize(
        "symbol",
        [
            "nvmlDeviceGetPciInfo_v3",
            "nvmlDeviceGetMemoryInfo_v2",
            "nvmlDeviceGetMinorNumber",
            "nvmlDeviceGetName",
            "nvmlDeviceGetNumaNodeId",
        ],
    )
    def test_lost_after_naming_is_advertised_lost(
        self, nvml: Nvml, driver: SimDriver, symbol: str
    ) -> None:
        """A GPU lost after naming itself is still advertised, under its UUID, as lost."""
        driver.fail(symbol, GPU_IS_LOST, gpu=2)
        nvml.init()
        gpus = nvml.discover()
        assert [g.index for g in gpus] == list(range(GPUS))
        lost = gpus[2]
        assert lost.uuid == driver.node.gpus[2].uuid
        assert lost.health == GpuHealth((Condition("lost"),))
        assert not lost.health.healthy
        assert all(g.health.healthy for i, g in enumerate(gpus) if i != 2)

    def test_count_failure_is_driver_unavailable(self, nvml: Nvml, driver: SimDriver) -> None:
        """If the driver cannot even count its GPUs, discovery fails as a whole."""
        driver.fail("nvmlDeviceGetCount_v2", UNKNOWN)
        nvml.init()
        with pytest.raises(DriverUnavailable, match=r"Unknown Error \(NVML 999\)"):
            nvml.discover()
