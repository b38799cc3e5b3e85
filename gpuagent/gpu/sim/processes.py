"""Processes on simulated GPUs: what the per-process NVML calls report, set over ``/sim/processes``.

A process has a context on one GPU (a process using two GPUs is added once per GPU) with a fixed
amount of memory and SM utilisation; on a MIG-enabled GPU it runs on one MIG device (GPU instance
and compute instance). While a GPU has processes, its utilisation and used memory are theirs
(utilisation capped at 100 %); a GPU without any keeps its synthetic load.

Utilisation samples: the simulated driver takes one sample every :data:`SAMPLE_PERIOD_US` of the
driver clock; each sample holds one entry per process with non-zero utilisation, time-stamped with
the sample's time (microseconds). A process's memory utilisation is half its SM utilisation.

Compute modes admit contexts as the driver does: in EXCLUSIVE_PROCESS (and EXCLUSIVE_THREAD) a
GPU holds one process's context, in PROHIBITED none; an MPS client (``mps``) runs in its server's
context, which is the one that counts. A start the driver would refuse raises :class:`Refused`,
naming the CUDA error the process would get.

Guarded by the driver's lock (the caller holds ``DriverState.cond``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import pynvml

from gpuagent.gpu.sim.spec import SimGpuSpec, SimMigSpec
from gpuagent.gpu.sim.telemetry import Sample, reserved_mib

__all__ = ["KINDS", "SAMPLE_PERIOD_US", "ProcessTable", "Refused", "SimProcess"]

#: How often the simulated driver samples per-process utilisation (NVML's is about 1/6 s).
SAMPLE_PERIOD_US = 166_667
MAX_PID = 0xFFFF_FFFF
MIB = 1024 * 1024
#: Kinds of GPU context: which of NVML's process lists a process appears in (an MPS client in the
#: compute list and the MPS list, as a real driver lists them).
KINDS = ("compute", "graphics", "mps")
#: What ``nvmlSystemGetProcessName`` answers for a process started without a name.
DEFAULT_NAME = "python3"
_ONE_CONTEXT = (
    int(pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS),
    int(pynvml.NVML_COMPUTEMODE_EXCLUSIVE_THREAD),
)


class Refused(ValueError):
    """The driver refuses what a process asked (``cuda_error``: the error it gets)."""

    def __init__(self, cuda_error: str, message: str) -> None:
        super().__init__(f"{cuda_error}: {message}")
        self.cuda_error = cuda_error


class _Mig(Protocol):
    @property
    def spec(self) -> SimMigSpec: ...


class GpuHandle(Protocol):
    """What the table needs of a GPU (or MIG device) handle's state (``state.GpuState``)."""

    @property
    def spec(self) -> SimGpuSpec: ...
    @property
    def index(self) -> int: ...
    @property
    def mig_enabled(self) -> bool: ...
    @property
    def migs(self) -> Sequence[_Mig]: ...
    @property
    def mig(self) -> _Mig | None: ...
    @property
    def compute_mode(self) -> int: ...


@dataclass(frozen=True)
class SimProcess:
    """One process's context on one GPU (``gpu_instance``/``compute_instance`` on MIG)."""

    gpu: int
    pid: int
    memory_mib: float
    sm_util: float
    gpu_instance: int | None = None
    compute_instance: int | None = None
    kind: str = "compute"
    name: str = DEFAULT_NAME
    # The pid of the MPS server this process is a client of, or is (0: neither).
    mps_server: int = 0

    @property
    def memory_bytes(self) -> int:
        return round(self.memory_mib * MIB)

    @property
    def mem_util(self) -> float:
        return self.sm_util / 2

    def describe(self) -> dict[str, object]:
        return {
            "gpu": self.gpu,
            "pid": self.pid,
            "memory_mib": self.memory_mib,
            "sm_util": self.sm_util,
            "gpu_instance": self.gpu_instance,
            "compute_instance": self.compute_instance,
            "type": self.kind,
            "name": self.name,
        }


