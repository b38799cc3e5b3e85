"""The per-container GPU families, rendered from ``Snapshot.usage`` (see domain/accounting.py).

Labels: the GPU's index ``gpu`` (and ``GPU_I_ID`` on MIG), then ``container``, ``namespace``,
``pod`` (empty for processes whose container is not known). The GPU's other labels (UUID, model,
PCI bus, ...) are on ``gpuagent_gpu_info`` once per GPU, not repeated on every container's
series: a query joins them on ``gpu`` (Prometheus' info-metric convention, see
docs/metrics.md).

With ``--dcgm-container-shares`` the dcgm-exporter series of a full GPU are per container
(``--dcgm-series-per-container``) and carry the container's own reading for the values NVML
reports per process (:data:`SHARED_DCGM`); the GPU's physical readings (power, temperature,
clocks, ...) stay whole.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from gpuagent.domain.devices import Gpu
from gpuagent.domain.snapshot import Snapshot
from gpuagent.domain.usage import ContainerUsage
from gpuagent.state.counters import CriStats, LogLinkStats
from gpuagent.web.exposition import (
    Family,
    Single,
    escape_label,
    format_value,
    header,
    label_pairs,
    singles,
)

__all__ = ["SHARED_DCGM", "accounting_families", "render_usage"]

MIB = 1024 * 1024

MEMORY = "gpuagent_container_gpu_memory_used_bytes"
SM = "gpuagent_container_gpu_sm_utilization_ratio"
ENERGY = "gpuagent_container_gpu_energy_joules_total"
PROCESSES = "gpuagent_container_gpu_processes"
UNALLOCATED = "gpuagent_gpu_unallocated_use"

_FAMILIES: tuple[tuple[str, str, str, Callable[[ContainerUsage], float | None]], ...] = (
    (
        MEMORY,
        "gauge",
        "GPU memory used by the container's processes on the GPU (or MIG GPU instance), in bytes.",
        lambda u: u.memory_bytes,
    ),
    (
        SM,
        "gauge",
        "The container's share of the GPU's SM time over the last poll interval (0-1; absent "
        "where NVML has no per-process utilisation, as on MIG).",
        lambda u: u.sm_ratio,
    ),
    (
        ENERGY,
        "counter",
        "The GPU's energy apportioned to the container by SM share, idle energy to the "
        "containers the GPU is allocated to, in joules (see docs/metrics.md).",
        lambda u: u.energy_joules,
    ),
    (
        PROCESSES,
        "gauge",
        "Processes of the container with a context on the GPU (or MIG GPU instance).",
        lambda u: u.processes,
    ),
)
_UNALLOCATED_HELP = (
    "1 while a container runs work on a GPU (or MIG GPU instance) the kubelet did not allocate to "
    "it, one series per such container; 0 (empty pod labels) for a GPU without such use."
)

#: dcgm-exporter families that carry a container's own reading with --dcgm-container-shares.
SHARED_DCGM: Mapping[str, Callable[[ContainerUsage], float | None]] = {
    "DCGM_FI_DEV_GPU_UTIL": lambda u: _percent(u.sm_ratio),
    "DCGM_FI_DEV_MEM_COPY_UTIL": lambda u: _percent(u.mem_ratio),
    "DCGM_FI_DEV_ENC_UTIL": lambda u: _percent(u.enc_ratio),
    "DCGM_FI_DEV_DEC_UTIL": lambda u: _percent(u.dec_ratio),
    "DCGM_FI_DEV_FB_USED": lambda u: None if u.memory_bytes is None else u.memory_bytes / MIB,
    "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": lambda u: (
        None if u.energy_joules is None else u.energy_joules * 1000
    ),
}


def _percent(ratio: float | None) -> float | None:
    return None if ratio is None else round(ratio * 100, 3)


def render_usage(snapshot: Snapshot) -> Iterator[str]:
    """The container families and ``gpuagent_gpu_unallocated_use``, a family at a time."""
    usage = snapshot.usage
    by_index = {gpu.index: gpu for gpu in snapshot.gpus}
    gpu_labels: dict[tuple[int, int | None], str] = {}

    def labels(gpu: int, instance: int | None) -> str | None:
        key = (gpu, instance)
        found = gpu_labels.get(key)
        if found is None:
            parent = by_index.get(gpu)
            if parent is None:
                return None
            found = _gpu_labels(parent, instance)
            gpu_labels[key] = found
        return found

    rows = []
    for u in usage.containers:
        prefix = labels(u.gpu, u.gpu_instance)
        if prefix is not None:
            rows.append((prefix + _pod_labels(u.namespace, u.pod, u.container), u))
    for name, kind, help_text, read in _FAMILIES:
        samples = []
        for block, u in rows:
            value = read(u)
            if value is not None:
                samples.append(f"{name}{{{block}}} {format_value(value)}\n")
        if samples:
            yield header(name, kind, help_text) + "".join(samples)
    if usage.judged:
        yield _unallocated(snapshot, labels)


def _unallocated(snapshot: Snapshot, labels: Callable[[int, int | None], str | None]) -> str:
    offenders: dict[tuple[int, int | None], list[ContainerUsage]] = {}
    for u in snapshot.usage.containers:
        if u.unallocated:
            offenders.setdefault((u.gpu, u.gpu_instance), []).append(u)
    samples = []
    for gpu in snapshot.gpus:
        if gpu.processes is None:
            continue
        instances: list[int | None] = [None]
        if gpu.mig_enabled:
            instances = [*sorted({m.gpu_instance_id for m in gpu.mig_devices})]
        for instance in instances:
            prefix = labels(gpu.index, instance)
            if prefix is None:
                continue
            found = offenders.get((gpu.index, instance), [])
            if not found:
                samples.append(f"{UNALLOCATED}{{{prefix}{_pod_labels('', '', '')}}} 0\n")
            for u in found:
                pods = _pod_labels(u.namespace, u.pod, u.container)
                samples.append(f"{UNALLOCATED}{{{prefix}{pods}}} 1\n")
    if not samples:
        return ""
    return header(UNALLOCATED, "gauge", _UNALLOCATED_HELP) + "".join(samples)


def _gpu_labels(gpu: Gpu, instance: int | None) -> str:
    pairs = [("gpu", str(gpu.index))]
    if instance is not None:
        pairs.append(("GPU_I_ID", str(instance)))
    return label_pairs(pairs)


def _pod_labels(namespace: str, pod: str, container: str) -> str:
    return (
        f',container="{escape_label(container)}",namespace="{escape_label(namespace)}"'
        f',pod="{escape_label(pod)}"'
    )


def accounting_families(
    enabled: bool, links: LogLinkStats | None, cri: CriStats | None, *, detailed: bool
) -> list[Family]:
    """Whether accounting runs, and its name sources' errors (agent part); ``detailed``: their
    activity too."""
    state = Family(
        "gpuagent_container_accounting_enabled",
        "gauge",
        "Whether per-container GPU accounting runs (1) or is switched off (0: no per-container "
        "series; --container-accounting).",
    )
    state.add((), 1 if enabled else 0)
    out = [state]
    if links is not None:
        out += singles(_LOG_LINKS if detailed else _LOG_LINKS[1:2], links)
    if cri is not None:
        out += singles(_CRI if detailed else _CRI[1:2], cri)
    return out


# The errors (the second row of each) are always exported; the rest with detailed metrics.
_LOG_LINKS: tuple[Single[LogLinkStats], ...] = (
    (
        "gpuagent_container_log_links_listings_total",
        "counter",
        "Listings of the kubelet's container log links (only when a GPU process's container "
        "was not named yet).",
        lambda s: s.listings,
    ),
    (
        "gpuagent_container_log_links_errors_total",
        "counter",
        "Listings of the kubelet's container log links that failed (directory absent or "
        "unreadable).",
        lambda s: s.errors,
    ),
    (
        "gpuagent_container_log_links",
        "gauge",
        "Containers named by the last good listing of the kubelet's container log links.",
        lambda s: s.containers,
    ),
)
_CRI: tuple[Single[CriStats], ...] = (
    (
        "gpuagent_cri_requests_total",
        "counter",
        "CRI ListContainers calls made (only when a GPU process's container was never seen).",
        lambda s: s.requests,
    ),
    (
        "gpuagent_cri_errors_total",
        "counter",
        "CRI ListContainers calls that failed, or were not made for want of the configured "
        "socket (no socket at all is no error: the CRI is optional).",
        lambda s: s.errors,
    ),
    (
        "gpuagent_cri_containers",
        "gauge",
        "Containers with the kubelet's labels in the last good CRI ListContainers answer.",
        lambda s: s.containers,
    ),
)
