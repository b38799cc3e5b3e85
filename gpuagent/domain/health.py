"""Health policy: which evidence about a GPU makes it unhealthy, and which brings it back.

Health comes from evidence about the GPU, never from metrics (the table is docs/health.md):

- an XID event the policy checks (the XID catalog's immediate action, NVIDIA's two knobs);
- a double-bit ECC event; the GPU reported lost (``NVML_ERROR_GPU_IS_LOST`` from any call);
- the driver's recovery action (``NVML_FI_DEV_GET_GPU_RECOVERY_ACTION``) other than "none";
- a pending or failed row remap;
- the designated liveness check failing or hanging :attr:`HealthPolicy.liveness_strikes` times
  in a row (one bad reading is not a verdict).

A condition's detail is fixed for as long as the condition holds (it is a label value of
``gpuagent_gpu_condition``): a GPU that keeps failing its liveness check stays ``unresponsive``
with the failure it was first judged by.

Every other NVML error leaves a reading absent and never reaches this module.

The policy is a pure state machine over :class:`~gpuagent.domain.devices.GpuHealth`: each
:data:`HealthEvent` adds or clears conditions, and a GPU is healthy exactly when none is active.
Unhealthy is not forever, on every driver:

- the recovery action reading "none" again clears XID, ECC and recovery-action conditions
  (drivers with the field, R565 and newer);
- evidence of a reset clears XID and ECC conditions: a lost GPU that answers again, or a volatile
  ECC counter that went back (:class:`GpuReset`) — drivers without the field recover this way;
- a GPU that answers the liveness check again is no longer lost or unresponsive;
- a row-remap reading without a pending or failed remap clears those conditions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from types import MappingProxyType

from gpuagent.domain import xids
from gpuagent.domain.devices import Condition, Gpu, GpuHealth, MigDevice

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

#: Failed or hung liveness checks in a row that make a GPU unresponsive.
LIVENESS_STRIKES = 3

# NVML_GPU_RECOVERY_ACTION_* values and the names we report them under.
RECOVERY_NONE = 0
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
UNRESPONSIVE = "unresponsive"
DISCOVERY = "discovery"
ROW_REMAP_PENDING = "row_remap_pending"
ROW_REMAP_FAILURE = "row_remap_failure"
# Conditions the driver's "no recovery action needed" clears.
_CLEARED_BY_RECOVERY = frozenset({XID, ECC_DBE, RECOVERY})
# Conditions a reset clears.
_CLEARED_BY_RESET = frozenset({XID, ECC_DBE})
# Conditions cleared when the GPU answers the liveness check again.
_CLEARED_BY_RESPONSE = frozenset({LOST, UNRESPONSIVE})


@dataclass(frozen=True, slots=True)
class XidError:
    """The driver reported XID ``xid``; on a MIG instance when the instance IDs are set.

    ``gpu_instance``/``compute_instance`` are ``None`` when the event names no instance (NVML's
    ``0xFFFFFFFF``): the whole GPU. ``compute_instance`` ``None`` with a GPU instance: every
    compute instance of that GPU instance.
    """

    xid: int
    gpu_instance: int | None = None
    compute_instance: int | None = None


@dataclass(frozen=True, slots=True)
class DoubleBitEccError:
    """An uncorrectable (double-bit) ECC error."""


@dataclass(frozen=True, slots=True)
class GpuLost:
    """The GPU fell off the bus (NVML_ERROR_GPU_IS_LOST from any call)."""


@dataclass(frozen=True, slots=True)
class RecoveryActionChanged:
    """The driver's recovery action for the GPU (an NVML_GPU_RECOVERY_ACTION_* value), as read."""

    action: int


@dataclass(frozen=True, slots=True)
class RowRemapState:
    """The GPU's row-remapping state as last read: a remap waiting for a reset, or a failed one."""

    pending: bool
    failed: bool


@dataclass(frozen=True, slots=True)
class LivenessFailed:
    """The designated liveness check failed (an NVML error) or did not return in time, once."""

    error: str


@dataclass(frozen=True, slots=True)
class Responding:
    """The liveness check succeeded: the GPU answers the driver."""


@dataclass(frozen=True, slots=True)
class GpuReset:
    """Evidence that the GPU was reset since the last reading (a volatile ECC counter went back)."""


HealthEvent = (
    XidError
    | DoubleBitEccError
    | GpuLost
    | RecoveryActionChanged
    | RowRemapState
    | LivenessFailed
    | Responding
    | GpuReset
)


