"""Counters the adapters keep about their own work, kept in the store beside the snapshot.

Each owner counts into :class:`Counters` itself — the plugin service its allocations, an
endpoint its registrations, the pod-resources client its calls, the NVML poller its calls (from
worker threads), the reloader its reloads, the ResourceSlice publisher and the claims' preparer
theirs, the node-health writer its requests and events, accounting its CRI and log-link
listings, each API writer whether it reaches the API server (:class:`ApiReach`, said as soon as a
call fails or works again) — and /metrics reads one consistent copy (:meth:`Counters.read`). The
counters never call back into their owners: what is here is what the owners last put here.
Counts are not part of the versioned snapshot: one that moves wakes no watcher and invalidates
no cached rendering.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Literal, NamedTuple

from gpuagent.domain.apireach import ApiReach, ApiWriter

__all__ = [
    "AgentCounters",
    "ApiReach",
    "ApiWriter",
    "ClaimCounts",
    "Counters",
    "CriStats",
    "LogLinkStats",
    "DraCounters",
    "SliceCounts",
    "KubeCounters",
    "NvmlCallStats",
    "PodResourcesStats",
    "ReloadResult",
    "ReloadStats",
]

ReloadResult = Literal["changed", "unchanged", "invalid"]


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


class SliceCounts(NamedTuple):
    """The ResourceSlice publisher's: publications failed, slices written, the pool's generation
    and the devices as last published. (This and :class:`ClaimCounts` are named tuples: cheaper
    to define than dataclasses on the start's path, and only passed to :class:`Counters`.)"""

    api_errors: int = 0
    slice_writes: int = 0
    slice_generation: int = 0
    devices: int = 0


class ClaimCounts(NamedTuple):
    """The claims' preparer's: claims prepared now, prepares and unprepares, and devices of
    claims prepared again that were gone (a reboot, a driver reload): prepared again, or their
    claim refused."""

    prepared_claims: int = 0
    prepares: int = 0
    prepare_errors: int = 0
    unprepares: int = 0
    gone_prepared_again: int = 0
    gone_refused: int = 0


@dataclass(frozen=True, slots=True)
class DraCounters:
    """The DRA side: slices written, claims (whether the API server is reached is the
    publisher's :class:`ApiReach`; the plugin's registration and the devices published are in
    the snapshot's ``dra_registration`` and ``dra_published``)."""

    api_errors: int = 0
    slice_writes: int = 0
    slice_generation: int = 0
    devices: int = 0
    prepared_claims: int = 0
    prepares: int = 0
    prepare_errors: int = 0
    unprepares: int = 0
    # Devices of claims prepared again that were gone (a reboot, a driver reload): prepared
    # again, or their claim refused.
    gone_prepared_again: int = 0
    gone_refused: int = 0


@dataclass(frozen=True, slots=True)
class KubeCounters:
    """The node-health writer (condition, events, taint): its API calls and what waits (whether
    the API server is reached is the writer's :class:`ApiReach`)."""

    requests: tuple[tuple[str, str, int], ...] = ()  # (object, result, count)
    condition_written_at: float | None = None  # wall time of the last condition write
    events_pending: int = 0
    events_dropped: int = 0


@dataclass(frozen=True, slots=True)
class CriStats:
    """The CRI client's own counters: refreshes of the container names, and the names known."""

    requests: int = 0
    errors: int = 0
    containers: int = 0


@dataclass(frozen=True, slots=True)
class LogLinkStats:
    """The kubelet's container log links: listings made, failed, and the containers named."""

    listings: int = 0
    errors: int = 0
    containers: int = 0


@dataclass(frozen=True, slots=True)
class ReloadStats:
    """Configuration reloads by outcome; ``last_successful`` is false after a refused one."""

    changed: int = 0
    unchanged: int = 0
    invalid: int = 0
    last_successful: bool = True


@dataclass(frozen=True, slots=True)
class AgentCounters:
    """A consistent copy of the agent's own counters, as /metrics renders them."""

    registrations: int = 0
    allocations: int = 0
    pod_resources: PodResourcesStats | None = None
    nvml: tuple[NvmlCallStats, ...] = ()
    dra: DraCounters | None = None
    cri: CriStats | None = None
    log_links: LogLinkStats | None = None
    reloads: ReloadStats = field(default_factory=ReloadStats)
    kube: KubeCounters | None = None
    api: Mapping[ApiWriter, ApiReach] = field(default_factory=lambda: MappingProxyType({}))


class Counters:
    """The agent's counters, written by their owners (from any thread) and read by /metrics."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._registrations = 0
        self._allocations = 0
        self._pod_resources: PodResourcesStats | None = None
        self._nvml: dict[str, NvmlCallStats] = {}
        self._reloads = ReloadStats()
        self._slices: SliceCounts | None = None
        self._claims: ClaimCounts | None = None
        self._cri: CriStats | None = None
        self._log_links: LogLinkStats | None = None
        self._kube: KubeCounters | None = None
        self._polled_at: float | None = None
        self._api: dict[ApiWriter, ApiReach] = {}

    def slices_counted(self, counts: SliceCounts) -> None:
        """The ResourceSlice publisher's counts as they are now (DRA is on)."""
        with self._lock:
            self._slices = counts

    def claims_counted(self, counts: ClaimCounts) -> None:
        """The claims' preparer's counts as they are now (DRA is on)."""
        with self._lock:
            self._claims = counts

    def cri_counted(self, stats: CriStats) -> None:
        """The CRI client's counts as they are now (accounting is on)."""
        with self._lock:
            self._cri = stats

    def log_links_counted(self, stats: LogLinkStats) -> None:
        """The kubelet's log links' counts as they are now (accounting reads them)."""
        with self._lock:
            self._log_links = stats

    def kube_counted(self, counts: KubeCounters) -> None:
        """The node-health writer's counts as they are now (it writes the node's health)."""
        with self._lock:
            self._kube = counts

    def api_reached(self, writer: ApiWriter, reach: ApiReach) -> None:
        """``writer`` reaches the API server, or not, as ``reach`` says (from its last calls)."""
        with self._lock:
            self._api[writer] = reach

    def api_reach(self) -> Mapping[ApiWriter, ApiReach]:
        """What each API writer last said of the API server (a copy)."""
        with self._lock:
            return MappingProxyType(dict(self._api))

    def registered(self) -> None:
        """A registration with the kubelet succeeded."""
        with self._lock:
            self._registrations += 1

    def allocated(self) -> None:
        """An ``Allocate`` call was answered successfully."""
        with self._lock:
            self._allocations += 1

    def pod_resources_listed(self, *, socket_present: bool, ok: bool) -> None:
        """One pod-resources refresh: a ``List`` was made if the socket was there; ``ok``: it
        answered (a missing socket counts as an error without a request)."""
        with self._lock:
            stats = self._pod_resources or PodResourcesStats()
            self._pod_resources = PodResourcesStats(
                requests=stats.requests + socket_present,
                errors=stats.errors + (not ok),
                socket_present=socket_present,
            )

    def nvml_call(self, call: str, seconds: float, *, failed: bool) -> None:
        """One NVML call of kind ``call`` returned (or raised) after ``seconds``."""
        with self._lock:
            stats = self._nvml.get(call) or NvmlCallStats(call, 0, 0.0, 0)
            self._nvml[call] = NvmlCallStats(
                call, stats.count + 1, stats.seconds + seconds, stats.errors + failed
            )

    def polled(self, at: float) -> None:
        """The NVML poller made progress at ``at`` (its clock, monotonic seconds): the GPUs
        discovered, or a poll of every GPU completed."""
        with self._lock:
            self._polled_at = at

    @property
    def polled_at(self) -> float | None:
        """When the NVML poller last made progress; ``None`` before it has."""
        with self._lock:
            return self._polled_at

    def reloaded(self, result: ReloadResult) -> None:
        """A configuration reload ended with ``result``."""
        with self._lock:
            reloads = self._reloads
            count = getattr(reloads, result) + 1
            self._reloads = replace(reloads, **{result: count}, last_successful=result != "invalid")

    def read(self) -> AgentCounters:
        with self._lock:
            return AgentCounters(
                registrations=self._registrations,
                allocations=self._allocations,
                pod_resources=self._pod_resources,
                nvml=tuple(self._nvml[name] for name in sorted(self._nvml)),
                reloads=self._reloads,
                dra=self._dra(),
                cri=self._cri,
                log_links=self._log_links,
                kube=self._kube,
                api=MappingProxyType(dict(self._api)),
            )

    def _dra(self) -> DraCounters | None:
        if self._slices is None and self._claims is None:
            return None
        slices, claims = self._slices or SliceCounts(), self._claims or ClaimCounts()
        return DraCounters(*slices, *claims)
