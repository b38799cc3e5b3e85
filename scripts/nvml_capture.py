#!/usr/bin/env python3
"""Record what this node's NVIDIA driver answers to every call gpuagent makes, to one JSON file.

Read-only: it only queries (and registers for events, which changes nothing on the GPU); it needs
nothing but Python 3.11+ and pynvml (``pip install nvidia-ml-py``), and takes well under five
minutes on an 8-GPU node. Run it as root on a GPU node, then commit the file under
``tests/data/captures/``: ``--sim-config`` can load it (``capture: FILE``) as a simulated node, so
the real driver's answers become a CI fixture.

What it records, per GPU: every call the agent's backend makes (its arguments, return code,
value, and latency: the first, cold call and the median of the repeats, warm), every field value
the agent reads and what each costs alone, GPM sample pairs taken 0, 50, 120 and 1000 ms apart,
the supported event types and a few event waits, every NVLink's state and far end, the pairwise
PCIe topology, and MIG — twice, as root with and without CAP_SYS_ADMIN (the second in a child
process that drops it). From the host's ``/sys``, what GPU feature discovery labels the node
with: each GPU's PCI class and NUMA node, and the DMI product name (null where there is none).

What it holds that names the hardware: the GPUs' UUIDs (and MIG devices'), PCI addresses and the
driver version; no serial number, board part number or host name. ``--anonymise`` replaces the
UUIDs with random ones before the file is written.

    scripts/nvml-capture -o capture.json              # this node's driver
    scripts/nvml-capture --simulate 2 -o sim.json     # gpuagent's simulated driver (no GPU)
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pynvml

#: A JSON object as the capture writes it.
Json = dict[str, Any]

FORMAT = "gpuagent-nvml-capture/1"
ROOT = Path(__file__).resolve().parent.parent
ALL_LINKS = 0xFFFF_FFFF
MAX_LINKS = 18
CAP_SYS_ADMIN = 21
# The field values the agent reads (gpuagent.gpu.telemetry.FIELDS, topology's NVLink fields).
FIELDS = [
    (pynvml.NVML_FI_DEV_MEMORY_TEMP, 0),
    (pynvml.NVML_FI_DEV_PCIE_REPLAY_COUNTER, 0),
    (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, ALL_LINKS),
    (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, ALL_LINKS),
    (pynvml.NVML_FI_DEV_REMAPPED_COR, 0),
    (pynvml.NVML_FI_DEV_REMAPPED_UNC, 0),
    (pynvml.NVML_FI_DEV_REMAPPED_PENDING, 0),
    (pynvml.NVML_FI_DEV_REMAPPED_FAILURE, 0),
    (pynvml.NVML_FI_DEV_ECC_SBE_VOL_TOTAL, 0),
    (pynvml.NVML_FI_DEV_ECC_DBE_VOL_TOTAL, 0),
    (pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION, 0),
    (pynvml.NVML_FI_DEV_PERF_POLICY_POWER, 0),
    (pynvml.NVML_FI_DEV_PERF_POLICY_THERMAL, 0),
    (pynvml.NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL, 0),
    (pynvml.NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL, 0),
    (pynvml.NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL, 0),
    (pynvml.NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL, 0),
    (pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT, 0),
] + [(pynvml.NVML_FI_DEV_NVLINK_GET_STATE, link) for link in range(MAX_LINKS)]
# Fields whose cost is measured alone (``field_costs``): one of each the agent reads, and the
# energy counter and instant power, which a poll could read as fields instead of by their calls.
COSTED_FIELDS = sorted(
    {f for f, _ in FIELDS}
    | {pynvml.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION, pynvml.NVML_FI_DEV_POWER_INSTANT}
)
GPM_METRICS = [
    pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL,
    pynvml.NVML_GPM_METRIC_SM_UTIL,
    pynvml.NVML_GPM_METRIC_SM_OCCUPANCY,
    pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL,
    pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL,
    pynvml.NVML_GPM_METRIC_PCIE_TX_PER_SEC,
    pynvml.NVML_GPM_METRIC_PCIE_RX_PER_SEC,
]
HEALTH_EVENTS = (
    pynvml.nvmlEventTypeXidCriticalError
    | pynvml.nvmlEventTypeDoubleBitEccError
    | pynvml.nvmlEventTypeGpuRecoveryAction
)


def jsonable(value: Any, depth: int = 0) -> Any:
    """A pynvml answer as JSON: numbers, text, lists, structs as objects of their fields."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    if isinstance(value, list | tuple):
        return [jsonable(v, depth + 1) for v in value]
    if isinstance(value, ctypes._SimpleCData):
        return jsonable(value.value, depth + 1)
    if isinstance(value, ctypes.Structure) and depth < 4:
        return {
            name: jsonable(getattr(value, name), depth + 1)
            for name, *_ in getattr(value, "_fields_", ())
        }
    if isinstance(value, ctypes.Array) and depth < 4:
        return [jsonable(v, depth + 1) for v in value]
    return repr(value)


