"""The Node condition ``GPUHealthy``: written when what it says changes, and again (its
``lastHeartbeatTime``) every ``heartbeat`` seconds or a little more while it does not; a
condition a previous agent left on the Node is taken as written."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import structlog

from gpuagent.domain.nodehealth import CONDITION_TYPE, ConditionReport, condition_patch
from gpuagent.domain.pacing import next_heartbeat
from gpuagent.kube.nodehealth.objects import ApiObject, NodeApi
from gpuagent.kube.pacer import CallFailed
from gpuagent.state.clock import Clock

__all__ = ["HEARTBEAT_MIN", "ConditionWriter"]

log = structlog.get_logger("gpuagent.kube")

#: ``lastHeartbeatTime`` moves at most this often (seconds).
HEARTBEAT_MIN = 60.0


@dataclass(frozen=True, slots=True)
class _Written:
    """The condition as on the Node: what it says and its two times (wall seconds)."""

    report: ConditionReport
    transition: float
    heartbeat: float


class ConditionWriter:
    """Writes the ``GPUHealthy`` condition of the Node, once the Node is read (:meth:`found`)."""

    object = ApiObject.CONDITION

    def __init__(
        self,
        target: NodeApi,
        *,
        heartbeat: float,
        clock: Clock,
        wall: Callable[[], float],
        draw: Callable[[], float],
    ) -> None:
        self._target = target
        self._heartbeat = heartbeat
        self._clock = clock
        self._wall = wall
        self._draw = draw
        self._read = False  # the Node has been read: what it has is known
        self._written: _Written | None = None
        #: When the condition is written again though unchanged (the writer's clock).
        self.heartbeat_at: float | None = None
        #: Wall time of the last write.
        self.written_at: float | None = None

    def found(self, node: Mapping[str, Any]) -> None:
        """The Node as read at start: the condition on it counts as written."""
        self._read = True
        self._written = _existing(node)
        if self._written is not None:
            # The next heartbeat as if this agent had written the one on the Node.
            age = max(0.0, self._wall() - self._written.heartbeat)
            self.heartbeat_at = next_heartbeat(
                self._clock.now() - age, self._heartbeat, self._draw()
            )

    def wanted(self) -> bool:
        model = self._target.model
        if not self._read or model.view is None:
            return False
        written = self._written
        if written is None or written.report != model.condition():
            return True
        return self.heartbeat_at is not None and self._clock.now() >= self.heartbeat_at

    async def write(self) -> bool:
        report = self._target.model.condition()
        if report is None:
            return False
        wall = self._wall()
        old = self._written
        transition = wall if old is None or old.report.status != report.status else None
        heartbeat = wall if old is None or wall - old.heartbeat >= HEARTBEAT_MIN else None
        patch = condition_patch(report, transition=transition, heartbeat=heartbeat)
        target = self._target
        try:
            await target.pacer.call(self.object, target.api.patch_node_status(target.node, patch))
        except CallFailed as exc:
            if exc.kind == "retry":
                raise
            return False
        self._written = _Written(
            report,
            transition if transition is not None else old.transition if old else wall,
            heartbeat if heartbeat is not None else old.heartbeat if old else wall,
        )
        self.heartbeat_at = next_heartbeat(self._clock.now(), self._heartbeat, self._draw())
        self.written_at = wall
        if old is None or old.report.status != report.status:
            log.info("node condition written", condition=CONDITION_TYPE, status=report.status,
                     reason=report.reason)  # fmt: skip
        return True


def _existing(node: Mapping[str, Any]) -> _Written | None:
    """The ``GPUHealthy`` condition on the Node as read, or ``None``."""
    for condition in node.get("status", {}).get("conditions") or []:
        if condition.get("type") != CONDITION_TYPE:
            continue
        status = condition.get("status")
        if status not in ("True", "False"):
            return None
        report = ConditionReport(status, condition.get("reason", ""), condition.get("message", ""))
        transition = _seconds(condition.get("lastTransitionTime"))
        heartbeat = _seconds(condition.get("lastHeartbeatTime"))
        if transition is None or heartbeat is None:
            return None
        return _Written(report, transition, heartbeat)
    return None


def _seconds(value: object) -> float | None:
    if isinstance(value, datetime):
        return value.timestamp()
    if not isinstance(value, str):
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None
