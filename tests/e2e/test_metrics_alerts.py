"""The shipped alert rules and dashboard: promtool unit tests, and names the agent really emits."""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType

import yaml
from prometheus_client.parser import text_string_to_metric_families
from support.promtool import prometheus_tool
from support.synthetic import synthetic_snapshot

from gpuagent.domain import xids
from gpuagent.domain.devices import Condition, GpuHealth, Registration
from gpuagent.domain.usage import ContainerUsage, ProcessReading, Usage
from gpuagent.state.counters import AgentCounters, DraCounters, PodResourcesStats
from gpuagent.web.metrics import MetricsRenderer

ROOT = Path(__file__).resolve().parents[2]
MONITORING = ROOT / "manifests" / "monitoring"
NAME = re.compile(r"\b(DCGM_FI_[A-Z0-9_]+|gpuagent_[a-z0-9_]+)")


def emitted_sample_names() -> set[str]:
    """Every sample name a busy agent emits (a GPU unhealthy, XIDs, pods)."""
    snapshot = synthetic_snapshot(2, replicas=1)
    gpu = replace(
        snapshot.gpus[0],
        health=GpuHealth((Condition("xid", "79"),)),
        xid_counts=MappingProxyType({79: 1}),
        last_xid=79,
        processes=ProcessReading(samples=()),
    )
    # A container using the GPU without an allocation (per-container families).
    miner = ContainerUsage(0, None, "sneaky", "miner", "main", 1, 2**30, 0.5, 0, 0, 0, 1.0)
    usage = Usage(containers=(miner,), judged=True)
    # DRA is on (its registration said): the DRA side's families too.
    snapshot = replace(
        snapshot, gpus=(gpu, snapshot.gpus[1]), usage=usage, dra_registration=Registration()
    )
    text = MetricsRenderer("n", "1").render(
        snapshot, AgentCounters(pod_resources=PodResourcesStats(1, 0, True), dra=DraCounters())
    )
    assert list(text_string_to_metric_families(text))  # it parses
    # Names as written (the parser would add _total to counters that lack it).
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line[:1] != "#"}


def test_alert_rules_pass_promtool_check_and_unit_tests() -> None:
    tool = prometheus_tool("promtool")
    check = subprocess.run(
        [tool, "check", "rules", str(MONITORING / "alerts.yaml")],
        capture_output=True, text=True, check=False, timeout=60,
    )  # fmt: skip
    assert check.returncode == 0, check.stdout + check.stderr
    test = subprocess.run(
        [tool, "test", "rules", "alerts_test.yaml"],
        cwd=MONITORING, capture_output=True, text=True, check=False, timeout=120,
    )  # fmt: skip
    assert test.returncode == 0, test.stdout + test.stderr
    assert "SUCCESS" in test.stdout


def test_every_alert_has_a_unit_test() -> None:
    rules = yaml.safe_load((MONITORING / "alerts.yaml").read_text())
    alerts = {r["alert"] for g in rules["groups"] for r in g["rules"]}
    assert {"GPUUnhealthy", "GPUXidErrors", "GPUTemperatureHigh", "GPUDoubleBitEccErrors",
            "GPURowRemapFailure", "GPUAgentDown", "GPUAgentAbsent", "GPUCountDropped",
            "GPUFatalXid", "GPUApplicationXid", "GPUThermalThrottling", "GPUPCIeReplays",
            "GPUSingleBitEccRate", "GPUNVLinkErrors"} <= alerts  # fmt: skip
    tests = yaml.safe_load((MONITORING / "alerts_test.yaml").read_text())
    tested = {
        case["alertname"]
        for t in tests["tests"]
        for case in t["alert_rule_test"]
        if case.get("exp_alerts")
    }
    assert alerts == tested
    for group in rules["groups"]:
        for rule in group["rules"]:
            assert rule["labels"]["severity"] in ("critical", "warning", "info"), rule["alert"]
            assert {"summary", "description"} <= set(rule["annotations"]), rule["alert"]


def test_rules_and_dashboard_use_only_emitted_names() -> None:
    emitted = emitted_sample_names()
    texts = {
        "alerts.yaml": (MONITORING / "alerts.yaml").read_text(),
        "dashboard.json": (MONITORING / "dashboard.json").read_text(),
    }
    for source, text in texts.items():
        for name in set(NAME.findall(text)):
            if name == "DCGM_FI_DRIVER_VERSION":  # a label
                continue
            assert name in emitted, f"{source} uses {name}, which /metrics does not emit"