def attempt(fn: Callable[..., Any], *args: Any) -> tuple[int, Any, float]:
    """``(return code, value, milliseconds)`` of one call."""
    started = time.perf_counter()
    try:
        value = fn(*args)
        code = pynvml.NVML_SUCCESS
    except pynvml.NVMLError as exc:
        value, code = None, int(exc.value)
    return code, value, (time.perf_counter() - started) * 1000


class Recorder:
    """Calls, each made ``repeat`` times: the first is cold, the median of the rest warm."""

    def __init__(self, repeat: int) -> None:
        self.repeat = repeat

    def measure(
        self, name: str, fn: Callable[..., Any], *args: Any, shown: Any = None
    ) -> tuple[Json, Any]:
        code, value, cold = attempt(fn, *args)
        warm = [attempt(fn, *args)[2] for _ in range(max(0, self.repeat - 1))]
        return {
            "call": name,
            "args": jsonable(shown if shown is not None else [a for a in args if _plain(a)]),
            "return": code,
            "error": None if code == pynvml.NVML_SUCCESS else str(pynvml.NVMLError(code)),
            "value": jsonable(value),
            "cold_ms": round(cold, 4),
            "warm_ms": round(statistics.median(warm), 4) if warm else round(cold, 4),
        }, value


def _plain(value: Any) -> bool:
    return isinstance(value, int | float | str | bytes)


