"""Health policy: which driver signals make a GPU unhealthy, and which bring it back.

The policy is a pure state machine over :class:`~gpuagent.domain.devices.GpuHealth`: each
:data:`HealthEvent` adds or clears conditions, and a GPU is healthy exactly when none is active.
Unhealthy is not forever: the driver's recovery signal (its recovery action returning to "none")
clears the conditions it covers, and a GPU that answers again is no longer lost.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import MappingProxyType

from gpuagent.domain import xids
from gpuagent.domain.devices import Condition, Gpu, GpuHealth

#: Catalog actions after which the GPU may take new work: nothing to do, or only the
#: application to restart; XID 154 only announces the recovery action (read on its own); XID 45
#: follows the XID it comes with.
USABLE_ACTIONS: frozenset[xids.Action] = frozenset(
    {xids.Action.IGNORE, xids.Action.RESTART_APP, xids.Action.XID_154, xids.Action.WORKFLOW_XID_45}
)

#: XIDs that do not make a GPU unhealthy by default: the catalog's XIDs whose immediate action is
#: in :data:`USABLE_ACTIONS`. Every other XID in the valid range does (an XID the catalog does not
#: list too). ``DP_DISABLE_HEALTHCHECKS`` adds to this set; ``DP_ENABLE_HEALTHCHECKS`` overrides it.
DEFAULT_IGNORED_XIDS: frozenset[int] = frozenset(
    code for code, entry in xids.CATALOG.items() if entry.action in USABLE_ACTIONS
)

#: XIDs NVIDIA's device plugin ignores by default (``internal/rm/health.go``), for comparison.
NVIDIA_PLUGIN_IGNORED_XIDS: frozenset[int] = frozenset({13, 31, 43, 45, 68, 109})

# NVML_GPU_RECOVERY_ACTION_* values and the names we report them under.
RECOVERY_ACTIONS: dict[int, str] = {
    0: "none",
    1: "gpu_reset",
    2: "node_reboot",
    3: "drain_p2p",
    4: "drain_and_reset",
    5: "recover_imex_domain",
    6: "bus_reset",
    7: "system_reboot",
}

XID = "xid"
ECC_DBE = "ecc_dbe"
LOST = "lost"
RECOVERY = "recovery_action"
NVML_ERROR = "nvml_error"
ROW_REMAP_PENDING = "row_remap_pending"
ROW_REMAP_FAILURE = "row_remap_failure"
# Conditions the driver's "no recovery action needed" signal clears.
_CLEARED_BY_RECOVERY = frozenset({XID, ECC_DBE, RECOVERY})
# Conditions cleared when the GPU answers a probe again.
_CLEARED_BY_RESPONSE = frozenset({LOST, NVML_ERROR})


@dataclass(frozen=True, slots=True)
class XidError:
    """The driver reported XID ``xid`` on this GPU."""

    xid: int


@dataclass(frozen=True, slots=True)
class DoubleBitEccError:
    """An uncorrectable (double-bit) ECC error."""


@dataclass(frozen=True, slots=True)
class GpuLost:
    """The GPU fell off the bus or stopped answering (NVML_ERROR_GPU_IS_LOST)."""


@dataclass(frozen=True, slots=True)
class RecoveryActionChanged:
    """The driver's recovery action for the GPU (an NVML_GPU_RECOVERY_ACTION_* value)."""

    action: int


@dataclass(frozen=True, slots=True)
class ProbeFailed:
    """A liveness probe failed with an NVML error other than "not supported"."""

    error: str


@dataclass(frozen=True, slots=True)
class RowRemapState:
    """The GPU's row-remapping state as last read: a remap waiting for a reset, or a failed one."""

    pending: bool
    failed: bool


@dataclass(frozen=True, slots=True)
class Responding:
    """A liveness probe succeeded: the GPU answers the driver."""


HealthEvent = (
    XidError
    | DoubleBitEccError
    | GpuLost
    | RecoveryActionChanged
    | ProbeFailed
    | RowRemapState
    | Responding
)


class HealthCheckSpecError(ValueError):
    """A DP_DISABLE_HEALTHCHECKS / DP_ENABLE_HEALTHCHECKS value could not be parsed."""


