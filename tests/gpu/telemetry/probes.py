"""What the telemetry tests share: the fields a probe reads, a simulated node with a backend that
has discovered it, and what a probe must read by the simulator's own model.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pynvml
from support.clock import FakeClock

from gpuagent.domain.devices import Telemetry
from gpuagent.domain.health import Responding
from gpuagent.gpu.gpm import GPM_METRICS
from gpuagent.gpu.nvml import Nvml
from gpuagent.gpu.sim import (
    SimDriver,
    install,
    uninstall,
)
from gpuagent.gpu.sim import telemetry as sim_telemetry

MIB = 1024 * 1024
GPUS = 4
START = 1000.0
ABSENT_LOG = "value not offered by this gpu or driver"
SLOT_LOG = "nvml value unreadable; left out"
FAILED_LOG = "nvml call failed; value left out"
NOT_SUPPORTED = int(pynvml.NVML_ERROR_NOT_SUPPORTED)
FUNCTION_NOT_FOUND = int(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
GPU_IS_LOST = int(pynvml.NVML_ERROR_GPU_IS_LOST)
UNKNOWN = int(pynvml.NVML_ERROR_UNKNOWN)

GPM_FIELDS = frozenset(name for _, name, _ in GPM_METRICS)
# Every field a probe reads (the NVLink bandwidth is the poller's rate from two probes).
ALL_FIELDS = frozenset(f.name for f in dataclasses.fields(Telemetry)) - {"nvlink_bandwidth_total"}
# The values only the one nvmlDeviceGetFieldValues call carries (the others have a call of their
# own, read where the field value is missing: row remapping, PCIe replays, ECC, violations).
FIELD_BASED = frozenset(
    {
        "memory_temperature_c",
        "nvlink_crc_flit_errors",
        "nvlink_crc_data_errors",
        "nvlink_replay_errors",
        "nvlink_recovery_errors",
    }
)


@contextlib.contextmanager
def ready(node: Any, clock: FakeClock, tmp_path: Path) -> Iterator[tuple[SimDriver, Nvml]]:
    """``node``'s simulated driver installed and a backend that has discovered its GPUs."""
    drv = SimDriver(node, clock=clock)
    install(drv)
    backend = Nvml(sysfs_root=tmp_path, clock=clock)
    try:
        backend.init()
        backend.discover()
        yield drv, backend
    finally:
        backend.shutdown()
        uninstall()


def model(driver: SimDriver, index: int, t: float, previous: float | None) -> Telemetry:
    """What a probe at driver time ``t`` must read, by the simulator's own model.

    ``previous`` is the driver time of the GPU's previous probe (the GPM interval), if any.
    """
    spec = driver.node.gpus[index]
    s = sim_telemetry.sample(spec.profile, index, spec.memory_mib, t)
    gpm: dict[str, float | None] = {}
    if previous is not None:
        p = sim_telemetry.sample(spec.profile, index, spec.memory_mib, previous)
        for metric_id, name, _ in GPM_METRICS:
            value = sim_telemetry.gpm_value(metric_id, p, s)
            per_sec = metric_id in (
                pynvml.NVML_GPM_METRIC_PCIE_TX_PER_SEC,
                pynvml.NVML_GPM_METRIC_PCIE_RX_PER_SEC,
            )
            gpm[name] = value * MIB if per_sec else value / 100
    return Telemetry(
        temperature_c=s.temperature_c,
        memory_temperature_c=s.memory_temperature_c,
        power_w=s.power_mw / 1000,
        energy_mj=s.energy_mj,
        sm_clock_mhz=s.sm_clock_mhz,
        mem_clock_mhz=s.mem_clock_mhz,
        gpu_util_pct=s.gpu_util_pct,
        mem_util_pct=s.mem_util_pct,
        enc_util_pct=s.enc_util_pct,
        dec_util_pct=s.dec_util_pct,
        fb_used_mib=s.fb_used_bytes // MIB,  # whole MiB, as DCGM reports them
        fb_free_mib=s.fb_free_bytes // MIB,
        fb_reserved_mib=s.fb_reserved_bytes // MIB,
        pcie_replays=s.pcie_replays,
        remapped_rows_correctable=0,
        remapped_rows_uncorrectable=0,
        row_remap_pending=0,
        row_remap_failure=0,
        ecc_sbe_volatile=0,
        ecc_dbe_volatile=0,
        # Never throttled, and no NVLink errors, in the simulator.
        power_violation_ns=0,
        thermal_violation_ns=0,
        nvlink_crc_flit_errors=0,
        nvlink_crc_data_errors=0,
        nvlink_replay_errors=0,
        nvlink_recovery_errors=0,
        **gpm,
    )


def missing(telemetry: Telemetry) -> set[str]:
    return {name for name in ALL_FIELDS if getattr(telemetry, name) is None}


def absent_logs(logs: Sequence[Mapping[str, Any]]) -> list[tuple[int, str]]:
    return sorted((e["gpu"], e["call"]) for e in logs if e["event"] == ABSENT_LOG)


def two_probes(nvml: Nvml, clock: FakeClock, index: int, step: float = 30.0) -> Telemetry:
    """Probe, let ``step`` seconds pass, probe again: the second probe's telemetry."""
    assert nvml.probe(index).events == (Responding(),)
    clock.now += step
    probe = nvml.probe(index)
    assert probe.events == (Responding(),)
    return probe.telemetry