def test_dashboard_shape() -> None:
    dashboard = json.loads((MONITORING / "dashboard.json").read_text())
    assert dashboard["uid"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert set(variables) == {"datasource", "instance", "gpu"}
    assert "DCGM_FI_DEV_GPU_TEMP" in variables["instance"]["definition"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    # The six per-GPU panels of the NVIDIA DCGM Exporter Dashboard, unchanged.
    for expr in (
        'DCGM_FI_DEV_GPU_TEMP{instance=~"$instance", gpu=~"$gpu"}',
        'DCGM_FI_DEV_POWER_USAGE{instance=~"$instance", gpu=~"$gpu"}',
        'DCGM_FI_DEV_SM_CLOCK{instance=~"$instance", gpu=~"$gpu"} * 1000000',
        'DCGM_FI_DEV_GPU_UTIL{instance=~"$instance", gpu=~"$gpu"}',
        'DCGM_FI_DEV_FB_USED{instance=~"$instance", gpu=~"$gpu"}',
        'DCGM_FI_PROF_PIPE_TENSOR_ACTIVE{instance=~"$instance", gpu=~"$gpu"}',
    ):
        assert expr in exprs
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            assert target["datasource"] == {"type": "prometheus", "uid": "${datasource}"}


def rules_by_name() -> dict[str, dict[str, object]]:
    rules = yaml.safe_load((MONITORING / "alerts.yaml").read_text())
    return {r["alert"]: r for g in rules["groups"] for r in g["rules"]}


def matchers(expr: str, label: str) -> set[str]:
    """The regular expressions ``label`` is matched against (``=~``) or equal to in ``expr``."""
    found = set(re.findall(rf'{label}=~"([^"]*)"', expr))
    found |= {re.escape(v) for v in re.findall(rf'{label}="([^"]*)"', expr)}
    return found


def selects(expr: str, xid: int) -> bool:
    """Whether one of ``expr``'s selectors of gpuagent_xid_errors_total takes this XID."""
    entry = xids.lookup(xid)
    label = str(xid) if xids.is_known(xid) else "other"
    by_action = any(re.fullmatch(p, entry.action.value) for p in matchers(expr, "action"))
    by_code = any(re.fullmatch(p, label) for p in matchers(expr, "xid"))
    return by_action or by_code


# The catalog's immediate actions that raise no XID alert of their own: nothing to do, or only a
# note (154 names a recovery action, read on its own; 45 follows another XID).
QUIET_ACTIONS = {xids.Action.IGNORE, xids.Action.XID_154, xids.Action.WORKFLOW_XID_45,
                 xids.Action.NONE}  # fmt: skip
BLACKWELL_FATAL = {136, 140, 143, 144, 145, 146, 147, 148, 149, 150, 155, 156, 158, 166, 167,
                   168, 169, 170, 171, 172}  # fmt: skip


def test_every_xid_has_one_alert_by_the_catalogs_action() -> None:
    """Each XID the catalog lists (and an unlisted one) raises one XID alert at most: fatal ones a
    page, the application's own errors info, the ones to investigate a warning; no-action ones
    none. So a new catalog action is classified here before it can go unnoticed."""
    rules = rules_by_name()
    fatal, investigate, application = (
        str(rules[name]["expr"]) for name in ("GPUFatalXid", "GPUXidErrors", "GPUApplicationXid")
    )
    for code in [*sorted(xids.CATALOG), 998]:
        picked = [selects(e, code) for e in (fatal, investigate, application)]
        action = xids.lookup(code).action
        assert sum(picked) <= 1, (code, action, picked)
        if code in (13, 31, 43, 45) or action is xids.Action.RESTART_APP:
            assert picked == [False, False, True], code
        elif code in BLACKWELL_FATAL or action in {xids.Action.RESET_GPU, xids.Action.RESTART_BM,
                                                   xids.Action.RESTART_VM,
                                                   xids.Action.WORKFLOW_XID_48,
                                                   xids.Action.WORKFLOW_NVLINK_ERR,
                                                   xids.Action.WORKFLOW_NVLINK5_ERR}:  # fmt: skip
            assert picked == [True, False, False], code
        elif action in QUIET_ACTIONS:
            assert picked == [False, False, False], (code, action)
        else:
            assert picked == [False, True, False], (code, action)
    assert rules["GPUFatalXid"]["labels"] == {"severity": "critical"}
    assert rules["GPUApplicationXid"]["labels"] == {"severity": "info"}


def test_per_gpu_rules_aggregate_away_pods_and_mig_instances() -> None:
    """dcgm-exporter series carry pod and MIG-instance labels: every rule on them aggregates to
    the GPU, so neither a shared GPU nor pod churn multiplies or restarts an alert."""
    for name, rule in rules_by_name().items():
        expr = str(rule["expr"])
        if "DCGM_FI_" not in expr:
            continue
        for selector in re.findall(r"DCGM_FI_[A-Z0-9_]+", expr):
            assert "max by (instance, Hostname, hostname, gpu, UUID, modelName)" in expr, name
            assert selector
        assert not re.search(r"\b(pod|container|namespace|GPU_I_ID)\b", expr), name


def test_every_alert_has_a_runbook_line() -> None:
    doc = (ROOT / "docs" / "metrics.md").read_text(encoding="utf-8")
    section = doc.split("## Alerts and runbook", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"^\| `(GPU[A-Za-z]+)` \|", section, re.MULTILINE))
    rules = rules_by_name()
    assert documented == set(rules)
    for name, rule in rules.items():
        (line,) = [row for row in section.splitlines() if row.startswith(f"| `{name}` |")]
        severity = line.split("|")[2].strip()
        assert severity == rule["labels"]["severity"], name  # type: ignore[index]
