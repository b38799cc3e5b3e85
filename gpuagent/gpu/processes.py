"""Per-process readings of one GPU through NVML: who runs on it, with how much memory and SM time.

Per GPU and poll, on a driver that offers everything, this makes two NVML functions' calls while
processes run, one while none does:

* ``nvmlDeviceGetRunningProcessDetailList`` with mode ALL (compute, graphics and MPS processes in
  one list, Hopper and newer). Where the driver or GPU does not offer it, the three lists
  ``nvmlDeviceGetComputeRunningProcesses_v3``, ``…GraphicsRunningProcesses_v3`` and
  ``…MPSComputeRunningProcesses_v3`` instead (the GPU is switched for good, logged once). A
  process in several lists (compute and graphics contexts) is one process. On a MIG-enabled GPU
  each process carries its GPU and compute instance.
* MPS: NVML lists an MPS server among the compute processes, beside its clients, which the MPS
  list names (read with the three lists; with the detail list, a second detail list in MPS mode
  when several processes share the GPU — a server has a client). The server is no container's
  work: on a GPU that has had MPS clients, a process the MPS list does not name is asked its
  name once (``nvmlSystemGetProcessName``, remembered while the pid stays on the GPU), and
  ``nvidia-cuda-mps-server`` is marked :attr:`~gpuagent.domain.usage.GpuProcess.mps_server`.
  A GPU without MPS clients costs nothing more.
* ``nvmlDeviceGetProcessesUtilizationInfo`` (``nvmlDeviceGetProcessUtilization`` on older drivers)
  for the samples newer than the last one seen on this GPU, in one call (with room for twice the
  samples of the GPU's last read; :func:`utilization_info`): SM, memory, encoder and decoder
  utilisation per process since the previous poll. NOT_FOUND means no process used the GPU in
  that time. NVML does not offer per-process utilisation on MIG-enabled GPUs: there (as on any GPU
  answering NOT_SUPPORTED) the samples are absent (``None``), logged once, and not asked again.
  Asked only while the GPU lists a process (and once at first, to learn whether the GPU offers
  it): a sample names a process, and only listed processes are accounted, so a GPU without one
  has none to give — and the call costs 2.3-2.9 ms even then on a real H200 (it answers
  NOT_FOUND), against 0.01 ms for a list.

Errors: a lost GPU raises ``NVMLError_GpuIsLost`` (the probe reports the GPU lost); any other
error leaves that part of the reading absent for this poll and is logged when it first appears,
so per-process accounting never makes a GPU unhealthy.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Collection, Iterable
from dataclasses import replace
from typing import Any, TypeVar

import pynvml
import structlog

from gpuagent.domain.usage import GpuProcess, ProcessReading, ProcessSample
from gpuagent.gpu.calls import ABSENT, NvmlCalls
from gpuagent.overrides.nvml import nvml_function

log = structlog.get_logger("gpuagent.nvml")
T = TypeVar("T")

NO_INSTANCE = 0xFFFF_FFFF
#: Room for this many utilisation samples at least (each GPU: twice its last read's).
MIN_SAMPLE_ROOM = 64
MPS_SERVER = "nvidia-cuda-mps-server"
_ABSENT = ABSENT
# A driver that knows the detail list but not mode ALL answers INVALID_ARGUMENT.
_NO_DETAIL_LIST = (*_ABSENT, pynvml.NVML_ERROR_INVALID_ARGUMENT)
#: A utilisation read's answer when no process used the GPU since the last sample: not a failure.
_NO_SAMPLE = (pynvml.NVML_ERROR_NOT_FOUND,)
_LISTS: tuple[tuple[str, Callable[[Any], list[Any]]], ...] = (
    ("compute_processes", pynvml.nvmlDeviceGetComputeRunningProcesses_v3),
    ("graphics_processes", pynvml.nvmlDeviceGetGraphicsRunningProcesses_v3),
    ("mps_processes", pynvml.nvmlDeviceGetMPSComputeRunningProcesses_v3),
)


class ProcessReader:
    """Reads :class:`ProcessReading` for GPUs; remembers per GPU what the driver offers and the
    last utilisation sample seen. Safe for concurrent reads of different GPUs."""

    def __init__(self, calls: NvmlCalls) -> None:
        self._calls = calls
        self._lock = threading.Lock()
        self._lists_only: set[int] = set()  # GPUs without the detail list
        self._old_utilization: set[int] = set()  # GPUs with only nvmlDeviceGetProcessUtilization
        self._no_samples: set[int] = set()  # GPUs without per-process utilisation
        self._offered: set[int] = set()  # GPUs known to answer the utilisation read
        self._sample_counts: dict[int, int] = {}  # samples in each GPU's last utilisation read
        self._last_seen: dict[int, int] = {}
        self._errors: dict[tuple[int, str], int] = {}
        self._mps_seen: set[int] = set()  # GPUs that have had MPS clients
        self._servers: dict[int, dict[int, bool]] = {}  # per GPU: pid -> an MPS server?

    def read(self, index: int, handle: Any) -> ProcessReading | None:
        """The GPU's processes and their samples since the last read; ``None`` without a list."""
        processes = self._processes(index, handle)
        if processes is None:
            return None
        if not processes and index in self._offered:
            return ProcessReading(processes=(), samples=())  # no process, so no sample to ask
        return ProcessReading(processes=processes, samples=self._samples(index, handle))

    def _mark_servers(
        self, index: int, processes: tuple[GpuProcess, ...], clients: Collection[int]
    ) -> tuple[GpuProcess, ...]:
        """``processes`` with the MPS servers marked (see the module's doc)."""
        with self._lock:
            if clients:
                self._mps_seen.add(index)
            elif index not in self._mps_seen:
                return processes
            known = self._servers.setdefault(index, {})
            for gone in known.keys() - {p.pid for p in processes}:
                del known[gone]
        marked = []
        for process in processes:
            server = False if process.pid in clients else known.get(process.pid)
            if server is None:
                name = self._calls.reading(index, pynvml.nvmlSystemGetProcessName, process.pid)
                text = name.decode(errors="replace") if isinstance(name, bytes) else name or ""
                server = text.rsplit("/", 1)[-1] == MPS_SERVER
                with self._lock:
                    known[process.pid] = server
            marked.append(replace(process, mps_server=True) if server else process)
        return tuple(marked)

    def _detail_clients(self, index: int, handle: Any, found: list[Any]) -> set[int]:
        """The MPS clients among ``found`` (the detail list's every process): asked only when
        several processes share the GPU (a server has at least one client)."""
        if len(found) < 2:
            return set()
        clients = self._calls.reading(
            index,
            pynvml.nvmlDeviceGetRunningProcessDetailList,
            handle,
            pynvml.nvmlProcessDetailList_v1,
            pynvml.NVML_PROCESS_MODE_MPS,
        )
        return {int(info.pid) for info in clients or ()}

    # ----- processes -------------------------------------------------------------------------
    def _processes(self, index: int, handle: Any) -> tuple[GpuProcess, ...] | None:
        if index not in self._lists_only:
            try:
                found = self._calls.call(
                    index,
                    pynvml.nvmlDeviceGetRunningProcessDetailList,
                    handle,
                    pynvml.nvmlProcessDetailList_v1,
                    pynvml.NVML_PROCESS_MODE_ALL,
                )
            except pynvml.NVMLError as exc:
                if exc.value not in _NO_DETAIL_LIST:
                    self._failed(index, "processes", exc)
                    return None
                with self._lock:
                    self._lists_only.add(index)
                log.info(
                    "no process detail list on this gpu or driver; reading the three lists",
                    gpu=index,
                    error=f"{exc} (NVML {exc.value})",
                )
            else:
                self._recovered(index, "processes")
                mps_clients = self._detail_clients(index, handle, found)
                return self._mark_servers(index, _merged(found), mps_clients)
        lists: list[Any] = []
        clients: set[int] = set()
        offered = False
        for name, fn in _LISTS:
            try:
                found = self._calls.optional(index, fn, handle)
            except pynvml.NVMLError as exc:
                self._failed(index, "processes", exc)
                return None
            if found is not None:
                offered = True
                lists.extend(found)
                if name == "mps_processes":
                    clients.update(int(info.pid) for info in found)
        self._recovered(index, "processes")
        return self._mark_servers(index, _merged(lists), clients) if offered else None

    # ----- utilisation samples ----------------------------------------------------------------
    def _samples(self, index: int, handle: Any) -> tuple[ProcessSample, ...] | None:
        if index in self._no_samples:
            return None
        last_seen = self._last_seen.get(index, 0)
        try:
            raw = self._utilization(index, handle, last_seen)
        except pynvml.NVMLError as exc:
            if exc.value == pynvml.NVML_ERROR_NOT_FOUND:
                self._recovered(index, "process_utilization")
                self._offer(index)
                return ()  # nothing used the GPU since the last sample seen
            if exc.value in _ABSENT:
                with self._lock:
                    self._no_samples.add(index)
                # Logged once: NVML has no per-process utilisation on MIG-enabled GPUs.
                self._calls.absent(index, "nvmlDeviceGetProcessesUtilizationInfo", exc.value)
                return None
            self._failed(index, "process_utilization", exc)
            return None
        self._recovered(index, "process_utilization")
        newest = max((int(s.timeStamp) for s in raw), default=last_seen)
        with self._lock:
            self._last_seen[index] = max(newest, last_seen)
            self._offered.add(index)
        return tuple(
            ProcessSample(
                pid=int(s.pid),
                sm_pct=float(s.smUtil),
                mem_pct=float(s.memUtil),
                enc_pct=float(s.encUtil),
                dec_pct=float(s.decUtil),
            )
            for s in raw
        )

    def _utilization(self, index: int, handle: Any, last_seen: int) -> list[Any]:
        if index not in self._old_utilization:
            room = max(MIN_SAMPLE_ROOM, 2 * self._sample_counts.get(index, 0))
            try:
                found = self._calls.call(
                    index, utilization_info, handle, last_seen, room,
                    name="nvmlDeviceGetProcessesUtilizationInfo", answers=_NO_SAMPLE,
                )  # fmt: skip
            except pynvml.NVMLError as exc:
                if exc.value != pynvml.NVML_ERROR_FUNCTION_NOT_FOUND:
                    raise
                with self._lock:
                    self._old_utilization.add(index)
            else:
                with self._lock:
                    self._sample_counts[index] = len(found)
                return found
        return list(
            self._calls.call(
                index, pynvml.nvmlDeviceGetProcessUtilization, handle, last_seen,
                answers=_NO_SAMPLE,
            )
        )  # fmt: skip

    def _offer(self, index: int) -> None:
        if index not in self._offered:
            with self._lock:
                self._offered.add(index)

    # ----- errors ------------------------------------------------------------------------------
    def _failed(self, index: int, what: str, exc: pynvml.NVMLError) -> None:
        if exc.value == pynvml.NVML_ERROR_GPU_IS_LOST:
            raise exc
        with self._lock:
            changed = self._errors.get((index, what)) != exc.value
            self._errors[(index, what)] = int(exc.value)
        if changed:
            log.warning(
                "per-process reading failed; left out",
                gpu=index,
                value=what,
                error=f"{exc} (NVML {exc.value})",
            )

    def _recovered(self, index: int, what: str) -> None:
        if self._errors:
            with self._lock:
                self._errors.pop((index, what), None)