class HealthCheckSpecError(ValueError):
    """A DP_DISABLE_HEALTHCHECKS / DP_ENABLE_HEALTHCHECKS value could not be parsed: ``knob``
    names which, ``reason`` says why (for the caller to name the setting as it was given)."""

    def __init__(self, knob: str, reason: str) -> None:
        super().__init__(f"{knob}: {reason}")
        self.knob = knob
        self.reason = reason


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
    liveness_strikes: int = LIVENESS_STRIKES

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
        """Whether non-XID checks (ECC, lost GPU, recovery action, liveness) are active."""
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
            case LivenessFailed(error=error):
                if not self.checks_device:
                    return health
                strikes = health.strikes + 1
                if strikes < self.liveness_strikes or _has(health, UNRESPONSIVE):
                    # An unresponsive GPU stays so with the detail it was judged by: the reason
                    # is a label value, which must not change while the condition holds.
                    return replace(health, strikes=strikes)
                return replace(_with(health, Condition(UNRESPONSIVE, error)), strikes=strikes)
            case Responding():
                was_lost = _has(health, LOST)
                cleared = _CLEARED_BY_RESPONSE | (_CLEARED_BY_RESET if was_lost else frozenset())
                updated = _without(health, cleared)
                return replace(updated, strikes=0) if updated.strikes else updated
            case GpuReset():
                return _without(health, _CLEARED_BY_RESET)


#: Events that concern every MIG device of the GPU as well as the GPU (they clear conditions).
_WHOLE_GPU_CLEARING = (RecoveryActionChanged, Responding, GpuReset)


def record_event(gpu: Gpu, event: HealthEvent, policy: HealthPolicy) -> Gpu:
    """``gpu`` after ``event``: new health (its own or its MIG devices'), XID bookkeeping.

    An XID that names a MIG instance marks only the MIG devices of that GPU instance (and compute
    instance, when named); one that names none, or an instance the GPU does not have, marks the
    whole GPU, as NVIDIA's plugin does. Every XID is counted on the GPU, checked or not.
    """
    if isinstance(event, XidError):
        gpu = _counted(gpu, event.xid)
        targets = _instances(gpu, event)
        if targets:
            return _map_migs(gpu, lambda m: m in targets, lambda h: policy.apply(h, event))
    health = policy.apply(gpu.health, event)
    if health is not gpu.health:
        gpu = replace(gpu, health=health)
    if isinstance(event, _WHOLE_GPU_CLEARING) and gpu.mig_devices:
        gpu = _map_migs(gpu, lambda m: True, lambda h: policy.apply(h, event))
    return gpu


def _counted(gpu: Gpu, xid: int) -> Gpu:
    counts = dict(gpu.xid_counts)
    counts[xid] = counts.get(xid, 0) + 1
    return replace(gpu, xid_counts=MappingProxyType(counts), last_xid=xid)


def _instances(gpu: Gpu, event: XidError) -> tuple[MigDevice, ...]:
    if event.gpu_instance is None or not gpu.mig_devices:
        return ()
    return tuple(
        m
        for m in gpu.mig_devices
        if m.gpu_instance_id == event.gpu_instance
        and (event.compute_instance is None or m.compute_instance_id == event.compute_instance)
    )


def _map_migs(
    gpu: Gpu, chosen: Callable[[MigDevice], bool], change: Callable[[GpuHealth], GpuHealth]
) -> Gpu:
    migs = []
    changed = False
    for mig in gpu.mig_devices:
        health = change(mig.health) if chosen(mig) else mig.health
        if health is not mig.health:
            changed = True
            migs.append(replace(mig, health=health))
        else:
            migs.append(mig)
    return replace(gpu, mig_devices=tuple(migs)) if changed else gpu


def _has(health: GpuHealth, kind: str) -> bool:
    return any(c.kind == kind for c in health.conditions)


def _with(health: GpuHealth, condition: Condition) -> GpuHealth:
    if condition in health.conditions:
        return health
    return replace(health, conditions=(*health.conditions, condition))


def _without(health: GpuHealth, kinds: set[str] | frozenset[str]) -> GpuHealth:
    kept = tuple(c for c in health.conditions if c.kind not in kinds)
    return health if len(kept) == len(health.conditions) else replace(health, conditions=kept)


def _parse_spec(name: str, value: str) -> tuple[bool, bool, frozenset[int]]:
    everything = False
    xid_checks = False
    numbers: set[int] = set()
    for raw in value.split(","):
        item = raw.strip().lower()
        if not item:
            continue
        if item == "all":
            everything = True
        elif item == "xids":
            xid_checks = True
        elif item.isascii() and item.isdigit():
            numbers.add(int(item))
        else:
            raise HealthCheckSpecError(name, f"{raw.strip()!r} is not 'all', 'xids' or an XID")
    return everything, xid_checks, frozenset(numbers)
