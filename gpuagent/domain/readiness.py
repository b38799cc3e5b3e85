"""The probes' verdicts, each a reason in one short line or ``None`` for OK: readiness (the node's
GPUs are served: ``/readyz``'s whole answer, from the snapshot and what the API writers last
said) and freshness (the readings are current: ``/health``, as dcgm-exporter's)."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import NamedTuple

from gpuagent.domain.apireach import NOT_PUBLISHED, ApiReach, ApiWriter
from gpuagent.domain.devices import DriverState, NodeState, Registration
from gpuagent.domain.serving import cdi_gated
from gpuagent.domain.snapshot import Snapshot

__all__ = [
    "MAX_REASON",
    "STALE_AFTER_POLLS",
    "Readiness",
    "freshness",
    "freshness_limit",
    "readiness",
]

MAX_REASON = 500  # characters: a probe's answer, not a log

#: Polls a GPU's readings may miss before they are stale, on top of the NVML call limit: a hung
#: GPU is judged unresponsive after a call runs past the limit and two polls more.
STALE_AFTER_POLLS = 3

NO_REACH: Mapping[ApiWriter, ApiReach] = MappingProxyType({})


class Readiness(NamedTuple):
    """``/readyz``'s answer: ``reason`` why the node's GPUs are not served (``None``: ready), and
    a ``note`` said either way (the node's health not written while the API server is away:
    the GPUs are served, so the agent stays ready). (A named tuple: cheaper to define than a
    dataclass on the start's path.)"""

    reason: str | None = None
    note: str = ""

    @property
    def text(self) -> str:
        """The answer's body: the verdict's line, then the note's."""
        return f"{self.reason or 'ready'}\n{self.note}"


def readiness(
    snapshot: Snapshot,
    resources_error: str = "",
    *,
    kubernetes: bool = True,
    api: Mapping[ApiWriter, ApiReach] = NO_REACH,
) -> Readiness:
    """Whether the node's GPUs are served, and why not (current, and at most :data:`MAX_REASON`
    long where the kubelet's or the driver's words make it long).

    Ready means: the driver answers, the GPUs are discovered and — when serving the kubelet —
    the resources can be built, every one is registered, the CDI spec their devices need is
    written, and DRA's devices (when DRA is on) are published and its plugin registered.
    ``resources_error`` is why the resources of ``snapshot`` cannot be built, if they cannot;
    ``api``: what each API writer last said of the API server (the store's counters).
    """
    reason = _served(snapshot, resources_error, kubernetes=kubernetes)
    cdi = snapshot.cdi
    gated = cdi is not None and cdi.error and cdi_gated(snapshot, snapshot.plan.serving.containers)
    if reason is None and cdi is not None and gated:
        reason = f"CDI spec not written (devices it lacks are not offered): {cdi.error}"
    if reason is None and snapshot.dra_registration is not None:
        slices = api.get("resource_slices") or ApiReach(error=NOT_PUBLISHED)
        reason = _dra(snapshot, snapshot.dra_registration, slices)
    return Readiness(reason, _note(api.get("node_health")))


def _served(snapshot: NodeState, resources_error: str, *, kubernetes: bool) -> str | None:
    """The device plugin's part: the driver, the GPUs' discovery, the resources, and their
    registrations with the kubelet."""
    # While the driver is brought up, what the agent waits for (the NVML call, the GPU).
    pending = f" (waiting for {snapshot.driver.waiting})" if snapshot.driver.waiting else ""
    if not snapshot.driver.up:
        error = snapshot.driver.error or "not initialised yet"
        return _bounded(f"driver unavailable: {error}{pending}")
    if not snapshot.discovered:
        return _bounded(f"gpus not discovered yet{pending}")
    if not kubernetes:
        return None
    if resources_error:
        return _bounded(f"devices cannot be advertised: {resources_error}")
    if snapshot.registered:
        return None
    waiting = sorted(
        (name, r.error) for name, r in snapshot.registrations.items() if not r.registered
    )
    detail = "; ".join(f"{name}: {error}" for name, error in waiting if error)
    return _bounded("not registered with the kubelet" + (f": {detail}" if detail else ""))


def _dra(snapshot: Snapshot, registration: Registration, slices: ApiReach) -> str | None:
    """DRA's part: its devices published (a GPU offered through neither API is named), then
    its kubelet plugin registered."""
    if not slices.up:
        gpus = snapshot.unpublished_dra_gpus()
        nowhere = ""
        if gpus:
            plural = "s" if len(gpus) > 1 else ""
            nowhere = f"GPU{plural} {', '.join(map(str, gpus))} offered through neither API: "
        return f"DRA: {nowhere}ResourceSlices not published: {slices.error}"
    if not registration.registered:
        detail = f": {registration.error}" if registration.error else ""
        return f"DRA: not registered with the kubelet{detail}"
    return None


def _note(node_health: ApiReach | None) -> str:
    """A line while the node-health writer waits for the API server (as it said in the store):
    the condition and events are not written, yet the GPUs are served, so the agent stays ready
    (a control plane that throttles must not turn every node's agent unready)."""
    if node_health is None or not node_health.backing_off:
        return ""
    return f"node health not written: {node_health.error}; retrying\n"


def freshness_limit(poll_interval: float, call_timeout: float) -> float:
    """How old the last reading of a GPU, or the last completed poll of all of them, may be and
    still count as current, in seconds: :data:`STALE_AFTER_POLLS` poll intervals and the NVML
    call limit (25 s by default)."""
    return STALE_AFTER_POLLS * poll_interval + call_timeout


def freshness(
    polled_at: float | None, now: float, limit: float, *, since: float, driver: DriverState
) -> str | None:
    """``None`` while the readings are current, else why not (``/health``).

    ``polled_at``: when the poller last made progress (the GPUs discovered, a poll completed),
    ``None`` before; ``since``: when the agent started. Collection has stalled when no poll has
    completed for longer than ``limit``. Before the first, discovery is under way while the
    driver is up (it has its own budget, ``--nvml-timeout``); a driver still unavailable
    ``limit`` after the start means there are no readings at all.
    """
    if polled_at is None:
        if driver.up or now - since <= limit:
            return None
        error = driver.error or "not initialised yet"
        return _bounded(f"no readings: driver unavailable: {error}")
    age = now - polled_at
    if age <= limit:
        return None
    return _bounded(f"collection stalled: no poll completed for {age:.0f}s (limit {limit:g}s)")


def _bounded(reason: str) -> str:
    if len(reason) <= MAX_REASON:
        return reason
    return f"{reason[: MAX_REASON - 1]}…"
