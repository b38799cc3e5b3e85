"""Attribute values as the Kubernetes API takes them: semantic versions, PCI bus IDs, DNS labels
and label values (for DRA's device attributes and taints), and quantities (a claim's consumed
capacity)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction

__all__ = ["Version", "dns_label", "label_value", "pci_bus_id", "quantity", "semver"]

_DNS_LABEL_CHARS = re.compile(r"[^a-z0-9-]+")
_LABEL_VALUE_CHARS = re.compile(r"[^A-Za-z0-9_.-]+")
_VERSION_PART = re.compile(r"\d+")
# resource.Quantity's grammar: a signed decimal, then a binary or decimal SI suffix or an exponent.
_QUANTITY = re.compile(
    r"(?P<number>[+-]?(\d+(\.\d*)?|\.\d+))"
    r"(?P<suffix>Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?\d+)?"
)
_BINARY = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}


@dataclass(frozen=True, slots=True)
class Version:
    """A semantic-version attribute value (``9.0.0``)."""

    text: str


def semver(value: str) -> Version | None:
    """``value`` (``"550.54.15"``, ``"9.0"``, ``"12.4"``) as a semver ``X.Y.Z``, or ``None``.

    Leading zeros are dropped (``535.104.05`` → ``535.104.5``): semver forbids them.
    """
    parts = value.strip().split(".")
    if not 1 <= len(parts) <= 3 or not all(_VERSION_PART.fullmatch(p) for p in parts):
        return None
    numbers = [str(int(p)) for p in parts] + ["0"] * (3 - len(parts))
    return Version(".".join(numbers))


def pci_bus_id(value: str) -> str | None:
    """NVML's bus ID (``00000000:3B:00.0``) in the standard attribute's form
    (``0000:3b:00.0``), or ``None`` when it cannot be read."""
    parts = value.strip().lower().split(":")
    if len(parts) == 2:
        parts.insert(0, "0")
    if len(parts) != 3 or "." not in parts[2]:
        return None
    device, _, function = parts[2].partition(".")
    try:
        domain, bus, dev, fn = (
            int(parts[0], 16),
            int(parts[1], 16),
            int(device, 16),
            int(function, 16),
        )
    except ValueError:
        return None
    if domain > 0xFFFF or bus > 0xFF or dev > 0x1F or fn > 0x7:
        return None
    return f"{domain:04x}:{bus:02x}:{dev:02x}.{fn:x}"


def dns_label(text: str) -> str:
    """``text`` as a DNS label: lower case, ``[a-z0-9-]``, at most 63 characters."""
    label = _DNS_LABEL_CHARS.sub("-", text.lower()).strip("-")
    return label[:63].rstrip("-") or "x"


def label_value(text: str) -> str:
    """``text`` as a label value: ``[A-Za-z0-9_.-]``, at most 63 characters, alphanumeric ends."""
    value = _LABEL_VALUE_CHARS.sub("_", text)[:63]
    return value.strip("_.-")


def quantity(text: str) -> Fraction:
    """A Kubernetes quantity (``16Gi``, ``81559Mi``, ``25``, ``500m``, ``1e3``) as an exact
    number; raises :class:`ValueError` for text that is not one."""
    found = _QUANTITY.fullmatch(text.strip())
    if found is None:
        raise ValueError(f"{text!r} is not a Kubernetes quantity")
    number, suffix = Fraction(found["number"]), found["suffix"] or ""
    if suffix in _BINARY:
        return number * Fraction(1024) ** _BINARY[suffix]
    if suffix in _DECIMAL:
        return number * Fraction(10) ** _DECIMAL[suffix]
    if suffix:
        return number * Fraction(10) ** int(suffix[1:])
    return number
