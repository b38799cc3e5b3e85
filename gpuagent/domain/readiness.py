"""Readiness: whether the node's GPUs are served, and if not, why — in one short line."""

from __future__ import annotations

from gpuagent.domain.devices import NodeState

__all__ = ["MAX_REASON", "readiness"]

MAX_REASON = 500  # characters: a probe's answer, not a log


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


def _bounded(reason: str) -> str:
    if len(reason) <= MAX_REASON:
        return reason
    return f"{reason[: MAX_REASON - 1]}…"
