"""Time-slicing (``sharing.timeSlicing``): which devices are replicated, how often, under what name.

The rules follow NVIDIA's k8s-device-plugin, with its users' open requests answered: several
rules may name one resource with their own replica counts (per-GPU counts, NVIDIA #1786), and a
rule may ``rename`` its replicas (NVIDIA strips the key at load, #353).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from gpuagent.domain.devices import Device
from gpuagent.domain.errors import ResourceError, SettingError
from gpuagent.domain.naming import SHARED_SUFFIX, annotated_id, resource_name

__all__ = ["MAX_REPLICAS", "MIN_REPLICAS", "ReplicaRule", "TimeSlicing"]

MIN_REPLICAS = 2  # NVIDIA: "number of replicas must be >= 2"
MAX_REPLICAS = 1024  # keeps a ListAndWatch message far below gRPC's 4 MiB default
KEY = "sharing.timeSlicing"

_GPU_INDEX = re.compile(r"\d+")
_MIG_INDEX = re.compile(r"\d+:\d+")


@dataclass(frozen=True, slots=True)
class ReplicaRule:
    """One entry of ``sharing.timeSlicing.resources``.

    ``devices`` is ``"all"``, a count (the first N devices by index), or a tuple of references:
    GPU index ``"0"``, MIG index ``"0:1"``, GPU UUID or MIG UUID. On a MIG resource a GPU index or
    UUID names every MIG device of that GPU. Several rules may name one resource, each with its
    own ``replicas``: listed devices are matched first come, first served; ``"all"`` and a count
    take the devices earlier rules left. ``rename`` overrides ``renameByDefault`` for this rule.
    """

    name: str
    replicas: int
    devices: str | int | tuple[str, ...] = "all"
    rename: str = ""


@dataclass(frozen=True, slots=True)
class TimeSlicing:
    """``sharing.timeSlicing``, validated and normalised on construction (resource names get
    ``nvidia.com/`` when they lack a domain); a :class:`SettingError` names the offending key.

    The same rules replicate MPS's devices (:class:`gpuagent.domain.mps.MpsSharing`): ``key``
    is where they were written, for the errors.
    """

    resources: tuple[ReplicaRule, ...] = ()
    rename_by_default: bool = False
    fail_requests_greater_than_one: bool = False
    key: str = field(default=KEY, compare=False, repr=False)

    def __post_init__(self) -> None:
        rules = tuple(
            _check_rule(rule, f"{self.key}.resources[{i}]") for i, rule in enumerate(self.resources)
        )
        object.__setattr__(self, "resources", rules)

    @property
    def enabled(self) -> bool:
        return bool(self.resources)

    def target(self, rule: ReplicaRule) -> str:
        """The name ``rule``'s replicas are advertised under."""
        if rule.rename:
            return rule.rename
        return f"{rule.name}{SHARED_SUFFIX}" if self.rename_by_default else rule.name

    def names(self) -> set[str]:
        """Every resource name the rules mention: the replicated ones and their targets."""
        return {rule.name for rule in self.resources} | {self.target(r) for r in self.resources}

    def placements(self, name: str, devices: Sequence[Device]) -> list[tuple[str, Device]]:
        """Each device of resource ``name`` with the name it is advertised under: once under
        ``name`` when no rule replicates it, else once per replica (``<id>::<n>``) under the
        rule's target. Raises :class:`ResourceError` when a rule names devices that are not there.
        """
        replicated: dict[str, ReplicaRule] = {}
        for i, rule in enumerate(self.resources):
            if rule.name == name:
                for device in _select(rule, devices, set(replicated), f"{self.key}.resources[{i}]"):
                    replicated[device.uuid] = rule
        out: list[tuple[str, Device]] = []
        for device in devices:
            rule_of = replicated.get(device.uuid)
            if rule_of is None:
                out.append((name, device))
                continue
            target = self.target(rule_of)
            out.extend(
                (
                    target,
                    replace(
                        device,
                        id=annotated_id(device.id, n),
                        replica=n,
                        replicas=rule_of.replicas,
                    ),
                )
                for n in range(rule_of.replicas)
            )
        return out


