"""Per-process entry points of the simulated ``libnvidia-ml`` (running processes, utilisation).

As ``nvml.h`` documents them:

* ``nvmlDeviceGet{Compute,Graphics,MPSCompute}RunningProcesses_v3(device, infoCount, infos)``: with
  ``*infoCount`` smaller than the number of processes, INSUFFICIENT_SIZE and ``*infoCount`` set to
  that number (``infos`` may then be NULL); SUCCESS with ``*infoCount`` 0 when there are none.
  ``usedGpuMemory`` in bytes; ``gpuInstanceId``/``computeInstanceId`` 0xFFFFFFFF unless MIG is on.
  On a MIG-enabled GPU's handle every MIG device's processes are listed (the agent is privileged),
  on a MIG device handle only that device's. The compute list holds every compute context: the
  ``compute`` processes and the clients of an MPS server (``mps``; the server itself is a
  ``compute`` process), as a real R580 driver lists them (nvidia-smi's ``M+C``); the graphics
  list the ``graphics`` ones; the MPS list the MPS clients only.
* ``nvmlDeviceGetRunningProcessDetailList(device, plist)``: the same processes for ``plist->mode``
  (compute — MPS clients included — graphics, MPS), same sizing protocol on
  ``numProcArrayEntries``/``procArray``; INVALID_ARGUMENT for a bad version or mode; Hopper and
  newer only (NOT_SUPPORTED before). Mode ALL (3) is a mode only for a driver whose nvml.h has
  it: the headers of CUDA 13.0 to 13.2 name three modes, CUDA 13.3's a fourth, and a real
  580.159 driver (CUDA 13.0) answers mode ALL with INVALID_ARGUMENT. So the simulated driver
  accepts it from :data:`PROCESS_MODE_ALL_CUDA` on (``cuda_driver_version`` of the node).
* ``nvmlDeviceGetProcessUtilization(device, utilization, processSamplesCount, lastSeenTimeStamp)``
  and ``nvmlDeviceGetProcessesUtilizationInfo(device, procesesUtilInfo)``: one sample per process
  with non-zero utilisation, newer than ``lastSeenTimeStamp``; NOT_FOUND when there is none;
  INSUFFICIENT_SIZE with the count when the buffer is NULL or too small; NOT_SUPPORTED on MIG
  ("querying process utilization is not currently supported"); ARGUMENT_VERSION_MISMATCH for a
  wrong ``version`` of the second. nvml.h's return list for the first also says INVALID_ARGUMENT
  for a NULL ``utilization`` while its text asks callers to size the buffer with exactly that call
  (and pynvml does): the sizing protocol of the text is followed.
* ``nvmlSystemGetProcessName(pid, name, length)``: the process's name; NOT_FOUND for a pid with no
  context on any GPU; INSUFFICIENT_SIZE for a buffer too short.
* ``nvmlDeviceGetComputeMode(device, mode)`` / ``nvmlDeviceSetComputeMode(device, mode)``:
  DEFAULT until set; INVALID_ARGUMENT for a mode nvml.h does not define; NOT_SUPPORTED on a MIG
  device's handle, and for any mode but DEFAULT on a MIG-enabled GPU (a real driver: "Setting
  compute mode to EXCLUSIVE_PROCESS is not supported on a MIG-enabled device"). The mode admits
  processes as :mod:`gpuagent.gpu.sim.processes` says.
"""

from __future__ import annotations

import ctypes
from typing import Any

import pynvml

from gpuagent.gpu.sim._abi import BadArgument, Symbol, as_int, device, out, write_str
from gpuagent.gpu.sim.processes import SimProcess, sample_time_us
from gpuagent.gpu.sim.profiles import NVML_DEVICE_ARCH_HOPPER
from gpuagent.gpu.sim.state import DriverState, GpuState

