"""The probes' verdicts, each a reason in one short line or ``None`` for OK: readiness (the node's
GPUs are served) and freshness (the readings are current: ``/health``, as dcgm-exporter's)."""

from __future__ import annotations

from gpuagent.domain.devices import DriverState, NodeState

__all__ = ["MAX_REASON", "STALE_AFTER_POLLS", "freshness", "freshness_limit", "readiness"]

MAX_REASON = 500  # characters: a probe's answer, not a log

#: Polls a GPU's readings may miss before they are stale, on top of the NVML call limit: a hung
#: GPU is judged unresponsive after a call runs past the limit and two polls more.
STALE_AFTER_POLLS = 3


def readiness(
    snapshot: NodeState, resources_error: str = "", *, kubernetes: bool = True
) -> str | None:
    """``None`` when ready, else the reason (current, and at most :data:`MAX_REASON` long).

    Ready means: the driver answers, the GPUs are discovered and — when serving the kubelet —
    the resources can be built and every one is registered. ``resources_error`` is why the
    resources of ``snapshot`` cannot be built, if they cannot.
    """
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
