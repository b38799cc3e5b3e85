"""The NVML backend (``Nvml``) on the real pynvml wrappers, over the simulated driver."""

from __future__ import annotations

import ctypes
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pynvml
import pytest
import structlog.testing
from support.clock import FakeClock

from gpuagent.domain.devices import Condition, DriverState, Gpu, GpuHealth, Telemetry
from gpuagent.domain.health import (
    DISCOVERY,
    DoubleBitEccError,
    GpuLost,
    HealthEvent,
    LivenessFailed,
    RecoveryActionChanged,
    Responding,
    XidError,
)
from gpuagent.domain.snapshot import Snapshot
from gpuagent.gpu.backend import DriverEvent
from gpuagent.gpu.cadence import ENERGY
from gpuagent.gpu.nvml import (
    DriverUnavailable,
    EventWaitError,
    Nvml,
    architecture_name,
    cuda_version,
)
from gpuagent.gpu.sim import SimDriver, install, node_from_count, node_from_mapping, uninstall
from gpuagent.gpu.sim import telemetry as sim_telemetry
from gpuagent.nodefiles.labels import node_labels
from gpuagent.overrides.nvml import nvml_library_users

MIB = 1024 * 1024
GPUS = 4
ABSENT_LOG = "value not offered by this gpu or driver"
GPU_RESET = int(pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET)
ACTION_NONE = int(pynvml.NVML_GPU_RECOVERY_ACTION_NONE)
NOT_SUPPORTED = int(pynvml.NVML_ERROR_NOT_SUPPORTED)
UNKNOWN = int(pynvml.NVML_ERROR_UNKNOWN)
GPU_IS_LOST = int(pynvml.NVML_ERROR_GPU_IS_LOST)


# Sane ranges for an H100 80GB: catches unit slips (mW for W, bytes for MiB).
PLAUSIBLE: dict[str, tuple[float, float]] = {
    "temperature_c": (20, 100),
    "power_w": (50, 700),
    "sm_clock_mhz": (500, 1980),
    "mem_clock_mhz": (1000, 3000),
    "gpu_util_pct": (0, 100),
    "mem_util_pct": (0, 100),
    "fb_used_mib": (1, 81559),
    "fb_free_mib": (1, 81559),
    "energy_mj": (1, 1e12),
}


def discover_on(driver: SimDriver, sysfs_root: Path) -> list[Gpu]:
    """The GPUs a fresh backend discovers on ``driver`` (installed for the call only)."""
    install(driver)
    backend = Nvml(sysfs_root=sysfs_root)
    try:
        backend.init()
        return backend.discover()
    finally:
        backend.shutdown()
        uninstall()


@pytest.fixture
def driver(clock: FakeClock) -> Iterator[SimDriver]:
    """A 4-GPU simulated node installed below pynvml (not initialised); uninstalled afterwards.

    Its driver answers ``nvmlDeviceGetNumaNodeId`` (as where the GPUs are NUMA nodes), so the
    backend's choice between NVML and sysfs can be tested; the built-in node's does not."""
    drv = SimDriver(dataclasses.replace(node_from_count(GPUS), numa_from_nvml=True), clock=clock)
    install(drv)
    try:
        yield drv
    finally:
        uninstall()


@pytest.fixture
def nvml(driver: SimDriver, clock: FakeClock, tmp_path: Path) -> Iterator[Nvml]:
    """An uninitialised backend reading sysfs from an empty ``tmp_path`` tree; shut down after."""
    backend = Nvml(sysfs_root=tmp_path, clock=clock)
    try:
        yield backend
    finally:
        backend.shutdown()


@pytest.fixture
def ready(nvml: Nvml) -> Nvml:
    """The backend initialised, every GPU discovered and registered for health events."""
    nvml.init()
    assert len(nvml.discover()) == GPUS
    assert nvml.open_events() == {}
    return nvml


def sysfs_numa(root: Path, bus_id: str, value: str) -> None:
    """Write ``<root>/bus/pci/devices/<4-hex-digit domain, lower case>/numa_node``."""
    name = bus_id[4:].lower()  # NVML's 8-hex-digit domain becomes sysfs's 4.
    device = root / "bus/pci/devices" / name
    device.mkdir(parents=True)
    (device / "numa_node").write_text(f"{value}\n")


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


# ----- MIG support -------------------------------------------------------------------------------
NO_PERMISSION = int(pynvml.NVML_ERROR_NO_PERMISSION)
H100_NAME = "NVIDIA H100 80GB HBM3"


def mig_capable_label(gpus: list[Gpu]) -> str:
    """The node's ``nvidia.com/mig.capable`` label for these GPUs."""
    snapshot = Snapshot(version=1, gpus=tuple(gpus), driver=DriverState(up=True, version="1.2"))
    return node_labels(snapshot)["nvidia.com/mig.capable"]


