"""The shipped alert rules and dashboard: promtool unit tests, and names the agent really emits."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from support.synthetic import synthetic_snapshot

from gpuagent.domain.counters import AgentCounters, PodResourcesStats
from gpuagent.domain.devices import Condition, GpuHealth
from gpuagent.web.metrics import MetricsRenderer

ROOT = Path(__file__).resolve().parents[2]
MONITORING = ROOT / "manifests" / "monitoring"
NAME = re.compile(r"\b(DCGM_FI_[A-Z0-9_]+|gpuagent_[a-z0-9_]+)")


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        if os.environ.get("GPUAGENT_REQUIRE_PROMTOOL"):
            pytest.fail("promtool is required here (GPUAGENT_REQUIRE_PROMTOOL is set)")
        pytest.skip("promtool not installed")
    return found


def emitted_sample_names() -> set[str]:
    """Every sample name a busy agent emits (a GPU unhealthy, XIDs, pods)."""
    snapshot = synthetic_snapshot(2, replicas=1)
    gpu = replace(
        snapshot.gpus[0],
        health=GpuHealth((Condition("xid", "79"),)),
        xid_counts=MappingProxyType({79: 1}),
        last_xid=79,
    )
    snapshot = replace(snapshot, gpus=(gpu, snapshot.gpus[1]))
    text = MetricsRenderer("n", "1").render(
        snapshot, AgentCounters(pod_resources=PodResourcesStats(1, 0, True))
    )
    assert list(text_string_to_metric_families(text))  # it parses
    # Names as written (the parser would add _total to counters that lack it).
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line[:1] != "#"}


def test_alert_rules_pass_promtool_check_and_unit_tests() -> None:
    tool = promtool()
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
            "GPURowRemapFailure", "GPUAgentDown"} <= alerts  # fmt: skip
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
            assert rule["labels"]["severity"] in ("critical", "warning"), rule["alert"]
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
