"""Counters the adapters keep about their own work (registrations, allocations, pod-resources
and NVML calls), as /metrics reports them; the device state itself is in the snapshot.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["AgentCounters", "CriStats", "DraCounters", "NvmlCallStats", "PodResourcesStats"]


@dataclass(frozen=True, slots=True)
class PodResourcesStats:
    """The pod-resources client's own counters (the mapping itself is in the snapshot)."""

    requests: int = 0
    errors: int = 0
    socket_present: bool = False


@dataclass(frozen=True, slots=True)
class NvmlCallStats:
    """Calls into NVML of one kind: how many, how long in total, how many failed."""

    call: str
    count: int
    seconds: float
    errors: int


@dataclass(frozen=True, slots=True)
class DraCounters:
    """The DRA side: the API server as last seen, slices written, the kubelet plugin, claims."""

    api_up: bool = False
    api_errors: int = 0
    slice_writes: int = 0
    slice_generation: int = 0
    devices: int = 0
    registered: bool = False
    prepared_claims: int = 0
    prepares: int = 0
    prepare_errors: int = 0
    unprepares: int = 0


@dataclass(frozen=True, slots=True)
class CriStats:
    """The CRI client's own counters: refreshes of the container names, and the names known."""

    requests: int = 0
    errors: int = 0
    containers: int = 0


@dataclass(frozen=True, slots=True)
class AgentCounters:
    """The agent's own counters that live outside the device snapshot."""

    registrations: int = 0
    allocations: int = 0
    pod_resources: PodResourcesStats | None = None
    nvml: tuple[NvmlCallStats, ...] = ()
    dra: DraCounters | None = None
    cri: CriStats | None = None