def capture_gpu(rec: Recorder, index: int) -> tuple[Json, Any]:
    calls: list[Json] = []

    def m(name: str, fn: Callable[..., Any], *args: Any) -> Any:
        record, value = rec.measure(name, fn, *args)
        calls.append(record)
        return value if record["return"] == pynvml.NVML_SUCCESS else None

    handle = m("nvmlDeviceGetHandleByIndex", pynvml.nvmlDeviceGetHandleByIndex, index)
    gpu: dict[str, Any] = {"index": index, "calls": calls}
    if handle is None:
        return gpu, None
    gpu["uuid"] = m("nvmlDeviceGetUUID", pynvml.nvmlDeviceGetUUID, handle)
    pci = m("nvmlDeviceGetPciInfo", pynvml.nvmlDeviceGetPciInfo, handle)
    gpu["pci_bus_id"] = jsonable(pci.busId) if pci is not None else None
    gpu["minor"] = m("nvmlDeviceGetMinorNumber", pynvml.nvmlDeviceGetMinorNumber, handle)
    gpu["name"] = m("nvmlDeviceGetName", pynvml.nvmlDeviceGetName, handle)
    memory = m(
        "nvmlDeviceGetMemoryInfo_v2",
        lambda h: pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2),
        handle,
    )
    memory_v1 = m("nvmlDeviceGetMemoryInfo", pynvml.nvmlDeviceGetMemoryInfo, handle)
    total = (memory or memory_v1).total if (memory or memory_v1) is not None else None
    gpu["memory_mib"] = None if total is None else int(total) // (1024 * 1024)
    gpu["numa_node"] = m("nvmlDeviceGetNumaNodeId", pynvml.nvmlDeviceGetNumaNodeId, handle)
    gpu["architecture"] = m("nvmlDeviceGetArchitecture", pynvml.nvmlDeviceGetArchitecture, handle)
    gpu["compute_capability"] = jsonable(
        m("nvmlDeviceGetCudaComputeCapability", pynvml.nvmlDeviceGetCudaComputeCapability, handle)
    )
    m("nvmlDeviceGetPerformanceState", pynvml.nvmlDeviceGetPerformanceState, handle)
    m("nvmlDeviceGetTemperature", pynvml.nvmlDeviceGetTemperature, handle, 0)
    m("nvmlDeviceGetPowerUsage", pynvml.nvmlDeviceGetPowerUsage, handle)
    m("nvmlDeviceGetTotalEnergyConsumption", pynvml.nvmlDeviceGetTotalEnergyConsumption, handle)
    m("nvmlDeviceGetClockInfo", pynvml.nvmlDeviceGetClockInfo, handle, pynvml.NVML_CLOCK_SM)
    m("nvmlDeviceGetClockInfo", pynvml.nvmlDeviceGetClockInfo, handle, pynvml.NVML_CLOCK_MEM)
    m("nvmlDeviceGetUtilizationRates", pynvml.nvmlDeviceGetUtilizationRates, handle)
    m("nvmlDeviceGetEncoderUtilization", pynvml.nvmlDeviceGetEncoderUtilization, handle)
    m("nvmlDeviceGetDecoderUtilization", pynvml.nvmlDeviceGetDecoderUtilization, handle)
    m("nvmlDeviceGetRemappedRows", pynvml.nvmlDeviceGetRemappedRows, handle)
    # The calls the agent falls back on where a field value is not offered.
    m("nvmlDeviceGetPcieReplayCounter", pynvml.nvmlDeviceGetPcieReplayCounter, handle)
    for kind in (
        pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED,
        pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
    ):
        m("nvmlDeviceGetTotalEccErrors", pynvml.nvmlDeviceGetTotalEccErrors, handle, kind,
          pynvml.NVML_VOLATILE_ECC)  # fmt: skip
    for policy in (pynvml.NVML_PERF_POLICY_POWER, pynvml.NVML_PERF_POLICY_THERMAL):
        m("nvmlDeviceGetViolationStatus", pynvml.nvmlDeviceGetViolationStatus, handle, policy)
    # Per-process readings (the agent's gpu/processes.py): the detail list, else the three lists.
    m(
        "nvmlDeviceGetRunningProcessDetailList",
        pynvml.nvmlDeviceGetRunningProcessDetailList,
        handle,
        pynvml.nvmlProcessDetailList_v1,
        pynvml.NVML_PROCESS_MODE_ALL,
    )
    for name in (
        "nvmlDeviceGetComputeRunningProcesses_v3",
        "nvmlDeviceGetGraphicsRunningProcesses_v3",
        "nvmlDeviceGetMPSComputeRunningProcesses_v3",
    ):
        m(name, getattr(pynvml, name), handle)
    m("nvmlDeviceGetProcessesUtilizationInfo", pynvml.nvmlDeviceGetProcessesUtilizationInfo,
      handle, 0)  # fmt: skip
    m("nvmlDeviceGetProcessUtilization", pynvml.nvmlDeviceGetProcessUtilization, handle, 0)
    gpu["fields"] = capture_fields(rec, calls, handle)
    gpu["field_costs"] = capture_field_costs(rec, handle)
    gpu["gpm"] = capture_gpm(rec, calls, handle)
    gpu["nvlinks"] = capture_nvlinks(m, handle)
    gpu["events"] = {
        "supported": m(
            "nvmlDeviceGetSupportedEventTypes", pynvml.nvmlDeviceGetSupportedEventTypes, handle
        )
    }
    return gpu, handle


