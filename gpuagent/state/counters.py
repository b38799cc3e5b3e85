"""Counters the adapters keep about their own work, kept in the store beside the snapshot.

Each owner counts into :class:`Counters` itself — the plugin service its allocations, an
endpoint its registrations, the pod-resources client its calls, the NVML poller its calls (from
worker threads), the reloader its reloads, each API writer whether it reaches the API server
(:class:`ApiReach`, said as soon as a call fails or works again) — and /metrics reads one
consistent copy (:meth:`Counters.read`). Counts are not part of the versioned snapshot: one that
moves wakes no watcher and invalidates no cached rendering.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Literal

__all__ = [
    "AgentCounters",
    "ApiReach",
    "ApiWriter",
    "Counters",
    "CriStats",
    "LogLinkStats",
    "DraCounters",
    "KubeCounters",
    "NvmlCallStats",
    "PodResourcesStats",
    "ReloadResult",
    "ReloadStats",
]

ReloadResult = Literal["changed", "unchanged", "invalid"]
#: The agent's API writers: the DRA side's ResourceSlices, the node's GPU health.
ApiWriter = Literal["resource_slices", "node_health"]


@dataclass(frozen=True, slots=True)
class ApiReach:
    """Whether an API writer reaches the API server, as its last calls found it."""

    up: bool = False  # its last batch went out whole (False before the first)
    backing_off: bool = False  # it waits for a server unreachable, throttling or failing
    error: str = ""  # why not up ("" while up)


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
    """The DRA side: slices written, the kubelet plugin, claims (whether the API server is
    reached is the publisher's :class:`ApiReach`)."""

    api_errors: int = 0
    slice_writes: int = 0
    slice_generation: int = 0
    devices: int = 0
    # GPUs given to DRA whose devices are in no published slice: offered through neither API.
    unpublished_gpus: int = 0
    registered: bool = False
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
        self._dra: Callable[[], DraCounters] | None = None
        self._cri: Callable[[], CriStats] | None = None
        self._log_links: Callable[[], LogLinkStats] | None = None
        self._kube: Callable[[], KubeCounters] | None = None
        self._polled_at: float | None = None
        self._api: dict[ApiWriter, ApiReach] = {}

    def follow_dra(self, read: Callable[[], DraCounters]) -> None:
        """The DRA side's counters are read from its parts by ``read`` (on the loop's thread)."""
        self._dra = read

    def follow_cri(self, read: Callable[[], CriStats]) -> None:
        """The CRI client's counters are read by ``read`` (on the loop's thread)."""
        self._cri = read

    def follow_kube(self, read: Callable[[], KubeCounters]) -> None:
        """The node-health writer's counters are read by ``read`` (on the loop's thread)."""
        self._kube = read

    def follow_log_links(self, read: Callable[[], LogLinkStats]) -> None:
        """The log links' counters are read by ``read`` (on the loop's thread)."""
        self._log_links = read

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
        dra = self._dra() if self._dra is not None else None
        cri = self._cri() if self._cri is not None else None
        log_links = self._log_links() if self._log_links is not None else None
        kube = self._kube() if self._kube is not None else None
        with self._lock:
            return AgentCounters(
                registrations=self._registrations,
                allocations=self._allocations,
                pod_resources=self._pod_resources,
                nvml=tuple(self._nvml[name] for name in sorted(self._nvml)),
                reloads=self._reloads,
                dra=dra,
                cri=cri,
                log_links=log_links,
                kube=kube,
                api=MappingProxyType(dict(self._api)),
            )
