"""Per-container GPU accounting: the driver's per-process readings joined to containers.

:func:`account` turns one snapshot's per-process readings (:class:`ProcessReading` on each GPU),
the container of each process (from its cgroup) and each container's names (from the container
runtime) into :class:`Usage`:

* **memory**: the sum of the container's processes' used memory on the GPU (or MIG instance);
* **SM share**: the sum of its processes' SM utilisation over the interval since the previous
  poll (NVML's per-process samples; several samples of one process are averaged), as a ratio
  0-1. Time-sliced containers' shares add up to the GPU's utilisation. NVML offers no per-process
  utilisation on MIG-enabled GPUs, so there the share (and the energy) is absent;
* **energy**: each poll's energy delta of the GPU (its energy counter) is split in two: the
  *active* part, ``delta * min(1, sum of SM shares)``, goes to the containers in proportion to
  their SM shares; the *idle* rest goes in equal parts to the containers the kubelet allocated the
  GPU to (none allocated: the idle part is nobody's). Each container's joules accumulate in the
  :class:`Ledger` from the first poll that sees it on the GPU;
* **unallocated use**: a container known by name whose processes run on a GPU (instance) that the
  kubelet did not allocate to it (a privileged pod seeing every GPU).

Containers the kubelet allocated a GPU to appear even while they run nothing there (zero memory,
zero share): an idle allocation is the first thing to look for. Processes whose container is not
known are grouped under empty names, never dropped. An MPS server is no container's work: with MPS
each client is accounted to its own container, and the server (which runs in the agent's cgroup,
its daemon being the agent's child) is left out. Nothing here performs I/O.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from gpuagent.domain.attribution import Target, attributions, by_device, merged
from gpuagent.domain.cgroups import CgroupOwner
from gpuagent.domain.devices import Gpu, NodeState, PodRef
from gpuagent.domain.dra import DraPlan
from gpuagent.domain.drapods import dra_holders
from gpuagent.domain.plan import Plan
from gpuagent.domain.usage import ContainerUsage, ProcessReading, ProcessSample, Usage

__all__ = ["UNKNOWN", "Ledger", "account"]

#: The names of processes whose container is not known.
UNKNOWN = PodRef(namespace="", pod="", container="")

_Key = tuple[int, int | None, PodRef]  # (gpu index, gpu instance, container)
_NOBODY: frozenset[PodRef] = frozenset()


@dataclass(frozen=True, slots=True)
class Ledger:
    """What accounting carries from one poll to the next.

    ``energy_mj``: each GPU's energy counter at the previous poll; ``joules``: each container's
    accumulated energy per GPU.
    """

    energy_mj: Mapping[int, float] = field(default_factory=lambda: MappingProxyType({}))
    joules: Mapping[_Key, float] = field(default_factory=lambda: MappingProxyType({}))


@dataclass(slots=True)
class _Group:
    processes: int = 0
    memory: int | None = None
    sm: float = 0.0
    mem: float = 0.0
    enc: float = 0.0
    dec: float = 0.0

    def add(self, memory: int | None, sample: ProcessSample | None) -> None:
        self.processes += 1
        if memory is not None:
            self.memory = (self.memory or 0) + memory
        if sample is not None:
            self.sm += sample.sm_pct
            self.mem += sample.mem_pct
            self.enc += sample.enc_pct
            self.dec += sample.dec_pct


def account(
    snapshot: NodeState,
    owners: Mapping[int, CgroupOwner | None],
    names: Mapping[str, PodRef],
    ledger: Ledger = Ledger(),
    served: Collection[str] = Plan().served_resources,
    *,
    dra: DraPlan | None = None,
) -> tuple[Usage, Ledger]:
    """Usage of every GPU of ``snapshot`` that has a :class:`ProcessReading`, and the next ledger.

    ``owners``: the container of each process (``None`` for a process outside any container; a
    pid missing from it, e.g. one that exited, is unknown too). ``names``: pod and container names
    by container ID, as the container runtime lists them. ``served``: the plan's resource names
    (whose devices' holders the pods are); ``dra``: the DRA side's plan (whose claims hold
    devices too).
    """
    holders = _holders(snapshot, served, dra)
    allowed = {target: frozenset(refs) for target, refs in holders.items()}
    usages: list[ContainerUsage] = []
    energy = dict(ledger.energy_mj)
    read = {gpu.index for gpu in snapshot.gpus if gpu.processes is not None}
    # GPUs without a reading this time (a failed probe) keep their counters for the next one.
    joules = {k: v for k, v in ledger.joules.items() if k[0] not in read}
    for gpu in snapshot.gpus:
        reading = gpu.processes
        if reading is None:
            continue
        groups = _groups(gpu, reading, owners, names, holders)
        gained = _energy(gpu, _shares(reading, groups), holders.get(Target(gpu.index), ()), ledger)
        if gpu.telemetry.energy_mj is not None:
            energy[gpu.index] = gpu.telemetry.energy_mj
        for (instance, ref), group in sorted(groups.items(), key=_order):
            key = (gpu.index, instance, ref)
            total = None
            if reading.samples is not None:
                total = joules[key] = ledger.joules.get(key, 0.0) + gained.get(ref, 0.0)
            allocated = ref in allowed.get(Target(gpu.index, instance), _NOBODY)
            usages.append(_usage(key, group, total, allocated))
    usage = Usage(
        containers=tuple(usages),
        judged=snapshot.pods.refreshed_at is not None,
        pod_uids=_pod_uids(snapshot, owners, names),
    )
    return usage, Ledger(energy_mj=MappingProxyType(energy), joules=MappingProxyType(joules))


def _holders(
    snapshot: NodeState, served: Collection[str], dra: DraPlan | None
) -> Mapping[Target, tuple[PodRef, ...]]:
    """The containers each GPU (instance) is allocated to: by the kubelet (the pods holding the
    plan's devices) and by DRA's claims."""
    holders = attributions(snapshot, by_device(snapshot.pods.allocated, served))
    if dra is not None:
        holders = merged(holders, dra_holders(snapshot, dra))
    return holders


def _shares(
    reading: ProcessReading, groups: Mapping[tuple[int | None, PodRef], _Group]
) -> dict[tuple[int | None, PodRef], float] | None:
    """Each group's SM share, a ratio; ``None`` where the driver has no per-process samples."""
    if reading.samples is None:
        return None
    return {k: _ratio(g.sm) for k, g in groups.items()}


def _usage(key: _Key, group: _Group, joules: float | None, allocated: bool) -> ContainerUsage:
    """A container's usage of a GPU (instance) from its processes' ``group``; its ratios and
    ``joules`` where the driver has per-process samples (``joules`` not ``None``)."""
    gpu, instance, ref = key
    sampled = joules is not None
    return ContainerUsage(
        gpu,
        instance,
        ref.namespace,
        ref.pod,
        ref.container,
        group.processes,
        group.memory,
        _ratio(group.sm) if sampled else None,
        _ratio(group.mem) if sampled else None,
        _ratio(group.enc) if sampled else None,
        _ratio(group.dec) if sampled else None,
        joules,
        allocated,
    )


def _groups(
    gpu: Gpu,
    reading: ProcessReading,
    owners: Mapping[int, CgroupOwner | None],
    names: Mapping[str, PodRef],
    holders: Mapping[Target, tuple[PodRef, ...]],
) -> dict[tuple[int | None, PodRef], _Group]:
    samples = _mean_samples(reading.samples or ())
    groups: dict[tuple[int | None, PodRef], _Group] = {}
    for process in reading.processes:
        if process.mps_server:
            continue
        instance = process.gpu_instance if gpu.mig_enabled else None
        owner = owners.get(process.pid)
        ref = names.get(owner.container_id, UNKNOWN) if owner is not None else UNKNOWN
        group = groups.setdefault((instance, ref), _Group())
        group.add(process.used_memory_bytes, samples.get(process.pid))
    instances: list[int | None] = [None]
    if gpu.mig_enabled:
        instances = [*sorted({m.gpu_instance_id for m in gpu.mig_devices})]
    for instance in instances:
        for ref in holders.get(Target(gpu.index, instance), ()):
            group = groups.setdefault((instance, ref), _Group())
            if group.processes == 0 and group.memory is None:
                group.memory = 0
    return groups


def _pod_uids(
    snapshot: NodeState, owners: Mapping[int, CgroupOwner | None], names: Mapping[str, PodRef]
) -> tuple[tuple[str, str, str], ...]:
    """(namespace, pod, UID) of each named pod whose GPU processes' cgroups carry its UID."""
    found: set[tuple[str, str, str]] = set()
    for gpu in snapshot.gpus:
        if gpu.processes is None:
            continue
        for process in gpu.processes.processes:
            owner = None if process.mps_server else owners.get(process.pid)
            if owner is None or not owner.pod_uid:
                continue
            ref = names.get(owner.container_id)
            if ref is not None and ref.pod:
                found.add((ref.namespace, ref.pod, owner.pod_uid))
    return tuple(sorted(found))


def _mean_samples(samples: tuple[ProcessSample, ...]) -> dict[int, ProcessSample]:
    """One sample per pid: the mean of that pid's samples over the interval."""
    single = {s.pid: s for s in samples}
    if len(single) == len(samples):
        return single  # the usual case: one sample per process
    by_pid: dict[int, list[ProcessSample]] = {}
    for sample in samples:
        by_pid.setdefault(sample.pid, []).append(sample)
    out: dict[int, ProcessSample] = {}
    for pid, items in by_pid.items():
        n = len(items)
        out[pid] = ProcessSample(
            pid=pid,
            sm_pct=sum(s.sm_pct for s in items) / n,
            mem_pct=sum(s.mem_pct for s in items) / n,
            enc_pct=sum(s.enc_pct for s in items) / n,
            dec_pct=sum(s.dec_pct for s in items) / n,
        )
    return out


def _energy(
    gpu: Gpu,
    shares: Mapping[tuple[int | None, PodRef], float] | None,
    holders: tuple[PodRef, ...],
    ledger: Ledger,
) -> dict[PodRef, float]:
    """Joules gained by each container on ``gpu`` since the previous poll (see module doc)."""
    now, before = gpu.telemetry.energy_mj, ledger.energy_mj.get(gpu.index)
    if shares is None or now is None or before is None or now < before:
        return {}  # first reading, no counter, or the counter restarted (driver reload)
    delta = (now - before) / 1000.0
    total = sum(shares.values())
    busy = min(1.0, total)
    gained: dict[PodRef, float] = {}
    if total > 0:
        for (_, ref), share in shares.items():
            if share > 0:
                gained[ref] = gained.get(ref, 0.0) + delta * busy * share / total
    if holders and busy < 1.0:
        idle = delta * (1.0 - busy) / len(holders)
        for ref in holders:
            gained[ref] = gained.get(ref, 0.0) + idle
    return gained


def _ratio(pct: float) -> float:
    ratio = pct / 100.0
    return 1.0 if ratio > 1.0 else (0.0 if ratio < 0.0 else ratio)


def _order(item: tuple[tuple[int | None, PodRef], _Group]) -> tuple[int, str, str, str]:
    (instance, ref), _ = item
    return (-1 if instance is None else instance, ref.namespace, ref.pod, ref.container)
