"""docs/architecture.md's recipes for a metric family and a health check, walked with the code
they show (run as the page has it), so a recipe that no longer fits the code fails here.

"How to add a setting" is walked by tests/config/test_groups.py.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.metricsdoc import table_rows
from support.promtool import check_metrics
from support.synthetic import synthetic_snapshot

from gpuagent.domain import health
from gpuagent.domain.devices import Condition, Gpu, GpuHealth
from gpuagent.domain.dra import Effect, taints
from gpuagent.domain.health import HealthPolicy, record_event
from gpuagent.domain.nodehealth import condition_report, project
from gpuagent.domain.snapshot import Snapshot
from gpuagent.state.counters import AgentCounters
from gpuagent.web import metrics
from gpuagent.web.exposition import Family, render
from gpuagent.web.gpufamilies import health_families
from gpuagent.web.metrics import MetricsRenderer

ROOT = Path(__file__).resolve().parent.parent
SERVED = ("nvidia.com/gpu",)


def recipe(title: str) -> list[str]:
    """The code blocks of docs/architecture.md's section ``## title``, in order."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)


def page_families(text: str) -> list[str]:
    return re.findall(r"^# TYPE (\S+) ", text, re.MULTILINE)


def samples(text: str, name: str) -> dict[str, float]:
    """``name``'s samples by their ``gpu`` label."""
    return {
        s.labels["gpu"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    }


def failing(snapshot: Snapshot, index: int, *conditions: Condition) -> Snapshot:
    gpus = tuple(
        replace(g, health=GpuHealth(conditions)) if g.index == index else g for g in snapshot.gpus
    )
    return replace(snapshot, gpus=gpus)


# ----- How to add a metric family ----------------------------------------------------------------
@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> str:
    """Steps 1 and 2: the recipe's family, yielded with the device part after the health
    families (as the step adds it to ``_render_device_chunks``); the family's name."""
    (block,) = recipe("How to add a metric family")
    namespace: dict[str, Any] = {"Family": Family, "render": render, "Snapshot": Snapshot}
    exec(block, namespace)
    family = namespace["condition_count_families"]
    monkeypatch.setattr(metrics, "health_families", lambda s: health_families(s) + family(s))
    (name,) = re.findall(r'"(gpuagent_\w+)"', block)
    return str(name)


def test_a_new_family_is_on_the_page_where_the_recipe_puts_it(counted: str) -> None:
    snapshot = failing(synthetic_snapshot(2), 1, Condition("lost"), Condition("xid", "79"))
    renderer = MetricsRenderer("node-1", "1.2.3")
    text = renderer.render(snapshot, AgentCounters())
    assert samples(text, counted) == {"0": 0.0, "1": 2.0}
    device_part = renderer.devices(snapshot).text.decode()
    assert counted in page_families(device_part)  # cached per snapshot version with the GPUs'
    families = page_families(text)
    assert families.index(counted) == families.index("gpuagent_gpu_condition") + 1
    assert len(families) == len(set(families))


def test_a_new_family_passes_the_exposition_checks(counted: str) -> None:
    snapshot = failing(synthetic_snapshot(2), 0, Condition("lost"))
    text = MetricsRenderer("node-1", "1.2.3").render(snapshot, AgentCounters())
    own = "".join(line + "\n" for line in text.splitlines() if "gpuagent_" in line)
    assert f"# TYPE {counted} gauge\n" in own
    result = check_metrics(own)
    assert result.returncode == 0, result.stderr + result.stdout
    assert result.stderr.strip() == ""


def test_a_new_family_needs_its_row_in_the_metrics_doc(counted: str) -> None:
    """Step 3: the page now has a family docs/metrics.md has no row for, which is what
    tests/web/test_metrics_doc.py fails on."""
    text = MetricsRenderer("node-1", "1.2.3").render(synthetic_snapshot(2), AgentCounters())
    assert set(page_families(text)) - set(table_rows()) == {counted}


# ----- How to add a health check -----------------------------------------------------------------
@pytest.fixture
def check() -> tuple[type[HealthPolicy], type[Any], str]:
    """Steps 1 and 2: the recipe's event and condition, and a policy with its ``case`` in
    ``apply`` (a subclass here, the other events left to the policy as it is)."""
    event_block, case_block = recipe("How to add a health check")
    namespace: dict[str, Any] = {
        "__name__": __name__,  # where the dataclass machinery looks its module up
        "dataclass": dataclass,
        "Condition": Condition,
        "HealthPolicy": HealthPolicy,
        "_with": health._with,
        "_without": health._without,
    }
    exec(event_block, namespace)
    exec(
        "class WithPagesPending(HealthPolicy):\n"
        "    def apply(self, health, event):\n"
        "        match event:\n"
        f"{case_block}"
        "        return HealthPolicy.apply(self, health, event)\n",
        namespace,
    )
    return namespace["WithPagesPending"], namespace["PagesPending"], namespace["PAGES_PENDING"]


def test_a_gpu_turns_unhealthy_with_the_new_reason(
    check: tuple[type[HealthPolicy], type[Any], str],
) -> None:
    policy_type, event, kind = check
    policy = policy_type()
    snapshot = synthetic_snapshot(2)
    gpu: Gpu = record_event(snapshot.gpus[1], event(pending=True), policy)
    assert gpu.health.conditions == (Condition(kind),)
    assert gpu.overall_health.kubelet_health == "Unhealthy"
    assert record_event(gpu, event(pending=True), policy) is gpu  # nothing new
    assert record_event(gpu, event(pending=False), policy).overall_health.healthy
    healthy = snapshot.gpus[0]
    assert record_event(healthy, event(pending=False), policy) is healthy
    other = record_event(gpu, health.Responding(), policy)  # the policy's own events still apply
    assert other.health.conditions == (Condition(kind),)


def test_the_new_reason_reaches_metrics_dra_and_the_node_condition(
    check: tuple[type[HealthPolicy], type[Any], str],
) -> None:
    policy_type, event, kind = check
    snapshot = synthetic_snapshot(2)
    sick = record_event(snapshot.gpus[1], event(pending=True), policy_type())
    snapshot = replace(snapshot, gpus=(snapshot.gpus[0], sick))
    text = MetricsRenderer("node-1", "1.2.3").render(snapshot, AgentCounters())
    assert samples(text, "gpuagent_gpu_healthy") == {"0": 1.0, "1": 0.0}
    (reason,) = [
        s.labels
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "gpuagent_gpu_condition"
    ]
    assert (reason["gpu"], reason["condition"]) == ("1", kind)
    (taint,) = taints(sick.health, "gpu.nvidia.com")
    assert (taint.key, taint.effect) == ("gpu.nvidia.com/retired-pages-pending", Effect.NO_SCHEDULE)
    view = project(snapshot, SERVED)
    assert view is not None
    report = condition_report(view, {})
    assert (report.status, report.reason) == ("False", "GPUUnhealthy")  # not ranked in REASONS
    assert kind in report.message


def test_the_new_check_gives_way_to_the_healthchecks_knob(
    check: tuple[type[HealthPolicy], type[Any], str],
) -> None:
    policy_type, event, _ = check
    off = policy_type.from_env_values("all", "")
    assert isinstance(off, policy_type)
    gpu = synthetic_snapshot(1).gpus[0]
    assert record_event(gpu, event(pending=True), off) is gpu
