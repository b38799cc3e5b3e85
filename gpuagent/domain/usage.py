"""Who uses a GPU: per-process readings from the driver, and per-container usage derived from them.

:class:`ProcessReading` is what the NVML adapter reads for one GPU per poll; :class:`Usage` is what
:mod:`gpuagent.domain.accounting` makes of every GPU's reading once processes are joined to their
containers. Plain values, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "ContainerUsage",
    "GpuProcess",
    "ProcessReading",
    "ProcessSample",
    "Usage",
]


@dataclass(frozen=True, slots=True)
class GpuProcess:
    """A process with a context on a GPU (``nvmlProcessInfo_t``).

    ``used_memory_bytes`` is ``None`` where the driver does not say (``NVML_VALUE_NOT_AVAILABLE``).
    On a MIG-enabled GPU ``gpu_instance`` and ``compute_instance`` name the MIG device the process
    runs on; elsewhere they are ``None``. ``mps_server``: an MPS server (``nvidia-cuda-mps-server``,
    which NVML lists among compute processes beside its clients): no container's work.
    """

    pid: int
    used_memory_bytes: int | None
    gpu_instance: int | None = None
    compute_instance: int | None = None
    mps_server: bool = False


@dataclass(frozen=True, slots=True)
class ProcessSample:
    """A process's utilisation of one GPU over the last interval, in percent (0-100)."""

    pid: int
    sm_pct: float
    mem_pct: float = 0.0
    enc_pct: float = 0.0
    dec_pct: float = 0.0


@dataclass(frozen=True, slots=True)
class ProcessReading:
    """One poll's per-process readings of one GPU.

    ``samples`` is ``None`` where the driver offers no per-process utilisation (every MIG-enabled
    GPU: NVML does not support it there; older GPUs and drivers); ``()`` means it does and no
    process used the GPU since the previous poll.
    """

    processes: tuple[GpuProcess, ...] = ()
    samples: tuple[ProcessSample, ...] | None = None


@dataclass(frozen=True, slots=True)
class ContainerUsage:
    """One container's use of one GPU, or of one MIG GPU instance (``gpu_instance``).

    Empty ``namespace``, ``pod`` and ``container`` stand for processes whose container is not
    known (a host process, a container the runtime does not list); they are kept, never dropped.
    Ratios are 0-1 shares of the last poll interval and ``None`` where the driver offers no
    per-process utilisation; ``energy_joules`` is the container's share of the GPU's energy since
    the agent first saw the container on the GPU (see docs/metrics.md for the method).
    ``allocated``: the kubelet allocated this GPU (instance) to the container.
    """

    gpu: int
    gpu_instance: int | None
    namespace: str
    pod: str
    container: str
    processes: int
    memory_bytes: int | None
    sm_ratio: float | None = None
    mem_ratio: float | None = None
    enc_ratio: float | None = None
    dec_ratio: float | None = None
    energy_joules: float | None = None
    allocated: bool = False

    @property
    def known(self) -> bool:
        return bool(self.pod)

    @property
    def unallocated(self) -> bool:
        """A known container runs work on a GPU the kubelet did not allocate to it."""
        return self.known and self.processes > 0 and not self.allocated


@dataclass(frozen=True, slots=True)
class Usage:
    """Per-container usage of every GPU, sorted by GPU, instance, namespace, pod, container.

    ``judged``: the kubelet's allocations are known (pod-resources answered), so unallocated use
    can be told; without them nothing is reported as unallocated. ``pod_uids``: (namespace, pod,
    UID) of the pods whose GPU processes' cgroups name their UID, sorted (pod-resources gives no
    UIDs; an event about a pod carries it where known, see :mod:`gpuagent.domain.nodehealth`).
    """

    containers: tuple[ContainerUsage, ...] = ()
    judged: bool = False
    pod_uids: tuple[tuple[str, str, str], ...] = ()
