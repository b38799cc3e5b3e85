"""The /metrics renderer as its tests build it, and its text read back with prometheus_client's
parser (families, samples, the labels' order, no series twice).
"""

from __future__ import annotations

import re

from prometheus_client.parser import text_string_to_metric_families

from gpuagent.web.metrics import MetricsRenderer

DCGM_LABELS = ["gpu", "UUID", "pci_bus_id", "device", "modelName", "Hostname",
               "DCGM_FI_DRIVER_VERSION", "container", "namespace", "pod"]  # fmt: skip
MIG_LABELS = [*DCGM_LABELS[:5], "GPU_I_PROFILE", "GPU_I_ID", *DCGM_LABELS[5:]]


def renderer(**kwargs: object) -> MetricsRenderer:
    return MetricsRenderer("node-1", "1.2.3", monotonic=lambda: 130.0, wall=lambda: 1e9, **kwargs)  # type: ignore[arg-type]


def families(text: str) -> dict[str, object]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    out = []
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name:
                out.append((dict(s.labels), s.value))
    return out


def label_order(text: str, name: str) -> list[list[str]]:
    """Label names of each sample of ``name`` in the order written (the parser loses it)."""
    orders = []
    for line in text.splitlines():
        if line.startswith(name + "{"):
            orders.append(re.findall(r'(?:^|,)([A-Za-z_][A-Za-z0-9_]*)="', line[len(name) + 1 :]))
    return orders


def assert_unique_series(text: str) -> None:
    seen = set()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = (s.name, tuple(sorted(s.labels.items())))
            assert key not in seen, f"duplicate series {key}"
            seen.add(key)
