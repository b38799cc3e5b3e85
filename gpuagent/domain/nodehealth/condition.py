"""The ``GPUHealthy`` Node condition: its reason (the worst cause, :data:`REASONS`), its message
(each affected device, its evidence in words, since when) and the status patch that writes it."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from gpuagent.domain import xids
from gpuagent.domain.devices import Condition
from gpuagent.domain.health import (
    DISCOVERY,
    ECC_DBE,
    LOST,
    RECOVERY,
    ROW_REMAP_FAILURE,
    ROW_REMAP_PENDING,
    UNRESPONSIVE,
    XID,
)
from gpuagent.domain.nodehealth.view import DeviceRef, Fault, NodeHealthView

__all__ = [
    "CONDITION_TYPE",
    "HEALTHY_REASON",
    "MAX_LISTED",
    "REASONS",
    "ConditionReport",
    "condition_patch",
    "condition_report",
    "evidence",
    "evidence_of",
    "worst_reason",
]

CONDITION_TYPE = "GPUHealthy"
HEALTHY_REASON = "AllGPUsHealthy"

#: Reasons of the condition, worst cause first: the reason is the worst cause on any device.
#: A cause outranks the driver's remedy: an XID with the recovery action it brought reads
#: ``XidError`` (the action is in the message); the action alone reads ``RecoveryActionRequired``.
REASONS: tuple[tuple[str, str], ...] = (
    (LOST, "GPULost"),
    (UNRESPONSIVE, "Unresponsive"),
    (ECC_DBE, "DoubleBitECC"),
    (ROW_REMAP_FAILURE, "RowRemapFailure"),
    (XID, "XidError"),
    (RECOVERY, "RecoveryActionRequired"),
    (ROW_REMAP_PENDING, "RowRemapPending"),
    (DISCOVERY, "DiscoveryFailed"),
)
_RANK = {kind: rank for rank, (kind, _) in enumerate(REASONS)}
_REASON = dict(REASONS)
#: The reason of a condition kind this table does not know (ranked last).
OTHER_REASON = "GPUUnhealthy"

#: Devices named one by one in the condition's message; the rest are counted.
MAX_LISTED = 8

#: The catalog's immediate action, as the message says it.
ACTION_TEXT: Mapping[xids.Action, str] = {
    xids.Action.IGNORE: "none",
    xids.Action.RESTART_APP: "restart the application",
    xids.Action.RESTART_VM: "restart the virtual machine",
    xids.Action.RESET_GPU: "reset the GPU",
    xids.Action.RESTART_BM: "restart the node",
    xids.Action.CONTACT_SUPPORT: "contact NVIDIA support",
    xids.Action.CHECK_MECHANICALS: "check the GPU's seating and power connections",
    xids.Action.CHECK_UVM: "reset the GPU if UVM or vGPU is in use",
    xids.Action.UPDATE_SWFW: "update the driver and firmware",
    xids.Action.WORKFLOW_XID_45: "follow the XID it came with",
    xids.Action.WORKFLOW_XID_48: "reset the GPU (drain and reset with XID 63 or 64)",
    xids.Action.WORKFLOW_NVLINK_ERR: "decode the NVLink error registers",
    xids.Action.WORKFLOW_NVLINK5_ERR: "decode the NVLink error (XID catalog, 144-150)",
    xids.Action.XID_154: "follow the driver's recovery action",
    xids.Action.NONE: "none named by the catalog",
}
#: The driver's recovery action (``recovery_action <name>``), as the message says it.
RECOVERY_TEXT: Mapping[str, str] = {
    "gpu_reset": "reset the GPU",
    "node_reboot": "reboot the node",
    "drain_p2p": "drain peer-to-peer traffic",
    "drain_and_reset": "drain the GPU's work, then reset it",
    "recover_imex_domain": "recover the IMEX domain",
    "bus_reset": "reset the GPU's PCIe bus",
    "system_reboot": "reboot the system",
}


def evidence(condition: Condition) -> str:
    """What one condition says, for people: the XID's meaning and the action to take."""
    kind, detail = condition.kind, condition.detail
    if kind == XID and detail.isdigit():
        entry = xids.lookup(int(detail))
        return (
            f"XID {entry.code}, {entry.text} "
            f"(recommended action: {ACTION_TEXT.get(entry.action, entry.action.value)})"
        )
    if kind == ECC_DBE:
        return "double-bit ECC error (recommended action: reset the GPU)"
    if kind == LOST:
        return "the GPU has fallen off the bus (recommended action: restart the node)"
    if kind == RECOVERY:
        return f"the driver's recovery action: {RECOVERY_TEXT.get(detail, detail)}"
    if kind == ROW_REMAP_PENDING:
        return "a memory row remap is pending (recommended action: reset the GPU)"
    if kind == ROW_REMAP_FAILURE:
        return "memory row remapping failed (recommended action: contact NVIDIA support)"
    if kind == UNRESPONSIVE:
        return f"the GPU does not answer the driver ({detail})" if detail else "unresponsive"
    if kind == DISCOVERY:
        return f"the GPU could not be described ({detail})" if detail else "not described"
    return str(condition)