class TestMigCapable:
    """``Gpu.mig_capable``: whether ``nvmlDeviceGetMigMode`` answers, read once at discovery."""

    def test_mig_models_answer_the_mode(self, nvml: Nvml) -> None:
        nvml.init()
        gpus = nvml.discover()
        assert [g.mig_capable for g in gpus] == [True] * GPUS
        assert mig_capable_label(gpus) == "true"

    def test_a_model_without_mig_is_not_capable_whatever_its_name(self, tmp_path: Path) -> None:
        """A model without MIG profiles answers NOT_SUPPORTED; the label follows the driver, not
        the H100 name the guess would take as MIG-capable."""
        node = node_from_count(2)
        no_mig = dataclasses.replace(node.gpus[0].profile, key="no-mig", mig_profiles=())
        node = dataclasses.replace(
            node, gpus=tuple(dataclasses.replace(g, profile=no_mig) for g in node.gpus)
        )
        gpus = discover_on(SimDriver(node), tmp_path)
        assert [(g.name, g.mig_capable) for g in gpus] == [(H100_NAME, False)] * 2
        assert all(g.health.healthy for g in gpus)
        assert mig_capable_label(gpus) == "false"

    def test_not_supported_on_one_gpu(self, nvml: Nvml, driver: SimDriver) -> None:
        driver.fail("nvmlDeviceGetMigMode", NOT_SUPPORTED, gpu=1)
        nvml.init()
        with structlog.testing.capture_logs() as logs:
            gpus = nvml.discover()
        assert [g.mig_capable for g in gpus] == [True, False, True, True]
        assert [e["gpu"] for e in logs if e["event"] == ABSENT_LOG] == [1]
        assert gpus[1].health.healthy

    def test_a_driver_without_the_call_has_no_mig(self, nvml: Nvml, driver: SimDriver) -> None:
        """FUNCTION_NOT_FOUND (a driver older than MIG): not capable, as go-nvlib decides."""
        driver.remove("nvmlDeviceGetMigMode")
        nvml.init()
        gpus = nvml.discover()
        assert [g.mig_capable for g in gpus] == [False] * GPUS
        assert mig_capable_label(gpus) == "false"

    def test_an_unknown_mig_mode_fails_the_discovery(self, nvml: Nvml, driver: SimDriver) -> None:
        """Any other answer (NO_PERMISSION here): the MIG mode is unknown, so the GPU is not
        advertised whole but unhealthy (``discovery``), and asked again by the monitor."""
        driver.fail("nvmlDeviceGetMigMode", NO_PERMISSION)
        nvml.init()
        gpus = nvml.discover()
        assert [g.mig_capable for g in gpus] == [None] * GPUS
        assert all(not g.health.healthy for g in gpus)
        assert {c.kind for g in gpus for c in g.health.conditions} == {DISCOVERY}
        assert all(g.memory_mib == 0 and not g.mig_enabled for g in gpus)


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


