"""docs/architecture.md's recipes for a part, a metric family and a health check, walked with
the code they show (run as the page has it), so a recipe that no longer fits the code fails here.

"How to add a setting" is walked by tests/config/test_groups.py.
"""

from __future__ import annotations

import asyncio
import re
import sys
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, replace
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import structlog
from e2e.agentrun import RunningAgent, running_agent
from prometheus_client.parser import text_string_to_metric_families
from structlog.testing import capture_logs
from support.metricsdoc import table_rows
from support.promtool import check_metrics
from support.synthetic import synthetic_snapshot
from support.waiting import eventually

from gpuagent.app import agent
from gpuagent.app.agent import Agent
from gpuagent.app.part import Context, Part, Task
from gpuagent.config import Settings
from gpuagent.config.load import load_as
from gpuagent.config.option import Option, setting
from gpuagent.config.planning import load_simulator
from gpuagent.config.values import parse_absolute_path
from gpuagent.domain import health
from gpuagent.domain.devices import Condition, Gpu, GpuHealth
from gpuagent.domain.dra import Effect, taints
from gpuagent.domain.health import HealthPolicy, record_event
from gpuagent.domain.nodehealth import condition_report, project
from gpuagent.domain.snapshot import Snapshot
from gpuagent.logs import ProblemLog
from gpuagent.nodefiles.atomicfile import write_if_changed
from gpuagent.state.counters import AgentCounters
from gpuagent.state.store import DeviceStore
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


# ----- How to add a part ------------------------------------------------------------------------
# The part's setting, declared as "How to add a setting" says, in a subclass of Settings: the
# agent's own has no such option, and the loader and the agent take a subclass whole (load_as),
# so the part reads ``context.settings.unhealthy_file`` as it would the real field.
UNHEALTHY_FILE = Option(
    "unhealthy-file",
    parse_absolute_path,
    "the unhealthy GPUs' UUIDs, for a script",
    "FILE",
    default=None,
)


@dataclass(frozen=True, slots=True)
class WithUnhealthyFile(Settings):
    unhealthy_file: Path | None = setting(UNHEALTHY_FILE)


def recipe_module(name: str, code: str, names: Mapping[str, Any]) -> ModuleType:
    """The module ``name`` holding ``code``, after ``names``: what the module would import (its
    annotations are evaluated, so the names they use must be there too)."""
    module = ModuleType(name)
    vars(module).update(names)
    exec(compile(code, f"<docs/architecture.md: {name}>", "exec"), vars(module))
    return module