def utilization_info(handle: Any, last_seen: int, room: int) -> list[Any]:
    """``nvmlDeviceGetProcessesUtilizationInfo``'s samples newer than ``last_seen``, in one call
    when ``room`` samples are enough (pynvml's wrapper always makes two, the first with no room
    to learn how many there are; on a real H200 each takes 2.3 ms); raises :class:`NVMLError`."""
    function = nvml_function("nvmlDeviceGetProcessesUtilizationInfo")
    info = pynvml.c_nvmlProcessesUtilizationInfo_v1_t()
    info.version = pynvml.ProcessesUtilizationInfo_v1
    info.lastSeenTimeStamp = last_seen
    for _ in range(2):
        samples = (pynvml.c_nvmlProcessUtilizationInfo_v1_t * room)()
        info.processSamplesCount = room
        info.procUtilArray = samples
        code = function(handle, ctypes.byref(info))
        if code == pynvml.NVML_SUCCESS:
            return list(samples[: min(room, int(info.processSamplesCount))])
        if code != pynvml.NVML_ERROR_INSUFFICIENT_SIZE:
            raise pynvml.NVMLError(code)
        room = int(info.processSamplesCount)  # the driver says how many there are
    raise pynvml.NVMLError(pynvml.NVML_ERROR_INSUFFICIENT_SIZE)


def _merged(found: Iterable[Any]) -> tuple[GpuProcess, ...]:
    """One :class:`GpuProcess` per (pid, instance), sorted; a process listed twice (compute and
    graphics contexts) keeps the larger memory figure (each is "all memory used by the process")."""
    merged: dict[tuple[int, int | None, int | None], GpuProcess] = {}
    for info in found:
        gi = None if int(info.gpuInstanceId) == NO_INSTANCE else int(info.gpuInstanceId)
        ci = None if int(info.computeInstanceId) == NO_INSTANCE else int(info.computeInstanceId)
        memory = None if info.usedGpuMemory is None else int(info.usedGpuMemory)
        key = (int(info.pid), gi, ci)
        seen = merged.get(key)
        if seen is not None and seen.used_memory_bytes is not None:
            memory = (
                seen.used_memory_bytes if memory is None else max(memory, seen.used_memory_bytes)
            )
        merged[key] = GpuProcess(
            pid=key[0], used_memory_bytes=memory, gpu_instance=gi, compute_instance=ci
        )
    return tuple(merged[k] for k in sorted(merged, key=lambda k: (k[0], k[1] or -1, k[2] or -1)))