def _check_rule(rule: ReplicaRule, key: str) -> ReplicaRule:
    try:
        name = resource_name(rule.name)
    except ValueError as exc:
        raise SettingError(f"{key}.name", str(exc)) from None
    replicas = rule.replicas
    if type(replicas) is not int:  # config values are untrusted: bool is not a count
        raise SettingError(f"{key}.replicas", f"expected a whole number, got {replicas!r}")
    if not MIN_REPLICAS <= replicas <= MAX_REPLICAS:
        raise SettingError(
            f"{key}.replicas", f"must be between {MIN_REPLICAS} and {MAX_REPLICAS}, got {replicas}"
        )
    devices = rule.devices
    if isinstance(devices, bool):
        raise SettingError(f"{key}.devices", f"expected 'all', a count or a list, got {devices!r}")
    if isinstance(devices, str):
        if devices != "all":
            raise SettingError(
                f"{key}.devices", f"expected 'all', a count or a list, got {devices!r}"
            )
    elif isinstance(devices, int):
        if devices < 1:
            raise SettingError(f"{key}.devices", f"a count must be at least 1, got {devices}")
    else:
        refs: tuple[object, ...] = tuple(devices)
        if not refs:
            raise SettingError(f"{key}.devices", "the list names no devices")
        for ref in refs:
            if not _is_reference(ref):
                raise SettingError(
                    f"{key}.devices",
                    f"{ref!r} is not a GPU index ('0'), MIG index ('0:1'), GPU-… or MIG-… UUID",
                )
        names = tuple(str(r) for r in refs)
        twice = sorted({r for r in names if names.count(r) > 1})
        if twice:
            raise SettingError(f"{key}.devices", f"listed more than once: {', '.join(twice)}")
        devices = names
    rename = rule.rename
    if rename:
        try:
            rename = resource_name(rename)
        except ValueError as exc:
            raise SettingError(f"{key}.rename", str(exc)) from None
    return ReplicaRule(name=name, replicas=replicas, devices=devices, rename=rename)


def _is_reference(ref: object) -> bool:
    if not isinstance(ref, str):
        return False
    return bool(
        _GPU_INDEX.fullmatch(ref)
        or _MIG_INDEX.fullmatch(ref)
        or (ref.startswith(("GPU-", "MIG-")) and len(ref) > len("GPU-"))
    )


def _select(
    rule: ReplicaRule, devices: Sequence[Device], claimed: set[str], key: str
) -> list[Device]:
    """The devices ``rule`` replicates, given those earlier rules claimed (by UUID)."""
    free = [d for d in devices if d.uuid not in claimed]
    if rule.devices == "all":
        return free
    if isinstance(rule.devices, int):
        if rule.devices > len(free):
            raise ResourceError(
                f"{key}: requested {rule.devices} devices of {rule.name} to be replicated, "
                f"but only {len(free)} are available"
            )
        return free[: rule.devices]
    chosen: dict[str, Device] = {}
    for ref in rule.devices:
        matches = [d for d in devices if _matches(ref, d)]
        if not matches:
            raise ResourceError(f"{key}: no device of {rule.name} matches {ref!r}")
        taken = [d.index for d in matches if d.uuid in claimed]
        if taken:
            raise ResourceError(
                f"{key}: {ref!r} names {', '.join(taken)}, already replicated by an earlier rule"
            )
        chosen.update((d.uuid, d) for d in matches)
    return [d for d in devices if d.uuid in chosen]


def _matches(ref: str, device: Device) -> bool:
    if _GPU_INDEX.fullmatch(ref):
        return device.gpu == int(ref)
    if _MIG_INDEX.fullmatch(ref):
        return device.index == ref
    return ref in (device.uuid, device.gpu_uuid)