@pytest.fixture
def new_part(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """Steps 1 to 3: the projection in the domain, the loop in ``gpuagent.nodefiles`` and the
    part in ``gpuagent.app.parts``, each an importable module of the recipe's code (the part
    imports the loop's module off the loop, then from it), and the part's ``build`` put into
    ``PARTS`` after the entry the recipe puts it after; the part's module."""
    projection, loop, part, listed = recipe("How to add a part")
    domain = recipe_module("gpuagent.domain.unhealthy", projection, {"Snapshot": Snapshot})
    names = {
        "asyncio": asyncio,
        "DeviceStore": DeviceStore,
        "Path": Path,
        "ProblemLog": ProblemLog,
        "log": structlog.get_logger("gpuagent"),
        "unhealthy_gpus": domain.unhealthy_gpus,
        "write_if_changed": write_if_changed,
    }
    adapter = recipe_module("gpuagent.nodefiles.unhealthyfile", loop, names)
    names = {"Context": Context, "Mapping": Mapping, "Part": Part, "Task": Task}
    wiring = recipe_module("gpuagent.app.parts.unhealthyfile", part, names)
    for module in (domain, adapter, wiring):
        monkeypatch.setitem(sys.modules, module.__name__, module)
    entries = re.findall(r"^ +(\w+)\.build,", listed, re.MULTILINE)
    after = entries[entries.index("unhealthyfile") - 1]
    place = 1 + [b.__module__ for b in agent.PARTS].index(f"gpuagent.app.parts.{after}")
    monkeypatch.setattr(agent, "PARTS", (*agent.PARTS[:place], wiring.build, *agent.PARTS[place:]))
    return wiring


def still_running(run: RunningAgent) -> None:
    """Fail at once when the agent has stopped (a root task that ended stops it), with why."""
    if run.task.done():
        raise AssertionError(f"the agent stopped: {run.task.exception()!r}")


def unhealthy(run: RunningAgent, path: Path) -> str | None:
    """What the file names (``None``: no file yet), while the agent runs."""
    still_running(run)
    return path.read_text(encoding="utf-8") if path.exists() else None


async def test_a_new_part_runs_supervised_and_keeps_its_file(
    new_part: ModuleType, device_plugin_dir: Path, tmp_path: Path
) -> None:
    path = tmp_path / "unhealthy"
    args = ("--simulate", "4", "--unhealthy-file", str(path))
    async with running_agent(device_plugin_dir, args, settings_type=WithUnhealthyFile) as run:
        names = [part.name for part in run.agent.parts]
        assert names.index("unhealthy-file") == names.index("node-files") + 1
        assert isinstance(run.agent.part(new_part.UnhealthyFilePart), Part)
        task = run.agent.supervisor.task("unhealthy-file")
        await eventually(lambda: unhealthy(run, path) == "", what="the file, no GPU unhealthy")
        uuid = run.uuids[2]
        assert (await run.fault({"gpu": 2, "fault": "xid", "xid": 79}))[0] == 200
        await eventually(lambda: unhealthy(run, path) == f"{uuid}\n", what="GPU 2 in the file")
        assert (await run.fault({"gpu": 2, "fault": "recover"}))[0] == 200
        await eventually(lambda: unhealthy(run, path) == "", what="GPU 2 out of the file")
        assert not task.done()
        await run.shutdown()
    assert task.cancelled()  # its task ended with the agent's shutdown


async def test_a_new_parts_failed_write_is_logged_and_retried_at_the_next_change(
    new_part: ModuleType, device_plugin_dir: Path, tmp_path: Path
) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("", encoding="utf-8")
    path = blocker / "unhealthy"
    args = ("--simulate", "2", "--unhealthy-file", str(path))
    with capture_logs() as logs:
        async with running_agent(device_plugin_dir, args, settings_type=WithUnhealthyFile) as run:

            def warned() -> list[MutableMapping[str, Any]]:
                still_running(run)
                # The part's own warning: another part may warn with an error under load (a
                # registration retried), which is not what this test is about.
                return [e for e in logs if e["event"] == "cannot write the unhealthy GPUs"]

            failed = await eventually(warned, what="the failed write logged")
            assert run.agent.liveness() is None
            blocker.unlink()
            blocker.mkdir()
            uuid = run.uuids[1]
            assert (await run.fault({"gpu": 1, "fault": "xid", "xid": 79}))[0] == 200

            def recovered() -> bool:
                # The file is replaced on a thread and the recovery logged once the part is back
                # on the loop: the file alone can be seen first, and the agent stopped before the
                # line is logged.
                logged = any(e.get("path") == str(path) for e in logs)
                return unhealthy(run, path) == f"{uuid}\n" and logged

            await eventually(recovered, what="GPU 1 in the file, and the recovery logged")
            assert not run.task.done()
    (warning,) = failed
    assert warning["log_level"] == "warning"
    assert "Not a directory" in warning["error"]
    (written,) = [e for e in logs if e.get("path") == str(path)]  # the recovery, once
    assert written["log_level"] == "info"


def test_a_new_part_is_left_out_where_its_setting_is_not_given(
    new_part: ModuleType, tmp_path: Path
) -> None:
    argv = ["--simulate", "1", "--socket-dir", str(tmp_path), "--metrics-address", "127.0.0.1:0"]
    settings = load_as(WithUnhealthyFile, argv, {"NODE_NAME": "test-node"})
    built = Agent(settings, simulator=load_simulator(settings))
    assert built.parts.find(new_part.UnhealthyFilePart) is None
    assert "node-files" in [part.name for part in built.parts]


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