# ----- probe -------------------------------------------------------------------------------------
class TestProbe:
    def test_telemetry(self, ready: Nvml, driver: SimDriver, clock: FakeClock) -> None:
        """Every value is read, in the agent's units (W, MiB), and equals the driver's."""
        clock.now += 42.0
        spec = driver.node.gpus[2]
        want = sim_telemetry.sample(spec.profile, 2, spec.memory_mib, 42.0)
        probe = ready.probe(2)
        assert probe.events == (Responding(),)
        assert probe.recovery_action == ACTION_NONE
        expected = {
            "temperature_c": want.temperature_c,
            "power_w": want.power_mw / 1000,
            "sm_clock_mhz": want.sm_clock_mhz,
            "mem_clock_mhz": want.mem_clock_mhz,
            "gpu_util_pct": want.gpu_util_pct,
            "mem_util_pct": want.mem_util_pct,
            "fb_used_mib": want.fb_used_bytes // MIB,
            "fb_free_mib": want.fb_free_bytes // MIB,
            "energy_mj": want.energy_mj,
        }
        # The other fields are checked against the simulated model in test_telemetry.py.
        assert {name: getattr(probe.telemetry, name) for name in expected} == expected

    def test_telemetry_is_plausible(self, ready: Nvml, clock: FakeClock) -> None:
        """Readings are in sane ranges for an H100 (watts, not milliwatts; MiB, not bytes)."""
        for index in range(GPUS):
            clock.now += 17.0
            t = ready.probe(index).telemetry
            for name, (low, high) in PLAUSIBLE.items():
                value = getattr(t, name)
                assert value is not None, name
                assert low <= value <= high, (name, value)
            assert t.fb_used_mib is not None
            assert t.fb_free_mib is not None
            assert 81559 - 1536 <= t.fb_used_mib + t.fb_free_mib <= 81559

    def test_energy_only_grows(self, ready: Nvml, clock: FakeClock) -> None:
        """Successive probes read a growing energy counter (fresh values, not cached ones)."""
        readings: list[float] = []
        for _ in range(3):
            clock.now += 5.0
            energy = ready.probe(0).telemetry.energy_mj
            assert energy is not None
            readings.append(energy)
        assert readings[0] < readings[1] < readings[2]

    @pytest.mark.parametrize(
        ("symbol", "how", "absent"),
        [
            ("nvmlDeviceGetTemperature", "not_supported", {"temperature_c"}),
            ("nvmlDeviceGetTemperature", "removed", {"temperature_c"}),
            ("nvmlDeviceGetTotalEnergyConsumption", "not_supported", {"energy_mj"}),
            ("nvmlDeviceGetTotalEnergyConsumption", "removed", {"energy_mj"}),
            ("nvmlDeviceGetPowerUsage", "not_supported", {"power_w"}),
            ("nvmlDeviceGetClockInfo", "removed", {"sm_clock_mhz", "mem_clock_mhz"}),
            ("nvmlDeviceGetUtilizationRates", "not_supported", {"gpu_util_pct", "mem_util_pct"}),
        ],
    )
    def test_value_not_offered_is_none(
        self,
        ready: Nvml,
        driver: SimDriver,
        clock: FakeClock,
        symbol: str,
        how: str,
        absent: set[str],
    ) -> None:
        """A value the GPU does not offer is None; every other value is still read (probes a
        period of the costly readings apart: the energy counter is read once in that period)."""

        def missing(telemetry: object) -> set[str]:
            return {
                f.name
                for f in dataclasses.fields(telemetry)  # type: ignore[arg-type]
                if getattr(telemetry, f.name) is None
            }

        ready.probe(1)
        clock.now += ENERGY.period_s
        baseline = missing(ready.probe(1).telemetry)
        assert not baseline & absent
        if how == "removed":
            driver.remove(symbol)
        else:
            driver.fail(symbol, NOT_SUPPORTED)
        clock.now += ENERGY.period_s
        probe = ready.probe(1)
        assert probe.events == (Responding(),)
        assert missing(probe.telemetry) == baseline | absent

    def test_absent_value_logged_once(self, ready: Nvml, driver: SimDriver) -> None:
        """A missing value is logged once per GPU and call, however often it is probed."""
        driver.fail("nvmlDeviceGetTemperature", NOT_SUPPORTED)
        driver.remove("nvmlDeviceGetTotalEnergyConsumption")
        with structlog.testing.capture_logs() as logs:
            for _ in range(3):
                ready.probe(0)
                ready.probe(1)
        absent = sorted(
            (entry["gpu"], entry["call"]) for entry in logs if entry["event"] == ABSENT_LOG
        )
        assert absent == [
            (0, "nvmlDeviceGetTemperature"),
            (0, "nvmlDeviceGetTotalEnergyConsumption"),
            (1, "nvmlDeviceGetTemperature"),
            (1, "nvmlDeviceGetTotalEnergyConsumption"),
        ]

    def test_lost_gpu(self, ready: Nvml, driver: SimDriver) -> None:
        """A lost GPU probes as GpuLost with no telemetry; its neighbours are unaffected."""
        driver.inject(3, "lost")
        probe = ready.probe(3)
        assert probe.events == (GpuLost(),)
        assert probe.telemetry == Telemetry()
        assert probe.recovery_action is None
        assert ready.probe(2).events == (Responding(),)

    @pytest.mark.parametrize(
        ("symbol", "code", "call", "absent"),
        [
            ("nvmlDeviceGetPowerUsage", UNKNOWN, "nvmlDeviceGetPowerUsage", {"power_w"}),
            ("nvmlDeviceGetTemperature", UNKNOWN, "nvmlDeviceGetTemperature", {"temperature_c"}),
            (
                "nvmlDeviceGetTemperature",
                pynvml.NVML_ERROR_TIMEOUT,
                "nvmlDeviceGetTemperature",
                {"temperature_c"},
            ),
            (
                "nvmlDeviceGetMemoryInfo_v2",
                pynvml.NVML_ERROR_NO_PERMISSION,
                "nvmlDeviceGetMemoryInfo_v2",
                {"fb_used_mib", "fb_free_mib", "fb_reserved_mib"},
            ),
            (
                "nvmlDeviceGetFieldValues",
                UNKNOWN,
                "nvmlDeviceGetFieldValues",
                {"memory_temperature_c", "nvlink_crc_flit_errors"},
            ),
        ],
    )
    def test_failing_reading_is_absent_not_evidence(
        self, ready: Nvml, driver: SimDriver, symbol: str, code: int, call: str, absent: set[str]
    ) -> None:
        """A telemetry call that fails leaves its values absent, counts the error, logs it once.

        The GPU still answers its liveness check: a metric is not evidence about the GPU.
        """
        driver.fail(symbol, code, gpu=0)
        with structlog.testing.capture_logs() as logs:
            probes = [ready.probe(0) for _ in range(3)]
        assert all(p.events == (Responding(),) for p in probes)
        for name in absent:
            assert getattr(probes[-1].telemetry, name) is None, name
        assert probes[-1].telemetry.sm_clock_mhz is not None
        assert dict(ready.calls.stats())[call].errors == 3
        failed = [e for e in logs if e["event"] == "nvml call failed; value left out"]
        assert [(e["gpu"], e["call"]) for e in failed] == [(0, call)]
        assert ready.probe(1).events == (Responding(),)

    @pytest.mark.parametrize(
        ("code", "events"),
        [
            (UNKNOWN, (LivenessFailed("Unknown Error (NVML 999)"),)),
            (pynvml.NVML_ERROR_TIMEOUT, (LivenessFailed("Timeout (NVML 10)"),)),
            (NOT_SUPPORTED, (Responding(),)),  # no liveness check to fail; hangs still count
            (GPU_IS_LOST, (GpuLost(),)),
        ],
    )
    def test_liveness_check(
        self, ready: Nvml, driver: SimDriver, code: int, events: tuple[object, ...]
    ) -> None:
        """The designated liveness call decides; its failure is one strike, not a verdict."""
        driver.fail("nvmlDeviceGetPerformanceState", code, gpu=2)
        probe = ready.probe(2)
        assert probe.events == events
        if code != GPU_IS_LOST:
            assert probe.telemetry.power_w is not None  # readings are kept either way

    def test_recovery_action_from_field(self, ready: Nvml, driver: SimDriver) -> None:
        """The driver's recovery action (field 230) is read with each probe."""
        assert pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION == 230
        driver.inject(1, "xid", 79)
        assert ready.probe(1).recovery_action == GPU_RESET
        assert ready.probe(0).recovery_action == ACTION_NONE
        driver.inject(1, "recover")
        assert ready.probe(1).recovery_action == ACTION_NONE

    def test_recovery_action_without_field_values(self, ready: Nvml, driver: SimDriver) -> None:
        """An older driver without nvmlDeviceGetFieldValues: no recovery action, telemetry kept."""
        driver.inject(1, "xid", 79)
        driver.remove("nvmlDeviceGetFieldValues")
        probe = ready.probe(1)
        assert probe.recovery_action is None
        assert probe.events == (Responding(),)
        assert probe.telemetry.power_w is not None


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