def evidence_of(conditions: Iterable[Condition]) -> str:
    return "; ".join(evidence(c) for c in sorted(conditions, key=_rank_of))


def _rank_of(condition: Condition) -> int:
    return _RANK.get(condition.kind, len(REASONS))


def worst_reason(faults: Iterable[Fault]) -> str:
    """The reason of the worst cause among ``faults``."""
    conditions = [c for fault in faults for c in fault.conditions]
    if not conditions:
        return HEALTHY_REASON
    return _REASON.get(min(conditions, key=_rank_of).kind, OTHER_REASON)


def rfc3339(seconds: float) -> str:
    """A ``metav1.Time``: UTC, to the second."""
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True, slots=True)
class ConditionReport:
    """The condition as it should read (times aside)."""

    status: Literal["True", "False"]
    reason: str
    message: str


def condition_report(view: NodeHealthView, since: Mapping[DeviceRef, float]) -> ConditionReport:
    """The condition for ``view``; ``since``: when each unhealthy device turned so (wall time)."""
    units = f"{view.gpus} GPU{'s' if view.gpus != 1 else ''}"
    if view.mig_devices:
        units += f" ({view.mig_devices} MIG device{'s' if view.mig_devices != 1 else ''})"
    if view.healthy:
        return ConditionReport("True", HEALTHY_REASON, f"All {units} are healthy")
    affected = len({f.device.gpu for f in view.faults})
    entries = [
        f"{fault.device}: {evidence_of(fault.conditions)}; unhealthy since "
        f"{rfc3339(since.get(fault.device, 0.0))}."
        for fault in view.faults[:MAX_LISTED]
    ]
    more = len(view.faults) - MAX_LISTED
    if more > 0:
        entries.append(f"And {more} more unhealthy device{'s' if more != 1 else ''}.")
    message = f"{affected} of {units} unhealthy. " + " ".join(entries)
    return ConditionReport("False", worst_reason(view.faults), message)


def condition_patch(
    report: ConditionReport, *, transition: float | None, heartbeat: float | None
) -> dict[str, Any]:
    """A strategic-merge patch of ``nodes/status`` that names only the ``GPUHealthy`` condition
    (``conditions`` merge on ``type``: the kubelet's are left as they are). A time left ``None``
    is not sent, so the one on the Node stays."""
    condition: dict[str, Any] = {
        "type": CONDITION_TYPE,
        "status": report.status,
        "reason": report.reason,
        "message": report.message,
    }
    if heartbeat is not None:
        condition["lastHeartbeatTime"] = rfc3339(heartbeat)
    if transition is not None:
        condition["lastTransitionTime"] = rfc3339(transition)
    return {"status": {"conditions": [condition]}}
