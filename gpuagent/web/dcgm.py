"""dcgm-exporter's families that gpuagent exports: names, types and HELP as dcgm-exporter writes
them, and which :class:`~gpuagent.domain.devices.Telemetry` field each one reads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gpuagent.domain import xids
from gpuagent.domain.devices import Telemetry

__all__ = [
    "DCGM_FAMILIES",
    "DCGM_METRICS",
    "GPU_SCOPE",
    "INSTANCE_SCOPE",
    "LAST_XID",
    "DcgmMetric",
    "LastXid",
    "xid_action",
    "xid_label",
    "xid_message",
]

GPU_SCOPE = "gpu"  # a reading of the whole GPU: a MIG series repeats its parent's value
INSTANCE_SCOPE = "instance"  # a reading of the GPU instance: a MIG series shows its own value


@dataclass(frozen=True, slots=True)
class DcgmMetric:
    """A dcgm-exporter family: name, type and HELP as dcgm-exporter writes them; its reading.

    ``detailed``: exported only with ``--detailed-agent-metrics`` (off in dcgm-exporter's
    default lists, and used by no dashboard or rule the project ships).
    """

    name: str
    kind: str
    help: str
    read: Callable[[Telemetry], float | None]
    scope: str = GPU_SCOPE
    detailed: bool = False


@dataclass(frozen=True, slots=True)
class LastXid:
    """dcgm-exporter's XID family: each GPU's last XID (0 before any), labelled with its code
    and message (``err_code``, ``err_msg``): read from the GPU, not from its telemetry."""

    name: str = "DCGM_FI_DEV_XID_ERRORS"
    kind: str = "gauge"
    help: str = "Value of the last XID error encountered."
    detailed: bool = False


LAST_XID = LastXid()


# dcgm-exporter's default counters (etc/default-counters.csv) that Telemetry carries, in that
# file's order, then off-by-default ones we have values for: ECC and remap pending (the shipped
# alerts and dashboard use them), SM activity (only with --detailed-agent-metrics), throttling
# and NVLink errors (the shipped alerts). The device part of /metrics renders them in this order.
DCGM_FAMILIES: tuple[DcgmMetric | LastXid, ...] = (
    DcgmMetric("DCGM_FI_DEV_SM_CLOCK", "gauge", "SM clock frequency (in MHz).",
               lambda t: t.sm_clock_mhz),
    DcgmMetric("DCGM_FI_DEV_MEM_CLOCK", "gauge", "Memory clock frequency (in MHz).",
               lambda t: t.mem_clock_mhz),
    DcgmMetric("DCGM_FI_DEV_MEMORY_TEMP", "gauge", "Memory temperature (in C).",
               lambda t: t.memory_temperature_c),
    DcgmMetric("DCGM_FI_DEV_GPU_TEMP", "gauge", "GPU temperature (in C).",
               lambda t: t.temperature_c),
    DcgmMetric("DCGM_FI_DEV_POWER_USAGE", "gauge", "Power draw (in W).", lambda t: t.power_w),
    DcgmMetric("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "counter",
               "Total energy consumption since boot (in mJ).", lambda t: t.energy_mj),
    DcgmMetric("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "counter", "Total number of PCIe retries.",
               lambda t: t.pcie_replays),
    DcgmMetric("DCGM_FI_DEV_GPU_UTIL", "gauge", "GPU utilization (in %).",
               lambda t: t.gpu_util_pct, INSTANCE_SCOPE),
    DcgmMetric("DCGM_FI_DEV_MEM_COPY_UTIL", "gauge", "Memory utilization (in %).",
               lambda t: t.mem_util_pct, INSTANCE_SCOPE),
    DcgmMetric("DCGM_FI_DEV_ENC_UTIL", "gauge", "Encoder utilization (in %).",
               lambda t: t.enc_util_pct),
    DcgmMetric("DCGM_FI_DEV_DEC_UTIL", "gauge", "Decoder utilization (in %).",
               lambda t: t.dec_util_pct),
    LAST_XID,
    DcgmMetric("DCGM_FI_DEV_FB_FREE", "gauge", "Framebuffer memory free (in MiB).",
               lambda t: t.fb_free_mib, INSTANCE_SCOPE),
    DcgmMetric("DCGM_FI_DEV_FB_USED", "gauge", "Framebuffer memory used (in MiB).",
               lambda t: t.fb_used_mib, INSTANCE_SCOPE),
    DcgmMetric("DCGM_FI_DEV_FB_RESERVED", "gauge", "Framebuffer memory reserved (in MiB).",
               lambda t: t.fb_reserved_mib, INSTANCE_SCOPE),
    DcgmMetric("DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", "counter",
               "Total number of NVLink bandwidth counters for all lanes.",
               lambda t: t.nvlink_bandwidth_total),
    DcgmMetric("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", "counter",
               "Number of remapped rows for uncorrectable errors",
               lambda t: t.remapped_rows_uncorrectable),
    DcgmMetric("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "counter",
               "Number of remapped rows for correctable errors",
               lambda t: t.remapped_rows_correctable),
    DcgmMetric("DCGM_FI_DEV_ROW_REMAP_FAILURE", "gauge", "Whether remapping of rows has failed",
               lambda t: t.row_remap_failure),
    DcgmMetric("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "gauge",
               "Ratio of time the graphics engine is active.",
               lambda t: t.gr_engine_active, INSTANCE_SCOPE),
    DcgmMetric("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "gauge",
               "Ratio of cycles the tensor (HMMA) pipe is active.",
               lambda t: t.tensor_active, INSTANCE_SCOPE),
    DcgmMetric("DCGM_FI_PROF_DRAM_ACTIVE", "gauge",
               "Ratio of cycles the device memory interface is active sending or receiving data.",
               lambda t: t.dram_active, INSTANCE_SCOPE),
    DcgmMetric("DCGM_FI_PROF_PCIE_TX_BYTES", "gauge",
               "The rate of data transmitted over the PCIe bus - including both protocol headers "
               "and data payloads - in bytes per second.", lambda t: t.pcie_tx_bytes),
    DcgmMetric("DCGM_FI_PROF_PCIE_RX_BYTES", "gauge",
               "The rate of data received over the PCIe bus - including both protocol headers "
               "and data payloads - in bytes per second.", lambda t: t.pcie_rx_bytes),
    # Off by default in dcgm-exporter; exported here whenever the driver offers them.
    DcgmMetric("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "counter",
               "Total number of single-bit volatile ECC errors.", lambda t: t.ecc_sbe_volatile),
    DcgmMetric("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "counter",
               "Total number of double-bit volatile ECC errors.", lambda t: t.ecc_dbe_volatile),
    DcgmMetric("DCGM_FI_DEV_ROW_REMAP_PENDING", "gauge", "Whether remapping of rows is pending",
               lambda t: t.row_remap_pending),
    DcgmMetric("DCGM_FI_PROF_SM_ACTIVE", "gauge",
               "The ratio of cycles an SM has at least 1 warp assigned.",
               lambda t: t.sm_active, INSTANCE_SCOPE, detailed=True),
    DcgmMetric("DCGM_FI_PROF_SM_OCCUPANCY", "gauge",
               "The ratio of number of warps resident on an SM.",
               lambda t: t.sm_occupancy, INSTANCE_SCOPE, detailed=True),
    # Off by default in dcgm-exporter too; what the shipped alerts watch (throttling, NVLink).
    DcgmMetric("DCGM_FI_DEV_POWER_VIOLATION", "counter",
               "Throttling duration due to power constraints (in ns).",
               lambda t: t.power_violation_ns),
    DcgmMetric("DCGM_FI_DEV_THERMAL_VIOLATION", "counter",
               "Throttling duration due to thermal constraints (in ns).",
               lambda t: t.thermal_violation_ns),
    DcgmMetric("DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL", "counter",
               "Total number of NVLink flow-control CRC errors.",
               lambda t: t.nvlink_crc_flit_errors),
    DcgmMetric("DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL", "counter",
               "Total number of NVLink data CRC errors.", lambda t: t.nvlink_crc_data_errors),
    DcgmMetric("DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL", "counter",
               "Total number of NVLink retries.", lambda t: t.nvlink_replay_errors),
    DcgmMetric("DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL", "counter",
               "Total number of NVLink recovery errors.", lambda t: t.nvlink_recovery_errors),
)  # fmt: skip

#: The families read from a GPU's telemetry.
DCGM_METRICS = tuple(f for f in DCGM_FAMILIES if isinstance(f, DcgmMetric))


OTHER_XID = "other"


def xid_label(xid: int) -> str:
    """The ``xid`` label of ``gpuagent_xid_errors_total``: the code for an XID of the catalog,
    ``other`` for any other value (so junk event data cannot grow the series without bound)."""
    return str(xid) if xids.is_known(xid) else OTHER_XID


def xid_action(xid: int) -> str:
    """The ``action`` label: the catalog's immediate action (``CONTACT_SUPPORT`` if unlisted)."""
    return xids.lookup(xid).action.value


def xid_message(xid: int) -> str:
    """``err_msg`` for an XID, from NVIDIA's XID catalog (the health policy's table)."""
    if xid == 0:
        return "No Error"
    entry = xids.lookup(xid)
    return "Unknown Error" if entry.text == xids.UNKNOWN_TEXT else entry.text