def capture_field_costs(rec: Recorder, handle: Any) -> list[Json]:
    """The warm latency of a field-values call for each of :data:`COSTED_FIELDS` alone."""
    costs = []
    throughput = (
        pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX,
        pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX,
    )
    for field in COSTED_FIELDS:
        scope = ALL_LINKS if field in throughput else 0
        record, slots = rec.measure(
            "nvmlDeviceGetFieldValues", pynvml.nvmlDeviceGetFieldValues, handle, [(field, scope)]
        )
        slot = int(slots[0].nvmlReturn) if slots else None
        costs.append({"field": field, "return": record["return"], "slot_return": slot,
                      "cold_ms": record["cold_ms"], "warm_ms": record["warm_ms"]})  # fmt: skip
    return costs


def capture_fields(rec: Recorder, calls: list[Json], handle: Any) -> list[Json]:
    record, slots = rec.measure(
        "nvmlDeviceGetFieldValues", pynvml.nvmlDeviceGetFieldValues, handle, FIELDS,
        shown=[list(f) for f in FIELDS],
    )  # fmt: skip
    record["value"] = None
    calls.append(record)
    if slots is None:
        return []
    return [
        {
            "field": int(slot.fieldId),
            "scope": int(slot.scopeId),
            "return": int(slot.nvmlReturn),
            "value": jsonable(getattr(slot.value, "ullVal", None))
            if slot.nvmlReturn == pynvml.NVML_SUCCESS
            else None,
        }
        for slot in slots
    ]


def capture_gpm(rec: Recorder, calls: list[Json], handle: Any) -> Json:
    record, support = rec.measure(
        "nvmlGpmQueryDeviceSupport", pynvml.nvmlGpmQueryDeviceSupport, handle
    )
    calls.append(record)
    if support is None or not support.isSupportedDevice:
        return {"supported": False}
    pairs = []
    for apart_ms in (0, 50, 120, 1000):
        samples = [pynvml.nvmlGpmSampleAlloc(), pynvml.nvmlGpmSampleAlloc()]
        try:
            first = attempt(pynvml.nvmlGpmSampleGet, handle, samples[0])
            time.sleep(apart_ms / 1000)
            second = attempt(pynvml.nvmlGpmSampleGet, handle, samples[1])
            request = pynvml.c_nvmlGpmMetricsGet_t()
            request.version = pynvml.NVML_GPM_METRICS_GET_VERSION
            request.numMetrics = len(GPM_METRICS)
            request.sample1, request.sample2 = samples
            for i, metric in enumerate(GPM_METRICS):
                request.metrics[i].metricId = metric
            code, _, ms = attempt(pynvml.nvmlGpmMetricsGet, request)
            pairs.append(
                {
                    "apart_ms": apart_ms,
                    "sample_returns": [first[0], second[0]],
                    "sample_ms": [round(first[2], 4), round(second[2], 4)],
                    "return": code,
                    "ms": round(ms, 4),
                    "metrics": [
                        {
                            "metric": metric,
                            "return": int(request.metrics[i].nvmlReturn),
                            "value": float(request.metrics[i].value),
                        }
                        for i, metric in enumerate(GPM_METRICS)
                    ]
                    if code == pynvml.NVML_SUCCESS
                    else [],
                }
            )
            calls.append({"call": "nvmlGpmSampleGet", "args": [], "return": first[0],
                          "error": None, "value": None, "cold_ms": round(first[2], 4),
                          "warm_ms": round(second[2], 4)})  # fmt: skip
        finally:
            for sample in samples:
                pynvml.nvmlGpmSampleFree(sample)
    return {"supported": True, "pairs": pairs}


