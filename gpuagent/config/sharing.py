"""NVIDIA's ``sharing`` block (``timeSlicing`` and ``mps``) to and from the domain's
:class:`~gpuagent.domain.sharing.Sharing`.

Both blocks have NVIDIA's ``ReplicatedResources`` shape: ``renameByDefault``,
``failRequestsGreaterThanOne`` and ``resources: [{name, replicas, devices, rename}]``.
``failRequestsGreaterThanOne`` defaults to false for time-slicing and to true for MPS (NVIDIA's
``NewConfig``).
"""

from __future__ import annotations

from collections.abc import Mapping

from gpuagent.domain.errors import SettingError
from gpuagent.domain.sharing import MpsSharing, Sharing
from gpuagent.domain.timeslicing import ReplicaRule, TimeSlicing

__all__ = ["parse_sharing", "sharing_block"]

_BLOCKS = ("timeSlicing", "mps")
_FLAGS = ("renameByDefault", "failRequestsGreaterThanOne")


def parse_sharing(sharing: Mapping[str, object]) -> Sharing:
    """NVIDIA's ``sharing`` block (``{timeSlicing: {...}}`` or ``{mps: {...}}``) as the domain's
    :class:`Sharing`.

    Raises :class:`SettingError` naming the key (``sharing.mps.resources[1].replicas``).
    """
    unknown = set(sharing) - set(_BLOCKS)
    if unknown:
        raise SettingError(
            "sharing", f"unknown keys {sorted(map(str, unknown))} (known: timeSlicing, mps)"
        )
    ts_rules, ts_flags = _replicated(sharing.get("timeSlicing"), "sharing.timeSlicing", False)
    mps_rules, mps_flags = _replicated(sharing.get("mps"), "sharing.mps", True)
    return Sharing(
        time_slicing=TimeSlicing(
            resources=ts_rules,
            rename_by_default=ts_flags[0],
            fail_requests_greater_than_one=ts_flags[1],
        ),
        mps=MpsSharing(
            resources=mps_rules,
            rename_by_default=mps_flags[0],
            fail_requests_greater_than_one=mps_flags[1],
        ),
    )


def _replicated(
    block: object, key: str, fail_by_default: bool
) -> tuple[tuple[ReplicaRule, ...], tuple[bool, bool]]:
    """One ``ReplicatedResources`` block: its rules, and ``(renameByDefault,
    failRequestsGreaterThanOne)``."""
    if block is None:
        block = {}
    if not isinstance(block, Mapping):
        raise SettingError(key, "expected a mapping")
    unknown = set(block) - {*_FLAGS, "resources"}
    if unknown:
        raise SettingError(key, f"unknown keys {sorted(map(str, unknown))}")
    entries = block.get("resources")
    if entries is None:
        entries = []
    if not isinstance(entries, list):
        raise SettingError(f"{key}.resources", "expected a list")
    rules = tuple(_rule(entry, f"{key}.resources[{i}]") for i, entry in enumerate(entries))
    flags = []
    for name, default in zip(_FLAGS, (False, fail_by_default), strict=True):
        value = block.get(name, default)
        if not isinstance(value, bool):
            raise SettingError(f"{key}.{name}", f"expected true or false, got {value!r}")
        flags.append(value)
    return rules, (flags[0], flags[1])


def _rule(entry: object, where: str) -> ReplicaRule:
    if not isinstance(entry, Mapping):
        raise SettingError(where, "expected a mapping {name, replicas, devices, rename}")
    extra = set(entry) - {"name", "replicas", "devices", "rename"}
    if extra:
        raise SettingError(where, f"unknown keys {sorted(map(str, extra))}")
    name, replicas = entry.get("name"), entry.get("replicas")
    rename, devices = entry.get("rename", ""), entry.get("devices", "all")
    if not isinstance(name, str):
        raise SettingError(f"{where}.name", "a resource name is required")
    if isinstance(replicas, bool) or not isinstance(replicas, int):
        raise SettingError(f"{where}.replicas", f"expected a whole number, got {replicas!r}")
    if not isinstance(rename, str):
        raise SettingError(f"{where}.rename", f"expected a resource name, got {rename!r}")
    if isinstance(devices, list):
        if not all(isinstance(d, str | int) and not isinstance(d, bool) for d in devices):
            raise SettingError(f"{where}.devices", "expected indexes or UUIDs")
        devices = tuple(str(d) for d in devices)
    elif isinstance(devices, bool) or not isinstance(devices, str | int):
        raise SettingError(f"{where}.devices", f"expected all, a count or a list: {devices!r}")
    return ReplicaRule(name=name, replicas=replicas, devices=devices, rename=rename)


def sharing_block(sharing: Sharing) -> dict[str, object]:
    """:class:`Sharing` as NVIDIA's ``sharing`` block (``{}`` when nothing is shared)."""
    out: dict[str, object] = {}
    if sharing.time_slicing != TimeSlicing():
        ts = sharing.time_slicing
        out["timeSlicing"] = _block(
            ts.resources, ts.rename_by_default, ts.fail_requests_greater_than_one
        )
    if sharing.mps != MpsSharing():
        mps = sharing.mps
        out["mps"] = _block(
            mps.resources, mps.rename_by_default, mps.fail_requests_greater_than_one
        )
    return out


def _block(
    resources: tuple[ReplicaRule, ...], rename_by_default: bool, fail_requests: bool
) -> dict[str, object]:
    rules = []
    for rule in resources:
        entry: dict[str, object] = {"name": rule.name, "replicas": rule.replicas}
        if rule.devices != "all":
            entry["devices"] = (
                list(rule.devices) if isinstance(rule.devices, tuple) else rule.devices
            )
        if rule.rename:
            entry["rename"] = rule.rename
        rules.append(entry)
    return {
        "renameByDefault": rename_by_default,
        "failRequestsGreaterThanOne": fail_requests,
        "resources": rules,
    }