class ProcessTable:
    """Every simulated process, by GPU and pid."""

    def __init__(self) -> None:
        self._by_gpu: dict[int, dict[int, SimProcess]] = {}

    def add(self, process: SimProcess) -> None:
        """Add ``process``, replacing the same pid's context on the same GPU."""
        self._by_gpu.setdefault(process.gpu, {})[process.pid] = process

    def remove(self, pid: int) -> list[SimProcess]:
        """End process ``pid`` on every GPU; returns its contexts (empty if it had none)."""
        removed = []
        for processes in self._by_gpu.values():
            gone = processes.pop(pid, None)
            if gone is not None:
                removed.append(gone)
        return removed

    def remove_from(self, gpu: int, pid: int) -> list[SimProcess]:
        """End process ``pid``'s context on GPU ``gpu`` alone; returns it (or nothing)."""
        gone = self._by_gpu.get(gpu, {}).pop(pid, None)
        return [] if gone is None else [gone]

    def on_gpu(self, gpu: int) -> list[SimProcess]:
        """Every process context on GPU ``gpu`` (all its MIG devices')."""
        return list(self._by_gpu.get(gpu, {}).values())

    def all(self) -> list[SimProcess]:
        return [p for gpu in sorted(self._by_gpu) for p in self._by_gpu[gpu].values()]

    def on(self, gpu: GpuHandle) -> list[SimProcess]:
        """Processes on a GPU handle: all of a full GPU's (every MIG device's on a MIG-enabled
        GPU), or only one MIG device's on a MIG device handle."""
        processes = list(self._by_gpu.get(gpu.index, {}).values())
        if gpu.mig is not None:
            gi, ci = gpu.mig.spec.gpu_instance_id, gpu.mig.spec.compute_instance_id
            processes = [p for p in processes if (p.gpu_instance, p.compute_instance) == (gi, ci)]
        return processes

    def memory_used_mib(self, gpu: GpuHandle, gpu_instance: int | None = None) -> float:
        processes = self.on(gpu)
        if gpu_instance is not None:
            processes = [p for p in processes if p.gpu_instance == gpu_instance]
        return sum(p.memory_mib for p in processes)

    def apply(self, gpu: GpuHandle, sample: Sample) -> Sample:
        """``sample`` with the GPU's utilisation and used memory following its processes."""
        processes = self.on(gpu)
        if not processes:
            return sample
        used = sum(p.memory_bytes for p in processes)
        return replace(
            sample,
            gpu_util_pct=round(min(100.0, sum(p.sm_util for p in processes))),
            mem_util_pct=round(min(100.0, sum(p.mem_util for p in processes))),
            fb_used_bytes=min(used, sample.fb_total_bytes - sample.fb_reserved_bytes),
        )


def sample_time_us(clock_s: float) -> int:
    """The time stamp (µs) of the driver's latest utilisation sample at ``clock_s``."""
    now_us = int(clock_s * 1_000_000)
    return now_us - now_us % SAMPLE_PERIOD_US