# ----- per MIG instance --------------------------------------------------------------------------
def test_each_mig_device_has_its_own_readings(tmp_path: Path) -> None:
    """A MIG-enabled GPU's probe reads each MIG device's framebuffer through its own handle and
    its GPU instance's profiling ratios (nvmlGpmMigSampleGet), as DCGM serves them."""
    clock = FakeClock()
    node = node_from_mapping(
        {"version": "v1", "gpus": [{"mig": ["3g.40gb", "2g.20gb", "1g.10gb"]}]}
    )
    drv = SimDriver(node, clock=clock)
    install(drv)
    backend = Nvml(sysfs_root=tmp_path, clock=clock)
    try:
        backend.init()
        (gpu,) = backend.discover()
        first = backend.probe(0)
        clock.now += 5.0
        second = backend.probe(0)
    finally:
        backend.shutdown()
        uninstall()
    assert first.events == second.events == (Responding(),)
    sizes = {m.uuid: m.memory_mib for m in gpu.mig_devices}
    assert set(second.mig_telemetry) == set(sizes)
    for uuid, t in second.mig_telemetry.items():
        assert t.fb_used_mib is not None
        assert t.fb_free_mib is not None
        assert t.fb_reserved_mib is not None
        assert sizes[uuid] - 3 <= t.fb_used_mib + t.fb_free_mib + t.fb_reserved_mib <= sizes[uuid]
        assert t.gr_engine_active is not None
        assert 0 < t.gr_engine_active < 1
    # No pair yet at the first probe; each instance's own wave at the second.
    assert all(t.gr_engine_active is None for t in first.mig_telemetry.values())
    assert len({t.sm_active for t in second.mig_telemetry.values()}) == 3
    assert drv.calls["nvmlGpmMigSampleGet"] == 6