def capture_nvlinks(m: Callable[..., Any], handle: Any) -> list[Json]:
    links = []
    for link in range(MAX_LINKS):
        code, state, _ = attempt(pynvml.nvmlDeviceGetNvLinkState, handle, link)
        if code != pynvml.NVML_SUCCESS:
            links.append({"link": link, "return": code})
            break
        entry: dict[str, Any] = {"link": link, "return": code, "state": int(state)}
        if state == pynvml.NVML_FEATURE_ENABLED:
            remote = m(
                "nvmlDeviceGetNvLinkRemotePciInfo", pynvml.nvmlDeviceGetNvLinkRemotePciInfo,
                handle, link,
            )  # fmt: skip
            entry["remote_bus_id"] = None if remote is None else jsonable(remote.busId)
            entry["remote_type"] = m(
                "nvmlDeviceGetNvLinkRemoteDeviceType",
                pynvml.nvmlDeviceGetNvLinkRemoteDeviceType, handle, link,
            )  # fmt: skip
        links.append(entry)
    return links


def capture_events(rec: Recorder, handles: dict[int, Any]) -> Json:
    code, event_set, ms = attempt(pynvml.nvmlEventSetCreate)
    result: dict[str, Any] = {"create": {"return": code, "ms": round(ms, 4)}, "register": {}}
    if code != pynvml.NVML_SUCCESS:
        return result
    try:
        for index, handle in handles.items():
            supported = pynvml.nvmlDeviceGetSupportedEventTypes(handle)
            code, _, ms = attempt(
                pynvml.nvmlDeviceRegisterEvents, handle, HEALTH_EVENTS & supported, event_set
            )
            result["register"][str(index)] = {"return": code, "ms": round(ms, 4)}
        waits = []
        for timeout_ms in (0, 100, 100, 100):
            code, data, ms = attempt(pynvml.nvmlEventSetWait_v2, event_set, timeout_ms)
            waits.append(
                {
                    "timeout_ms": timeout_ms,
                    "return": code,
                    "ms": round(ms, 4),
                    "event": jsonable(data.eventType) if data is not None else None,
                }
            )
        result["waits"] = waits
    finally:
        pynvml.nvmlEventSetFree(event_set)
    return result


def capture_mig(handles: dict[int, Any]) -> Json:
    """``{"gpus": {index: …}}``: MIG mode and devices, and whether aggregate memory reads."""
    gpus = {}
    for index, handle in handles.items():
        entry: dict[str, Any] = {}
        code, mode, _ = attempt(pynvml.nvmlDeviceGetMigMode, handle)
        entry["mode_return"], entry["mode"] = code, jsonable(mode)
        entry["memory_return"] = attempt(pynvml.nvmlDeviceGetMemoryInfo, handle)[0]
        if code == pynvml.NVML_SUCCESS and mode and mode[0] == pynvml.NVML_DEVICE_MIG_ENABLE:
            entry["devices"] = mig_devices(handle)
            entry["profiles"] = mig_profiles(handle)
        gpus[str(index)] = entry
    return {"gpus": gpus}


def mig_profiles(handle: Any) -> list[Json]:
    """Every GPU-instance profile the GPU answers for (versioned call, as the agent makes it)."""
    found = []
    for profile in range(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
        code, info, _ = attempt(pynvml.nvmlDeviceGetGpuInstanceProfileInfo, handle, profile, 2)
        entry: dict[str, Any] = {"profile": profile, "return": code}
        if info is not None:
            entry.update(id=int(info.id), slices=int(info.sliceCount),
                         memory_mib=int(info.memorySizeMB))  # fmt: skip
        found.append(entry)
    return found


def mig_devices(handle: Any) -> list[Json]:
    devices = []
    code, count, _ = attempt(pynvml.nvmlDeviceGetMaxMigDeviceCount, handle)
    for i in range(count if code == pynvml.NVML_SUCCESS else 0):
        code, mig, _ = attempt(pynvml.nvmlDeviceGetMigDeviceHandleByIndex, handle, i)
        if code != pynvml.NVML_SUCCESS:
            continue
        device: dict[str, Any] = {"uuid": jsonable(attempt(pynvml.nvmlDeviceGetUUID, mig)[1])}
        device["gpu_instance"] = attempt(pynvml.nvmlDeviceGetGpuInstanceId, mig)[1]
        device["compute_instance"] = attempt(pynvml.nvmlDeviceGetComputeInstanceId, mig)[1]
        code, attrs, _ = attempt(pynvml.nvmlDeviceGetAttributes_v2, mig)
        device["attributes_return"] = code
        if attrs is not None:
            device["gpu_slices"] = int(attrs.gpuInstanceSliceCount)
            device["compute_slices"] = int(attrs.computeInstanceSliceCount)
            device["memory_mib"] = int(attrs.memorySizeMB)
        code, _memory, _ = attempt(
            lambda h: pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2), mig
        )
        device["memory_return"] = code
        device["gpm_pair"] = mig_gpm_pair(handle, device["gpu_instance"])
        code, instance, _ = attempt(
            pynvml.nvmlDeviceGetGpuInstanceById, handle, device["gpu_instance"]
        )
        device["gpu_instance_return"] = code
        if instance is not None:
            code, info, _ = attempt(pynvml.nvmlGpuInstanceGetInfo, instance)
            device["gpu_instance_profile_id"] = None if info is None else int(info.profileId)
        devices.append(device)
    return devices


