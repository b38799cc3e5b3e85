"""Prometheus text format 0.0.4, written by hand (several times faster than prometheus_client).

Rules (prometheus/docs ``exposition_formats.md``): one ``# HELP`` and one ``# TYPE`` line per family
before its samples, a family's samples in one uninterrupted group, label values with ``\\``, ``"``
and newline escaped, HELP text with ``\\`` and newline escaped, every line ending in ``\\n``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

Labels = Sequence[tuple[str, str]]
T = TypeVar("T")
Single = tuple[str, str, str, Callable[[T], float]]
"""A family of one unlabelled sample: name, kind, help and how to read its value from a source."""


def escape_label(value: str) -> str:
    """Escape a label value: backslash, double quote and newline."""
    if "\\" in value or '"' in value or "\n" in value:
        return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return value


def escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def format_value(value: float) -> str:
    """A sample value as Prometheus writes it: integers without a fraction, ±Inf and NaN spelled."""
    if type(value) is int:
        return str(value)
    if isinstance(value, int):
        return "1" if value else "0"  # a bool
    value = float(value)
    if value.is_integer():  # never NaN or ±Inf
        return str(int(value)) if abs(value) < 1e15 else repr(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(value)


def label_pairs(labels: Labels) -> str:
    """``k="v",k2="v2"`` (no braces), values escaped: a prefix to extend with more pairs."""
    return ",".join(f'{k}="{escape_label(v)}"' for k, v in labels)


def label_block(labels: Labels) -> str:
    if not labels:
        return ""
    return "{" + label_pairs(labels) + "}"


def header(name: str, kind: str, help_text: str) -> str:
    return f"# HELP {name} {escape_help(help_text)}\n# TYPE {name} {kind}\n"


class Family:
    """One metric family: HELP, TYPE and its samples, rendered together."""

    __slots__ = ("help", "kind", "name", "samples")

    def __init__(self, name: str, kind: str, help_text: str) -> None:
        self.name = name
        self.kind = kind
        self.help = help_text
        self.samples: list[str] = []

    def add(self, labels: Labels | str, value: float) -> None:
        """Add a sample; ``labels`` may be a pre-rendered ``{...}`` block shared by many samples."""
        block = labels if isinstance(labels, str) else label_block(labels)
        self.samples.append(f"{self.name}{block} {format_value(value)}\n")

    def add_histogram(
        self, labels: Labels, buckets: Sequence[tuple[float, int]], total: float, count: int
    ) -> None:
        """Add one histogram: cumulative ``buckets`` as (upper bound, count), then sum and count.

        The ``+Inf`` bucket is added here and always equals ``count``.
        """
        prefix = label_pairs(labels)
        sep = "," if prefix else ""
        for bound, cumulative in buckets:
            le = format_value(float(bound))
            self.samples.append(f'{self.name}_bucket{{{prefix}{sep}le="{le}"}} {cumulative}\n')
        self.samples.append(f'{self.name}_bucket{{{prefix}{sep}le="+Inf"}} {count}\n')
        block = "{" + prefix + "}" if prefix else ""
        self.samples.append(f"{self.name}_sum{block} {format_value(total)}\n")
        self.samples.append(f"{self.name}_count{block} {count}\n")

    def render(self) -> str:
        if not self.samples:
            return ""
        return header(self.name, self.kind, self.help) + "".join(self.samples)


def render(families: Iterable[Family]) -> str:
    return "".join(f.render() for f in families)


def single(name: str, kind: str, help_text: str, labels: Labels, value: float) -> Family:
    """A family of one sample."""
    family = Family(name, kind, help_text)
    family.add(labels, value)
    return family


def singles(table: Iterable[Single[T]], source: T) -> list[Family]:
    """One family of one unlabelled sample per row of ``table``, read from ``source``."""
    return [
        single(name, kind, help_text, (), read(source)) for name, kind, help_text, read in table
    ]