def new_process(
    gpu: GpuHandle,
    table: ProcessTable,
    *,
    pid: object,
    memory_mib: object,
    sm_util: object,
    gpu_instance: object = None,
    compute_instance: object = None,
    kind: object = "compute",
    name: object = DEFAULT_NAME,
    mps_server: int = 0,
) -> SimProcess:
    """A validated process for ``gpu`` (a full GPU's state); ``ValueError`` says what is wrong,
    :class:`Refused` what the driver refuses."""
    if not isinstance(pid, int) or isinstance(pid, bool) or not 0 < pid <= MAX_PID:
        raise ValueError(f"'pid' must be a whole number from 1 to {MAX_PID}, got {pid!r}")
    memory = _number(memory_mib)
    if memory is None or memory < 0:
        raise ValueError(f"'memory_mib' must be a number >= 0, got {memory_mib!r}")
    util = _number(sm_util)
    if util is None or not 0 <= util <= 100:
        raise ValueError(f"'sm_util' must be a percentage from 0 to 100, got {sm_util!r}")
    if not isinstance(kind, str) or kind not in KINDS:
        raise ValueError(f"'type' must be one of {', '.join(KINDS)}, got {kind!r}")
    if not isinstance(name, str) or not 0 < len(name) <= 255:
        raise ValueError(f"'name' must be a process name of 1 to 255 characters, got {name!r}")
    gi, ci, capacity = _placement(gpu, gpu_instance, compute_instance)
    _admit(gpu, table, pid, kind)
    others = sum(p.memory_mib for p in table.on(gpu) if p.gpu_instance == gi and p.pid != pid)
    if others + memory > capacity:
        where = f"GPU {gpu.index}" + ("" if gi is None else f" instance {gi}")
        raise ValueError(
            f"out of memory: {where} has {capacity - others:g} MiB free for processes, "
            f"{memory:g} MiB asked"
        )
    return SimProcess(
        gpu=gpu.index,
        pid=pid,
        memory_mib=memory,
        sm_util=util,
        gpu_instance=gi,
        compute_instance=ci,
        kind=kind,
        name=name,
        mps_server=mps_server,
    )


def _admit(gpu: GpuHandle, table: ProcessTable, pid: int, kind: str) -> None:
    """Refuse a context the GPU's compute mode does not admit (an MPS client needs none)."""
    mode = gpu.compute_mode
    if kind == "mps":
        return
    if mode == int(pynvml.NVML_COMPUTEMODE_PROHIBITED):
        raise Refused("cudaErrorDevicesUnavailable", f"GPU {gpu.index} is PROHIBITED")
    holders = sorted(p.pid for p in table.on(gpu) if p.kind != "mps" and p.pid != pid)
    if mode in _ONE_CONTEXT and holders:
        raise Refused(
            "cudaErrorDevicesUnavailable",
            f"GPU {gpu.index} is in an exclusive compute mode and process {holders[0]} holds it",
        )


def _placement(
    gpu: GpuHandle, gpu_instance: object, compute_instance: object
) -> tuple[int | None, int | None, float]:
    """GPU and compute instance IDs and the memory (MiB) processes may use there."""
    if not gpu.mig_enabled:
        if gpu_instance is not None or compute_instance is not None:
            raise ValueError(f"GPU {gpu.index} is not in MIG mode: no gpu_instance to run on")
        return None, None, float(gpu.spec.memory_mib - reserved_mib(gpu.spec.memory_mib))
    if not isinstance(gpu_instance, int) or isinstance(gpu_instance, bool):
        ids = sorted(m.spec.gpu_instance_id for m in gpu.migs)
        raise ValueError(  # noqa: TRY004
            f"GPU {gpu.index} is in MIG mode: 'gpu_instance' must be one of {ids}, "
            f"got {gpu_instance!r}"
        )
    mig = next((m for m in gpu.migs if m.spec.gpu_instance_id == gpu_instance), None)
    if mig is None:
        ids = sorted(m.spec.gpu_instance_id for m in gpu.migs)
        raise ValueError(f"GPU {gpu.index} has no GPU instance {gpu_instance} (it has {ids})")
    ci = mig.spec.compute_instance_id
    if compute_instance is not None and compute_instance != ci:
        raise ValueError(
            f"GPU instance {gpu_instance} of GPU {gpu.index} has compute instance {ci} only, "
            f"got {compute_instance!r}"
        )
    memory = mig.spec.memory_mib
    return mig.spec.gpu_instance_id, ci, float(memory - reserved_mib(memory))


def _number(value: object) -> float | None:
    """A finite JSON number as a float, else ``None``."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    number = float(value)
    return number if math.isfinite(number) else None
