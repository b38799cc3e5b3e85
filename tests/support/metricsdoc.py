"""docs/metrics.md read as data: its family rows and each family's documented labels, and the
label names an exposition really carries, so tests can hold the two against each other."""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["DOC", "documented_labels", "emitted_labels", "label_drift", "table_rows"]

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def table_rows() -> dict[str, list[str]]:
    """Each family's table row, as cells (an empty cell kept, an escaped ``\\|`` inside one)."""
    rows = {}
    for line in DOC.read_text(encoding="utf-8").splitlines():
        match = re.match(r"\| `((?:DCGM_FI|gpuagent)_[A-Za-z0-9_]+)` \|", line)
        if match:
            rows[match.group(1)] = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
    return rows


def documented_labels() -> dict[str, set[str]]:
    """Each family's labels as the document gives them: a ``gpuagent_`` row's Labels column
    (*GPU labels* and "likewise" spelled out), or for dcgm-exporter's families the Labels table."""
    text = DOC.read_text(encoding="utf-8")
    dcgm = set(re.findall(r"`(\w+)`", text.split("### Labels", 1)[1].split("\n### ", 1)[0]))
    (gpu_paragraph,) = re.findall(r"^\*GPU labels\* are .*?(?:\n\n)", text, re.M | re.S)
    gpu_labels = ", ".join(f"`{name}`" for name in re.findall(r"`(\w+)`", gpu_paragraph))
    out: dict[str, set[str]] = {}
    previous = ""
    for name, cells in table_rows().items():
        if name.startswith("DCGM_FI"):
            out[name] = dcgm
            continue
        cell = cells[2].replace("GPU labels", gpu_labels)
        cell = previous if cell == "likewise" else cell
        previous = cell
        out[name] = set(re.findall(r"`(\w+)`", cell))
    return out


def emitted_labels(text: str) -> dict[str, set[str]]:
    """Each family's label names in an exposition, over all its samples (counters by their
    ``_total`` name, as the document lists them)."""
    out: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        name = f"{family.name}_total" if family.type == "counter" else family.name
        name = name if name.startswith("gpuagent_") else family.name  # dcgm's keep theirs
        labels = out.setdefault(name, set())
        for sample in family.samples:
            labels.update(sample.labels)
    return out


def label_drift(text: str, *, complete: bool) -> list[str]:
    """Where the exposition ``text`` and the document disagree about a family's labels.

    Every emitted label must be documented; with ``complete`` (an exposition that shows every
    family in every shape) every documented ``gpuagent_`` label must be emitted too.
    dcgm-exporter's families share one documented list, of which each carries a part.
    """
    documented = documented_labels()
    drift = []
    for name, labels in emitted_labels(text).items():
        known = documented.get(name, set())
        if labels - known:
            drift.append(f"{name}: undocumented {sorted(labels - known)}")
        if complete and name.startswith("gpuagent_") and known - labels:
            drift.append(f"{name}: documented but not emitted {sorted(known - labels)}")
    return drift
