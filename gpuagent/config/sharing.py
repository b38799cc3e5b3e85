"""NVIDIA's ``sharing`` block (time-slicing) to and from the domain's :class:`TimeSlicing`."""

from __future__ import annotations

from collections.abc import Mapping

from gpuagent.domain.errors import SettingError
from gpuagent.domain.timeslicing import ReplicaRule, TimeSlicing

__all__ = ["parse_sharing", "sharing_block"]


def parse_sharing(sharing: Mapping[str, object]) -> TimeSlicing:
    """NVIDIA's ``sharing`` block (``{timeSlicing: {...}}``) as the domain's :class:`TimeSlicing`.

    Raises :class:`SettingError` naming the key (``sharing.timeSlicing.resources[1].replicas``).
    """
    unknown = set(sharing) - {"timeSlicing"}
    if unknown:
        raise SettingError(
            "sharing", f"unknown keys {sorted(map(str, unknown))} (known: timeSlicing)"
        )
    block = sharing.get("timeSlicing")
    if block is None:
        block = {}
    key = "sharing.timeSlicing"
    if not isinstance(block, Mapping):
        raise SettingError(key, "expected a mapping")
    unknown = set(block) - {"renameByDefault", "failRequestsGreaterThanOne", "resources"}
    if unknown:
        raise SettingError(key, f"unknown keys {sorted(map(str, unknown))}")
    rules = []
    entries = block.get("resources")
    if entries is None:
        entries = []
    if not isinstance(entries, list):
        raise SettingError(f"{key}.resources", "expected a list")
    for i, entry in enumerate(entries):
        where = f"{key}.resources[{i}]"
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
        rules.append(ReplicaRule(name=name, replicas=replicas, devices=devices, rename=rename))
    flags = {}
    for name in ("renameByDefault", "failRequestsGreaterThanOne"):
        value = block.get(name, False)
        if not isinstance(value, bool):
            raise SettingError(f"{key}.{name}", f"expected true or false, got {value!r}")
        flags[name] = value
    return TimeSlicing(
        resources=tuple(rules),
        rename_by_default=flags["renameByDefault"],
        fail_requests_greater_than_one=flags["failRequestsGreaterThanOne"],
    )


def sharing_block(sharing: TimeSlicing) -> dict[str, object]:
    """:class:`TimeSlicing` as NVIDIA's ``sharing`` block (``{}`` when nothing is shared)."""
    if sharing == TimeSlicing():
        return {}
    rules = []
    for rule in sharing.resources:
        entry: dict[str, object] = {"name": rule.name, "replicas": rule.replicas}
        if rule.devices != "all":
            entry["devices"] = (
                list(rule.devices) if isinstance(rule.devices, tuple) else rule.devices
            )
        if rule.rename:
            entry["rename"] = rule.rename
        rules.append(entry)
    return {
        "timeSlicing": {
            "renameByDefault": sharing.rename_by_default,
            "failRequestsGreaterThanOne": sharing.fail_requests_greater_than_one,
            "resources": rules,
        }
    }