def mig_gpm_pair(handle: Any, gpu_instance: int) -> Json:
    """Two GPM samples of one GPU instance 120 ms apart (``nvmlGpmMigSampleGet``), and the
    metrics between them."""
    samples = [pynvml.nvmlGpmSampleAlloc(), pynvml.nvmlGpmSampleAlloc()]
    try:
        first = attempt(pynvml.nvmlGpmMigSampleGet, handle, gpu_instance, samples[0])
        time.sleep(0.12)
        second = attempt(pynvml.nvmlGpmMigSampleGet, handle, gpu_instance, samples[1])
        request = pynvml.c_nvmlGpmMetricsGet_t()
        request.version = pynvml.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = len(GPM_METRICS)
        request.sample1, request.sample2 = samples
        for i, metric in enumerate(GPM_METRICS):
            request.metrics[i].metricId = metric
        code, _, _ = attempt(pynvml.nvmlGpmMetricsGet, request)
        return {
            "sample_returns": [first[0], second[0]],
            "sample_ms": [round(first[2], 4), round(second[2], 4)],
            "return": code,
        }
    finally:
        for sample in samples:
            pynvml.nvmlGpmSampleFree(sample)


def drop_cap_sys_admin() -> str | None:
    """Clear CAP_SYS_ADMIN from this process's capability sets; the reason when it cannot."""

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                    ("inheritable", ctypes.c_uint32)]  # fmt: skip

    libc = ctypes.CDLL(None, use_errno=True)
    header = Header(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3
    data = (Data * 2)()
    if libc.capget(ctypes.byref(header), data) != 0:
        return f"capget failed: errno {ctypes.get_errno()}"
    if not data[0].effective & (1 << CAP_SYS_ADMIN):
        return "CAP_SYS_ADMIN was not held"
    for name in ("effective", "permitted", "inheritable"):
        setattr(data[0], name, getattr(data[0], name) & ~(1 << CAP_SYS_ADMIN))
    if libc.capset(ctypes.byref(header), data) != 0:
        return f"capset failed: errno {ctypes.get_errno()}"
    return None


def mig_without_cap_sys_admin(args: argparse.Namespace) -> Json:
    """The MIG section again, from a child process that dropped CAP_SYS_ADMIN before nvmlInit."""
    if args.simulate or args.sim_config:
        return {}  # filled in afterwards, from a simulated node without the capability
    if os.geteuid() != 0:
        return {"unavailable": "not run as root"}
    child = subprocess.run(
        [sys.executable, __file__, "--mig-child"], capture_output=True, text=True, check=False
    )
    if child.returncode != 0:
        return {"unavailable": f"child failed: {child.stderr.strip()[-500:]}"}
    result: Json = json.loads(child.stdout)
    return result


def mig_child() -> int:
    reason = drop_cap_sys_admin()
    if reason is not None:
        print(json.dumps({"unavailable": reason}))
        return 0
    pynvml.nvmlInit()
    try:
        handles = {
            i: pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())
        }
        print(json.dumps(capture_mig(handles)))
    finally:
        pynvml.nvmlShutdown()
    return 0


