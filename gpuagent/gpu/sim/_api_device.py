"""Per-device query entry points of the simulated ``libnvidia-ml`` (identity and telemetry).

Strict where nvml.h is: on a MIG-enabled GPU, aggregate memory reads of the parent
(``nvmlDeviceGetMemoryInfo``/``_v2``) answer NO_PERMISSION unless the node grants CAP_SYS_ADMIN
(``cap_sys_admin`` in ``--sim-config``); per-instance memory comes from the MIG device handles. A
driver before R565 has no recovery-action field (230): its slot answers NOT_SUPPORTED.
``nvmlDeviceGetNumaNodeId`` answers only where the GPUs are NUMA nodes (``numa_from_nvml``), and
a GPU whose NVLinks the driver does not show answers NOT_SUPPORTED for every NVLink field, as
the real H200 did.
"""

from __future__ import annotations

import time
from typing import Any

import pynvml

from gpuagent.gpu.sim import telemetry
from gpuagent.gpu.sim._abi import Symbol, as_int, device, out, write_str
from gpuagent.gpu.sim.state import DriverState, GpuState

SUCCESS = int(pynvml.NVML_SUCCESS)
INVALID_ARGUMENT = int(pynvml.NVML_ERROR_INVALID_ARGUMENT)
NOT_SUPPORTED = int(pynvml.NVML_ERROR_NOT_SUPPORTED)
NO_PERMISSION = int(pynvml.NVML_ERROR_NO_PERMISSION)
_UINT = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
_ULL = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
#: ``nvmlFieldValue_t.scopeId`` asking for the sum over every NVLink (NVML's UINT_MAX).
ALL_LINKS = 0xFFFF_FFFF


def fill_pci(info: Any, gpu: GpuState) -> None:
    """Write ``gpu``'s PCI identity into an ``nvmlPciInfo_t``."""
    domain, bus, device, function = gpu.spec.pci_address
    info.busIdLegacy = f"{domain:04X}:{bus:02X}:{device:02X}.{function}".encode()
    info.domain = domain
    info.bus = bus
    info.device = device
    info.pciDeviceId = gpu.spec.profile.pci_device_id
    info.pciSubSystemId = gpu.spec.profile.pci_subsystem_id
    info.busId = gpu.spec.pci_bus_id.encode()


def _uuid(st: DriverState, gpu: GpuState, buffer: object, length: object) -> int:
    return write_str(buffer, length, gpu.spec.uuid)


def _name(st: DriverState, gpu: GpuState, buffer: object, length: object) -> int:
    return write_str(buffer, length, gpu.spec.name)


def _index(st: DriverState, gpu: GpuState, ref: object) -> int:
    out(ref).value = gpu.index
    return SUCCESS


def _minor(st: DriverState, gpu: GpuState, ref: object) -> int:
    out(ref).value = gpu.spec.minor
    return SUCCESS


def _numa(st: DriverState, gpu: GpuState, ref: object) -> int:
    if not st.node.numa_from_nvml:
        return NOT_SUPPORTED  # the GPUs are not NUMA nodes: x86 boards, VMs (the host knows)
    out(ref).value = gpu.spec.numa_node
    return SUCCESS


def _architecture(st: DriverState, gpu: GpuState, ref: object) -> int:
    out(ref).value = gpu.spec.architecture
    return SUCCESS


def _compute_capability(st: DriverState, gpu: GpuState, major: object, minor: object) -> int:
    out(major).value, out(minor).value = gpu.spec.profile.compute_capability
    return SUCCESS


def _pci_info(st: DriverState, gpu: GpuState, ref: object) -> int:
    fill_pci(out(ref), gpu)
    return SUCCESS


def _aggregate_refused(st: DriverState, gpu: GpuState) -> bool:
    """A parent GPU's memory under MIG needs privileges the agent may not have."""
    return gpu.mig_enabled and not st.node.cap_sys_admin