SUCCESS = int(pynvml.NVML_SUCCESS)
INVALID_ARGUMENT = int(pynvml.NVML_ERROR_INVALID_ARGUMENT)
NOT_SUPPORTED = int(pynvml.NVML_ERROR_NOT_SUPPORTED)
NOT_FOUND = int(pynvml.NVML_ERROR_NOT_FOUND)
INSUFFICIENT_SIZE = int(pynvml.NVML_ERROR_INSUFFICIENT_SIZE)
VERSION_MISMATCH = int(pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
NO_INSTANCE = 0xFFFF_FFFF
PROCESS_DETAIL_LIST_V1 = int(pynvml.nvmlProcessDetailList_v1)
PROCESSES_UTILIZATION_INFO_V1 = int(pynvml.ProcessesUtilizationInfo_v1)
#: The kinds of process in each list: a compute context is a plain one or an MPS client's.
COMPUTE_KINDS = frozenset({"compute", "mps"})
ALL_KINDS = frozenset({"compute", "graphics", "mps"})
MODE_ALL = int(pynvml.NVML_PROCESS_MODE_ALL)
#: nvmlProcessMode_t -> the kinds of process it lists.
MODES: dict[int, frozenset[str]] = {
    int(pynvml.NVML_PROCESS_MODE_COMPUTE): COMPUTE_KINDS,
    int(pynvml.NVML_PROCESS_MODE_GRAPHICS): frozenset({"graphics"}),
    int(pynvml.NVML_PROCESS_MODE_MPS): frozenset({"mps"}),
    MODE_ALL: ALL_KINDS,
}
DEFAULT_COMPUTE_MODE = int(pynvml.NVML_COMPUTEMODE_DEFAULT)
#: nvmlComputeMode_t -> its name in ``GET /sim/gpus``.
COMPUTE_MODES = {
    DEFAULT_COMPUTE_MODE: "default",
    int(pynvml.NVML_COMPUTEMODE_EXCLUSIVE_THREAD): "exclusive_thread",
    int(pynvml.NVML_COMPUTEMODE_PROHIBITED): "prohibited",
    int(pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS): "exclusive_process",
}
#: The first CUDA driver version (``nvmlSystemGetCudaDriverVersion``) whose nvml.h has mode ALL.
PROCESS_MODE_ALL_CUDA = 13030


def _listed(st: DriverState, gpu: GpuState, kinds: frozenset[str]) -> list[SimProcess]:
    return sorted((p for p in st.processes.on(gpu) if p.kind in kinds), key=lambda p: p.pid)


def _fill_info(info: Any, process: SimProcess) -> None:
    info.pid = process.pid
    info.usedGpuMemory = process.memory_bytes
    on_mig = process.gpu_instance is not None
    info.gpuInstanceId = process.gpu_instance if on_mig else NO_INSTANCE
    info.computeInstanceId = process.compute_instance if on_mig else NO_INSTANCE


def _running(kinds: frozenset[str]) -> Any:
    def running(st: DriverState, gpu: GpuState, count_ref: object, infos: object) -> int:
        count = out(count_ref)
        processes = _listed(st, gpu, kinds)
        if not processes:
            count.value = 0
            return SUCCESS
        if count.value < len(processes):
            count.value = len(processes)
            return INSUFFICIENT_SIZE
        slots = _array(infos, len(processes))
        for slot, process in zip(slots, processes, strict=False):
            _fill_info(slot, process)
        count.value = len(processes)
        return SUCCESS

    return running


def _detail_list(st: DriverState, gpu: GpuState, ref: object) -> int:
    plist = out(ref)
    mode = int(plist.mode)
    if int(plist.version) != PROCESS_DETAIL_LIST_V1 or mode not in MODES:
        return INVALID_ARGUMENT
    if mode == MODE_ALL and st.node.cuda_driver_version < PROCESS_MODE_ALL_CUDA:
        return INVALID_ARGUMENT  # not a mode this driver knows
    if gpu.spec.architecture < NVML_DEVICE_ARCH_HOPPER:
        return NOT_SUPPORTED
    processes = _listed(st, gpu, MODES[mode])
    if not processes:
        plist.numProcArrayEntries = 0
        return SUCCESS
    if plist.numProcArrayEntries < len(processes):
        plist.numProcArrayEntries = len(processes)
        return INSUFFICIENT_SIZE
    if not plist.procArray:
        return INVALID_ARGUMENT
    for i, process in enumerate(processes):
        slot = plist.procArray[i]
        _fill_info(slot, process)
        slot.usedGpuCcProtectedMemory = 0
    plist.numProcArrayEntries = len(processes)
    return SUCCESS


def _samples(st: DriverState, gpu: GpuState, last_seen: int) -> tuple[int, list[SimProcess]]:
    """The latest sample's time stamp and the processes it holds (newer than ``last_seen``)."""
    stamp = sample_time_us(st.clock())
    if stamp <= last_seen:
        return stamp, []
    return stamp, [p for p in _listed(st, gpu, ALL_KINDS) if p.sm_util > 0]


def _fill_sample(slot: Any, process: SimProcess, stamp: int) -> None:
    slot.pid = process.pid
    slot.timeStamp = stamp
    slot.smUtil = round(process.sm_util)
    slot.memUtil = round(process.mem_util)
    slot.encUtil = 0
    slot.decUtil = 0


def _process_utilization(
    st: DriverState, gpu: GpuState, buffer: object, count_ref: object, last_seen: object
) -> int:
    count = out(count_ref)
    if gpu.mig is not None or gpu.mig_enabled:
        return NOT_SUPPORTED
    stamp, processes = _samples(st, gpu, as_int(last_seen))
    if not processes:
        return NOT_FOUND
    if buffer is None or count.value < len(processes):
        count.value = len(processes)
        return INSUFFICIENT_SIZE
    for slot, process in zip(_array(buffer, len(processes)), processes, strict=False):
        _fill_sample(slot, process, stamp)
    count.value = len(processes)
    return SUCCESS


def _processes_utilization_info(st: DriverState, gpu: GpuState, ref: object) -> int:
    info = out(ref)
    if int(info.version) != PROCESSES_UTILIZATION_INFO_V1:
        return VERSION_MISMATCH
    if gpu.mig is not None or gpu.mig_enabled:
        return NOT_SUPPORTED
    stamp, processes = _samples(st, gpu, int(info.lastSeenTimeStamp))
    if not processes:
        return NOT_FOUND
    if not info.procUtilArray or info.processSamplesCount < len(processes):
        info.processSamplesCount = len(processes)
        return INSUFFICIENT_SIZE
    for i, process in enumerate(processes):
        slot = info.procUtilArray[i]
        _fill_sample(slot, process, stamp)
        slot.jpgUtil = 0
        slot.ofaUtil = 0
    info.processSamplesCount = len(processes)
    return SUCCESS


def _array(buffer: object, needed: int) -> ctypes.Array[Any]:
    """A caller's struct array (a ctypes array passed by value) with room for ``needed``."""
    if not isinstance(buffer, ctypes.Array):
        raise BadArgument(f"expected an array, got {type(buffer).__name__}")
    if len(buffer) < needed:
        # C would write past the caller's buffer; a correct caller never gets here.
        raise BadArgument(f"array of {len(buffer)} for {needed} entries")
    return buffer


def _process_name(st: DriverState, pid: object, buffer: object, length: object) -> int:
    wanted = as_int(pid)
    for process in st.processes.all():
        if process.pid == wanted:
            return write_str(buffer, length, process.name)
    return NOT_FOUND


def _compute_mode(st: DriverState, gpu: GpuState, ref: object) -> int:
    if gpu.mig is not None:
        return NOT_SUPPORTED
    out(ref).value = gpu.compute_mode
    return SUCCESS


def _set_compute_mode(st: DriverState, gpu: GpuState, mode: object) -> int:
    value = as_int(mode)
    if not 0 <= value < int(pynvml.NVML_COMPUTEMODE_COUNT):
        return INVALID_ARGUMENT
    if gpu.mig is not None or (gpu.mig_enabled and value != DEFAULT_COMPUTE_MODE):
        return NOT_SUPPORTED
    gpu.compute_mode = value
    return SUCCESS


SYMBOLS: dict[str, Symbol] = {
    "nvmlSystemGetProcessName": Symbol(_process_name),
    "nvmlDeviceGetComputeMode": device(_compute_mode),
    "nvmlDeviceSetComputeMode": device(_set_compute_mode),
    "nvmlDeviceGetComputeRunningProcesses_v3": device(_running(COMPUTE_KINDS)),
    "nvmlDeviceGetGraphicsRunningProcesses_v3": device(
        _running(MODES[int(pynvml.NVML_PROCESS_MODE_GRAPHICS)])
    ),
    "nvmlDeviceGetMPSComputeRunningProcesses_v3": device(
        _running(MODES[int(pynvml.NVML_PROCESS_MODE_MPS)])
    ),
    "nvmlDeviceGetRunningProcessDetailList": device(_detail_list),
    "nvmlDeviceGetProcessUtilization": device(_process_utilization),
    "nvmlDeviceGetProcessesUtilizationInfo": device(_processes_utilization_info),
}