def use_simulator(args: argparse.Namespace, cap_sys_admin: bool | None = None) -> Any:
    """Install gpuagent's simulated driver below pynvml (imports gpuagent from this checkout)."""
    sys.path.insert(0, str(ROOT))
    from gpuagent.gpu import sim  # noqa: PLC0415 (only a simulated capture needs gpuagent)

    if args.simulate:
        node = sim.node_from_count(args.simulate)
    else:
        node = sim.load_sim_config(Path(args.sim_config))
    if cap_sys_admin is not None:
        node = replace(node, cap_sys_admin=cap_sys_admin)
    driver = sim.SimDriver(node)
    sim.install(driver)
    return driver


def capture(args: argparse.Namespace) -> Json:
    simulated = bool(args.simulate or args.sim_config)
    driver = use_simulator(args) if simulated else None
    rec = Recorder(args.repeat)
    code, _, init_ms = attempt(pynvml.nvmlInit)
    if code != pynvml.NVML_SUCCESS:
        raise SystemExit(f"nvml-capture: nvmlInit failed: {pynvml.NVMLError(code)}")
    system: list[Json] = [{"call": "nvmlInit", "args": [], "return": code, "error": None,
                           "value": None, "cold_ms": round(init_ms, 4),
                           "warm_ms": round(init_ms, 4)}]  # fmt: skip
    started = time.monotonic()
    try:
        values, gpus, handles = capture_node(rec, system)
        topology = [
            {"a": a, "b": b, "common_ancestor": attempt(
                pynvml.nvmlDeviceGetTopologyCommonAncestor, handles[a], handles[b])[1]}
            for a in handles for b in handles if a < b
        ]  # fmt: skip
        events = capture_events(rec, handles)
        mig = capture_mig(handles)
    finally:
        pynvml.nvmlShutdown()
    sysfs = driver.sys_root if driver is not None else Path("/sys")
    result: dict[str, Any] = {
        "format": FORMAT,
        "taken": datetime.now(UTC).isoformat(timespec="seconds"),
        "source": "simulator" if simulated else "hardware",
        "host": {
            "machine": platform.machine(),
            "python": platform.python_version(),
            "pynvml": getattr(pynvml, "__version__", ""),
            "dmi_product_name": host_facts(sysfs, gpus),
        },
        "driver": {
            "version": jsonable(values["nvmlSystemGetDriverVersion"]),
            "cuda_version": values["nvmlSystemGetCudaDriverVersion"],
            "nvml_version": jsonable(values["nvmlSystemGetNVMLVersion"]),
        },
        "system": {"calls": system},
        "gpus": gpus,
        "topology": topology,
        "events": events,
        "mig": {
            "with_cap_sys_admin": mig,
            "without_cap_sys_admin": mig_without_cap_sys_admin(args),
        },
        "seconds": round(time.monotonic() - started, 3),
    }
    if driver is not None:
        result["simulator_symbols"] = sorted(driver.calls)
        result["mig"]["without_cap_sys_admin"] = simulated_mig_without_cap(args, list(handles))
    for gpu in result["gpus"]:
        mig = result["mig"]["with_cap_sys_admin"]["gpus"].get(str(gpu["index"]), {})
        gpu["mig"] = mig_summary(mig)
    return result


def capture_node(rec: Recorder, system: list[Json]) -> tuple[Json, list[Json], dict[int, Any]]:
    """The system calls (appended to ``system``), then every GPU: ``(values, gpus, handles)``."""
    values = {}
    for name, fn in (
        ("nvmlSystemGetDriverVersion", pynvml.nvmlSystemGetDriverVersion),
        ("nvmlSystemGetCudaDriverVersion", pynvml.nvmlSystemGetCudaDriverVersion),
        ("nvmlSystemGetNVMLVersion", pynvml.nvmlSystemGetNVMLVersion),
        ("nvmlDeviceGetCount", pynvml.nvmlDeviceGetCount),
    ):
        record, values[name] = rec.measure(name, fn)
        system.append(record)
    gpus, handles = [], {}
    for index in range(int(values["nvmlDeviceGetCount"] or 0)):
        gpu, handle = capture_gpu(rec, index)
        gpus.append(gpu)
        if handle is not None:
            handles[index] = handle
    return values, gpus, handles