def _memory(st: DriverState, gpu: GpuState, ref: object) -> int:
    if _aggregate_refused(st, gpu):
        return NO_PERMISSION
    s = st.sample(gpu)
    memory = out(ref)
    memory.total = s.fb_total_bytes
    memory.used = s.fb_used_bytes + s.fb_reserved_bytes
    memory.free = s.fb_free_bytes
    return SUCCESS


def _memory_v2(st: DriverState, gpu: GpuState, ref: object) -> int:
    memory = out(ref)
    if memory.version != pynvml.nvmlMemory_v2:
        return int(pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
    if _aggregate_refused(st, gpu):
        return NO_PERMISSION
    s = st.sample(gpu)
    memory.total = s.fb_total_bytes
    memory.reserved = s.fb_reserved_bytes
    memory.used = s.fb_used_bytes
    memory.free = s.fb_free_bytes
    return SUCCESS


def _temperature(st: DriverState, gpu: GpuState, sensor: object, ref: object) -> int:
    if as_int(sensor) != pynvml.NVML_TEMPERATURE_GPU:
        return INVALID_ARGUMENT
    out(ref).value = st.sample(gpu).temperature_c
    return SUCCESS


def _power(st: DriverState, gpu: GpuState, ref: object) -> int:
    out(ref).value = st.sample(gpu).power_mw
    return SUCCESS


def _power_limit(st: DriverState, gpu: GpuState, ref: object) -> int:
    out(ref).value = gpu.spec.profile.power_limit_mw
    return SUCCESS


def _energy(st: DriverState, gpu: GpuState, ref: object) -> int:
    out(ref).value = st.sample(gpu).energy_mj
    return SUCCESS


def _clock(st: DriverState, gpu: GpuState, kind: object, ref: object) -> int:
    s = st.sample(gpu)
    clocks = (s.graphics_clock_mhz, s.sm_clock_mhz, s.mem_clock_mhz, s.video_clock_mhz)
    k = as_int(kind)
    if not 0 <= k < len(clocks):
        return INVALID_ARGUMENT
    out(ref).value = clocks[k]
    return SUCCESS


def _max_clock(st: DriverState, gpu: GpuState, kind: object, ref: object) -> int:
    p = gpu.spec.profile
    clocks = (
        p.max_graphics_clock_mhz,
        p.max_sm_clock_mhz,
        p.max_mem_clock_mhz,
        p.max_video_clock_mhz,
    )
    k = as_int(kind)
    if not 0 <= k < len(clocks):
        return INVALID_ARGUMENT
    out(ref).value = clocks[k]
    return SUCCESS


def _utilization(st: DriverState, gpu: GpuState, ref: object) -> int:
    if gpu.in_mig:
        return NOT_SUPPORTED
    s = st.sample(gpu)
    util = out(ref)
    util.gpu = s.gpu_util_pct
    util.memory = s.mem_util_pct
    return SUCCESS


def _encoder(st: DriverState, gpu: GpuState, util: object, period: object) -> int:
    out(util).value = st.sample(gpu).enc_util_pct
    out(period).value = telemetry.ENCODER_SAMPLING_US
    return SUCCESS


def _decoder(st: DriverState, gpu: GpuState, util: object, period: object) -> int:
    out(util).value = st.sample(gpu).dec_util_pct
    out(period).value = telemetry.DECODER_SAMPLING_US
    return SUCCESS


def _performance_state(st: DriverState, gpu: GpuState, ref: object) -> int:
    out(ref).value = pynvml.NVML_PSTATE_0  # busy GPUs run in P0
    return SUCCESS


def _total_ecc(st: DriverState, gpu: GpuState, kind: object, counter: object, ref: object) -> int:
    """Volatile or aggregate ECC totals: corrected (SBE) none, uncorrected (DBE) as injected."""
    if as_int(kind) not in (0, 1) or as_int(counter) not in (0, 1):
        return INVALID_ARGUMENT
    uncorrected = as_int(kind) == pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
    out(ref).value = gpu.ecc_dbe_count if uncorrected else 0
    return SUCCESS


def _violation(st: DriverState, gpu: GpuState, policy: object, ref: object) -> int:
    """Time clocks were held down by a policy: never, on the simulated GPUs."""
    if not 0 <= as_int(policy) <= pynvml.NVML_PERF_POLICY_TOTAL_BASE_CLOCKS:
        return INVALID_ARGUMENT
    time_ = out(ref)
    time_.referenceTime = int(st.clock() * 1_000_000)
    time_.violationTime = 0
    return SUCCESS


def _pcie_replays(st: DriverState, gpu: GpuState, ref: object) -> int:
    out(ref).value = st.sample(gpu).pcie_replays
    return SUCCESS


def _remapped_rows(  # noqa: PLR0917 (the C signature)
    st: DriverState, gpu: GpuState, corr: object, unc: object, pending: object, failure: object
) -> int:
    # Row remapping is Ampere and newer, and not readable while MIG instances exist.
    if gpu.in_mig:
        return NOT_SUPPORTED
    for ref in (corr, unc, pending, failure):
        out(ref).value = 0
    return SUCCESS


def _mig_mode(st: DriverState, gpu: GpuState, current: object, pending: object) -> int:
    # nvml.h: NOT_SUPPORTED if the device does not support MIG mode (a model without profiles).
    if not gpu.spec.profile.mig_profiles:
        return NOT_SUPPORTED
    whole = gpu if gpu.mig is None else gpu.mig.parent
    out(current).value = whole.mig_mode
    out(pending).value = whole.mig_pending
    return SUCCESS


def _nvlink(st: DriverState, gpu: GpuState, field_id: int, scope: int) -> tuple[int, int] | int:
    """NVLink data counter (KiB) of one link, or of all links for ``ALL_LINKS``; else an error."""
    if not gpu.links:
        return NOT_SUPPORTED  # no NVLink the driver shows
    active = sum(peer is not None for peer in gpu.links)
    if scope != ALL_LINKS:
        if not 0 <= scope < len(gpu.links):
            return INVALID_ARGUMENT
        if gpu.links[scope] is None:
            return _ULL, 0
    if active == 0:
        return _ULL, 0
    s = st.sample(gpu)
    total = (
        s.nvlink_tx_kib
        if field_id == pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX
        else s.nvlink_rx_kib
    )
    return _ULL, total if scope == ALL_LINKS else total // active


def _link_state(gpu: GpuState, link: int) -> tuple[int, int] | int:
    """NVLink ``link``'s state (NVML_FEATURE_ENABLED for an active link), or an error code."""
    if gpu.mig is not None or not gpu.links:
        return NOT_SUPPORTED
    if not 0 <= link < len(gpu.links):
        return INVALID_ARGUMENT
    active = gpu.links[link] is not None
    return _UINT, pynvml.NVML_FEATURE_ENABLED if active else pynvml.NVML_FEATURE_DISABLED


def _field(
    st: DriverState, gpu: GpuState, field_id: int, scope: int = 0
) -> tuple[int, int] | int | None:
    """``(value type, value)`` of one field, an error code for its slot, or None if unknown."""
    f = pynvml
    if field_id in st.node.absent_fields or field_id in gpu.spec.profile.unsupported_fields:
        return NOT_SUPPORTED
    if field_id == f.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION:
        if not st.node.has_recovery_action:
            return None
        return _UINT, gpu.recovery_action
    if field_id == f.NVML_FI_DEV_NVLINK_GET_STATE:
        return _link_state(gpu, scope)
    if field_id in (f.NVML_FI_DEV_ECC_DBE_VOL_TOTAL, f.NVML_FI_DEV_ECC_DBE_AGG_TOTAL):
        return _ULL, gpu.ecc_dbe_count
    if field_id in (f.NVML_FI_DEV_ECC_SBE_VOL_TOTAL, f.NVML_FI_DEV_ECC_SBE_AGG_TOTAL):
        return _ULL, 0
    if field_id in (f.NVML_FI_DEV_PERF_POLICY_POWER, f.NVML_FI_DEV_PERF_POLICY_THERMAL):
        return _ULL, 0  # ns held down: the simulated GPUs are never throttled
    if field_id in (
        f.NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL,
        f.NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL,
        f.NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL,
        f.NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL,
    ):
        return (_ULL, 0) if gpu.links else NOT_SUPPORTED  # no NVLink: no counters
    if field_id == f.NVML_FI_DEV_MEMORY_TEMP:
        return _UINT, st.sample(gpu).memory_temperature_c
    if field_id == f.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION:
        return _ULL, st.sample(gpu).energy_mj
    if field_id == f.NVML_FI_DEV_NVLINK_LINK_COUNT:
        return (_UINT, len(gpu.links)) if gpu.links else NOT_SUPPORTED
    if field_id == f.NVML_FI_DEV_PCIE_REPLAY_COUNTER:
        return _ULL, st.sample(gpu).pcie_replays
    if field_id in (
        f.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX,
        f.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX,
    ):
        return _nvlink(st, gpu, field_id, scope)
    if field_id in (
        f.NVML_FI_DEV_REMAPPED_COR,
        f.NVML_FI_DEV_REMAPPED_UNC,
        f.NVML_FI_DEV_REMAPPED_PENDING,
        f.NVML_FI_DEV_REMAPPED_FAILURE,
    ):
        return NOT_SUPPORTED if gpu.in_mig else (_UINT, 0)
    return None


def _field_values(st: DriverState, gpu: GpuState, count: object, ref: object) -> int:
    values = out(ref)
    n = as_int(count)
    if n < 0 or n > len(values):
        return INVALID_ARGUMENT
    now_us = time.time_ns() // 1000
    for i in range(n):
        slot = values[i]
        slot.timestamp = now_us
        slot.latencyUsec = 0
        found = _field(st, gpu, int(slot.fieldId), int(slot.scopeId))
        if found is None or isinstance(found, int):
            slot.nvmlReturn = NOT_SUPPORTED if found is None else found
            continue
        slot.valueType, value = found
        if slot.valueType == _UINT:
            slot.value.uiVal = value
        else:
            slot.value.ullVal = value
        slot.nvmlReturn = SUCCESS
    return SUCCESS


SYMBOLS: dict[str, Symbol] = {
    "nvmlDeviceGetUUID": device(_uuid),
    "nvmlDeviceGetName": device(_name),
    "nvmlDeviceGetIndex": device(_index),
    "nvmlDeviceGetMinorNumber": device(_minor),
    "nvmlDeviceGetNumaNodeId": device(_numa),
    "nvmlDeviceGetArchitecture": device(_architecture),
    "nvmlDeviceGetCudaComputeCapability": device(_compute_capability),
    "nvmlDeviceGetPciInfo_v3": device(_pci_info),
    "nvmlDeviceGetMemoryInfo": device(_memory),
    "nvmlDeviceGetMemoryInfo_v2": device(_memory_v2),
    "nvmlDeviceGetTemperature": device(_temperature),
    "nvmlDeviceGetPowerUsage": device(_power),
    "nvmlDeviceGetEnforcedPowerLimit": device(_power_limit),
    "nvmlDeviceGetTotalEnergyConsumption": device(_energy),
    "nvmlDeviceGetClockInfo": device(_clock),
    "nvmlDeviceGetMaxClockInfo": device(_max_clock),
    "nvmlDeviceGetUtilizationRates": device(_utilization),
    "nvmlDeviceGetEncoderUtilization": device(_encoder),
    "nvmlDeviceGetDecoderUtilization": device(_decoder),
    "nvmlDeviceGetPcieReplayCounter": device(_pcie_replays),
    "nvmlDeviceGetTotalEccErrors": device(_total_ecc),
    "nvmlDeviceGetViolationStatus": device(_violation),
    "nvmlDeviceGetPerformanceState": device(_performance_state),
    "nvmlDeviceGetRemappedRows": device(_remapped_rows),
    "nvmlDeviceGetMigMode": device(_mig_mode),
    "nvmlDeviceGetFieldValues": device(_field_values),
}
