"""MIG as the NVML backend sees it: whether a GPU is MIG-capable, and each MIG device's own
readings.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pynvml
import structlog.testing
from support.clock import FakeClock

from gpu.nvml.rig import ABSENT_LOG, GPUS, NOT_SUPPORTED, discover_on
from gpuagent.domain.devices import DriverState, Gpu
from gpuagent.domain.health import (
    DISCOVERY,
    Responding,
)
from gpuagent.domain.snapshot import Snapshot
from gpuagent.gpu.nvml import (
    Nvml,
)
from gpuagent.gpu.sim import SimDriver, install, node_from_count, node_from_mapping, uninstall
from gpuagent.nodefiles.labels import node_labels

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