@dataclass(frozen=True, slots=True)
class HealthPolicy:
    """Which checks are active, parsed from NVIDIA's two environment knobs.

    ``DP_DISABLE_HEALTHCHECKS``: ``all`` disables every check, ``xids`` disables XID checks, numbers
    add XIDs to the ignore list. ``DP_ENABLE_HEALTHCHECKS``: same syntax; what it names is checked
    even when disabled or ignored by default. Explicitly enabled beats disabled beats default.
    """

    all_disabled: bool = False
    xids_disabled: bool = False
    all_enabled: bool = False
    ignored_xids: frozenset[int] = DEFAULT_IGNORED_XIDS
    enabled_xids: frozenset[int] = frozenset()

    @classmethod
    def from_env_values(cls, disable: str, enable: str) -> HealthPolicy:
        """Parse the two knobs; raises :class:`HealthCheckSpecError` naming a bad entry."""
        dis_all, dis_xids, dis_numbers = _parse_spec("DP_DISABLE_HEALTHCHECKS", disable)
        en_all, en_xids, en_numbers = _parse_spec("DP_ENABLE_HEALTHCHECKS", enable)
        return cls(
            all_disabled=dis_all,
            xids_disabled=dis_xids,
            all_enabled=en_all or en_xids,
            ignored_xids=DEFAULT_IGNORED_XIDS | dis_numbers,
            enabled_xids=en_numbers,
        )

    def checks_xid(self, xid: int) -> bool:
        """Whether XID ``xid`` makes a GPU unhealthy (never for a value outside the XID range)."""
        if not xids.is_valid(xid):
            return False
        if xid in self.enabled_xids or self.all_enabled:
            return True
        if self.all_disabled or self.xids_disabled:
            return False
        return xid not in self.ignored_xids

    @property
    def checks_device(self) -> bool:
        """Whether non-XID checks (ECC, lost GPU, recovery action) are active."""
        return self.all_enabled or not self.all_disabled

    @property
    def event_mask_wanted(self) -> bool:
        """Whether the driver's event stream is needed at all."""
        return self.checks_device or bool(self.enabled_xids) or not self.xids_disabled

    def apply(self, health: GpuHealth, event: HealthEvent) -> GpuHealth:
        """The GPU's health after ``event``; the same object when nothing changes."""
        match event:
            case XidError(xid=xid):
                if not self.checks_xid(xid):
                    return health
                return _with(_without(health, {XID}), Condition(XID, str(xid)))
            case DoubleBitEccError():
                return _with(health, Condition(ECC_DBE)) if self.checks_device else health
            case GpuLost():
                return _with(health, Condition(LOST)) if self.checks_device else health
            case ProbeFailed(error=error):
                if not self.checks_device:
                    return health
                return _with(_without(health, {NVML_ERROR}), Condition(NVML_ERROR, error))
            case RecoveryActionChanged(action=0):
                return _without(health, _CLEARED_BY_RECOVERY)
            case RecoveryActionChanged(action=action):
                if not self.checks_device:
                    return health
                name = RECOVERY_ACTIONS.get(action, str(action))
                return _with(_without(health, {RECOVERY}), Condition(RECOVERY, name))
            case RowRemapState(pending=pending, failed=failed):
                if not self.checks_device:
                    return health
                updated = _without(health, {ROW_REMAP_PENDING, ROW_REMAP_FAILURE})
                if pending:
                    updated = _with(updated, Condition(ROW_REMAP_PENDING))
                if failed:
                    updated = _with(updated, Condition(ROW_REMAP_FAILURE))
                return health if set(updated.conditions) == set(health.conditions) else updated
            case Responding():
                return _without(health, _CLEARED_BY_RESPONSE)


def record_event(gpu: Gpu, event: HealthEvent, policy: HealthPolicy) -> Gpu:
    """``gpu`` after ``event``: new health, and XID bookkeeping for metrics."""
    health = policy.apply(gpu.health, event)
    if isinstance(event, XidError):
        counts = dict(gpu.xid_counts)
        counts[event.xid] = counts.get(event.xid, 0) + 1
        return replace(gpu, health=health, xid_counts=MappingProxyType(counts), last_xid=event.xid)
    if health is gpu.health:
        return gpu
    return replace(gpu, health=health)


def _with(health: GpuHealth, condition: Condition) -> GpuHealth:
    if condition in health.conditions:
        return health
    return GpuHealth((*health.conditions, condition))


def _without(health: GpuHealth, kinds: set[str] | frozenset[str]) -> GpuHealth:
    kept = tuple(c for c in health.conditions if c.kind not in kinds)
    return health if len(kept) == len(health.conditions) else GpuHealth(kept)


def _parse_spec(name: str, value: str) -> tuple[bool, bool, frozenset[int]]:
    everything = False
    xids = False
    numbers: set[int] = set()
    for raw in value.split(","):
        item = raw.strip().lower()
        if not item:
            continue
        if item == "all":
            everything = True
        elif item == "xids":
            xids = True
        elif item.isascii() and item.isdigit():
            numbers.add(int(item))
        else:
            raise HealthCheckSpecError(f"{name}: {raw.strip()!r} is not 'all', 'xids' or an XID")
    return everything, xids, frozenset(numbers)
