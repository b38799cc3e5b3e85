"""Consumable capacity (KEP-5075) as the API server validates it on a ResourceSlice's device
(``pkg/apis/resource/validation``: ``validateMultiAllocatableDeviceCapacity`` and its helpers,
read, not copied), for the API-server stand-in: a ``requestPolicy`` only on a device with
``allowMultipleAllocations``; at most one of ``validValues`` and ``validRange``, either with a
``default``; a range's ``min`` required, within the capacity, at most its ``max``, at most the
``default``; its ``max`` and the ``default`` within the capacity; ``min`` plus a ``step`` within
the capacity, and the ``default`` and ``max`` whole steps above ``min``; valid values sorted,
within the capacity, at most 10, the default among them.

Quantities are read here on their own (not with the agent's parser), so the check does not take
the agent's word for what a quantity means.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from fractions import Fraction
from typing import Any

__all__ = ["capacity_errors", "quantity_value"]

_NUMBER = re.compile(r"([+-]?(?:\d+(?:\.\d*)?|\.\d+))(.*)")
_SUFFIXES = {
    "": Fraction(1), "Ki": Fraction(2**10), "Mi": Fraction(2**20), "Gi": Fraction(2**30),
    "Ti": Fraction(2**40), "Pi": Fraction(2**50), "Ei": Fraction(2**60),
    "n": Fraction(1, 10**9), "u": Fraction(1, 10**6), "m": Fraction(1, 1000), "k": Fraction(1000),
    "M": Fraction(10**6), "G": Fraction(10**9), "T": Fraction(10**12), "P": Fraction(10**15),
    "E": Fraction(10**18),
}  # fmt: skip


def quantity_value(text: object) -> Fraction:
    """A quantity's value; :class:`ValueError` when ``text`` is not one."""
    found = _NUMBER.fullmatch(str(text))
    if found is None:
        raise ValueError(f"{text!r} is not a quantity")
    number, suffix = Fraction(found[1]), found[2]
    if suffix in _SUFFIXES:
        return number * _SUFFIXES[suffix]
    if re.fullmatch(r"[eE][+-]?\d+", suffix):
        return number * Fraction(10) ** int(suffix[1:])
    raise ValueError(f"{text!r} is not a quantity")


def capacity_errors(at: str, device: Mapping[str, Any]) -> list[str]:
    """What the API server finds wrong with ``device``'s capacities (``at``: its path)."""
    multiple = device.get("allowMultipleAllocations") is True
    errors: list[str] = []
    for name, capacity in (device.get("capacity") or {}).items():
        policy = capacity.get("requestPolicy")
        if policy is None:
            continue
        where = f"{at}.capacity[{name}].requestPolicy"
        if not multiple:
            errors.append(f"{where}: allowMultipleAllocations must be true")
            continue
        try:
            errors += _policy_errors(where, quantity_value(capacity.get("value")), policy)
        except ValueError as exc:
            errors.append(f"{where}: {exc}")
    return errors


def _policy_errors(at: str, value: Fraction, policy: Mapping[str, Any]) -> list[str]:
    values, valid = policy.get("validValues"), policy.get("validRange")
    if values and valid is not None:
        return [f"{at}: validValues and validRange cannot both be set"]
    if not values and not isinstance(valid, Mapping):
        return []
    if policy.get("default") is None:
        return [f"{at}.default: required with validValues or validRange"]
    default = quantity_value(policy["default"])
    if values or not isinstance(valid, Mapping):
        return _values_errors(at, value, default, [quantity_value(v) for v in values or ()])
    return _range_errors(at, value, default, valid)


def _values_errors(
    at: str, value: Fraction, default: Fraction, values: list[Fraction]
) -> list[str]:
    errors = []
    if len(values) > 10:
        errors.append(f"{at}.validValues: more than 10")
    if values != sorted(values) or len(set(values)) != len(values):
        errors.append(f"{at}.validValues: not sorted in ascending order, or repeated")
    if any(v > value for v in values):
        errors.append(f"{at}.validValues: an option larger than the capacity")
    if default not in values:
        errors.append(f"{at}.validValues: the default is not among them")
    return errors


def _range_errors(
    at: str, value: Fraction, default: Fraction, valid: Mapping[str, Any]
) -> list[str]:
    if valid.get("min") is None:
        return [f"{at}.validRange.min: required"]
    low = quantity_value(valid["min"])
    errors = []
    if low > value:
        errors.append(f"{at}.validRange.min: larger than the capacity")
    if default < low:
        errors.append(f"{at}.validRange.min: the default is less than min")
    high = quantity_value(valid["max"]) if valid.get("max") is not None else None
    if high is not None and (low > high or high > value or default > high):
        errors.append(f"{at}.validRange.max: below min, above the capacity, or below the default")
    if valid.get("step") is not None:
        step = quantity_value(valid["step"])
        if low + step > value:
            errors.append(f"{at}.validRange.step: one step above min is larger than the capacity")
        for name, amount in (("default", default), ("max", high)):
            if amount is not None and step and (int(amount) - int(low)) % int(step) != 0:
                errors.append(f"{at}.validRange.step: the {name} is not a whole step from min")
    return errors