def simulated_mig_without_cap(args: argparse.Namespace, indexes: list[int]) -> Json:
    """The MIG section from the same simulated node without CAP_SYS_ADMIN."""
    from gpuagent.gpu import sim  # noqa: PLC0415 (only a simulated capture needs gpuagent)

    sim.uninstall()
    use_simulator(args, cap_sys_admin=False)
    pynvml.nvmlInit()
    try:
        handles = {i: pynvml.nvmlDeviceGetHandleByIndex(i) for i in indexes}
        refused = capture_mig(handles)
        refused["simulated"] = True
        return refused
    finally:
        pynvml.nvmlShutdown()
        sim.uninstall()


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        return None


def host_facts(sysfs: Path, gpus: list[Json]) -> str | None:
    """What GPU feature discovery and the agent read from ``/sys`` beside NVML: each GPU's PCI
    class (GFD's ``gpu.mode``) and NUMA node (the agent's, where NVML has none) go into its entry
    (``pci_class``, ``sysfs_numa_node``: null when unreadable); returns the DMI product name
    (GFD's ``gpu.machine``; null: no such file, GFD's ``unknown``)."""
    for gpu in gpus:
        bus_id = gpu.get("pci_bus_id")
        if not isinstance(bus_id, str) or ":" not in bus_id:
            continue
        domain, _, rest = bus_id.partition(":")
        device = sysfs / "bus" / "pci" / "devices" / f"{int(domain, 16):04x}:{rest.lower()}"
        gpu["pci_class"] = _read(device / "class")
        numa = _read(device / "numa_node")
        gpu["sysfs_numa_node"] = int(numa) if numa and numa.lstrip("-").isdigit() else None
    return _read(sysfs / "class" / "dmi" / "id" / "product_name")


def anonymise(result: Json) -> int:
    """Replace every GPU and MIG device UUID in ``result`` with a random one (the same new UUID
    wherever an old one appears); returns how many. The UUIDs are the only identifiers of the
    hardware in a capture: it reads no serial number, board part number or host name."""
    text = json.dumps(result)
    found = sorted(set(re.findall(r"(?:GPU|MIG)-[0-9a-fA-F-]{36}", text)))
    for old in found:
        text = text.replace(old, f"{old.split('-', 1)[0]}-{uuid.uuid4()}")
    result.clear()
    result.update(json.loads(text))
    result["anonymised"] = True
    return len(found)


def mig_summary(entry: Json) -> Json:
    """What a simulated node needs of a GPU's MIG layout: its devices' shapes."""
    return {
        "enabled": bool(entry.get("devices")),
        "devices": [
            {
                k: d.get(k)
                for k in (
                    "gpu_slices",
                    "compute_slices",
                    "memory_mib",
                    "gpu_instance",
                    "compute_instance",
                )
            }
            for d in entry.get("devices", [])
        ],
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-o", "--output", type=Path, default=Path("nvml-capture.json"))
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--simulate", type=int, metavar="N", help="gpuagent's simulated driver")
    source.add_argument("--sim-config", metavar="FILE", help="a --sim-config node")
    parser.add_argument("--repeat", type=int, default=5, help="calls per query (default 5)")
    parser.add_argument("--anonymise", action="store_true",
                        help="replace the GPUs' UUIDs with random ones (the only hardware "
                             "identifiers a capture holds)")  # fmt: skip
    parser.add_argument("--mig-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.mig_child:
        return mig_child()
    result = capture(args)
    if args.anonymise:
        print(f"nvml-capture: {anonymise(result)} UUIDs replaced")
    args.output.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    print(f"nvml-capture: {len(result['gpus'])} GPUs, driver {result['driver']['version']}, "
          f"{result['seconds']} s -> {args.output}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
