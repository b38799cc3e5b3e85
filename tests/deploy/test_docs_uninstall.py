"""docs/uninstall.md's shell, run as an operator would, against a stand-in kubectl
(``support.fake_kubectl``: kubectl's argument rules and failures over Node objects in a file)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

from support import fake_kubectl

from gpuagent.domain.nodehealth.model import TAINT_KEY

UNINSTALL = Path(__file__).resolve().parents[2] / "docs" / "uninstall.md"
OTHER_TAINT = {"key": "example.com/maintenance", "effect": "NoSchedule"}


def _node(name: str, *, gpu_healthy: bool, tainted: bool) -> dict[str, Any]:
    conditions = [{"type": "Ready", "status": "True"}]
    if gpu_healthy:
        conditions.insert(0, {"type": "GPUHealthy", "status": "False"})
    taints = [OTHER_TAINT]
    if tainted:
        taints.append({"key": TAINT_KEY, "effect": "NoSchedule"})
    return {
        "metadata": {"name": name},
        "spec": {"taints": taints},
        "status": {"conditions": conditions},
    }


def _cleanup_loop() -> str:
    """The doc's block that removes the condition and the taint."""
    blocks = re.findall(r"```sh\n(.*?)```", UNINSTALL.read_text(encoding="utf-8"), re.DOTALL)
    (loop,) = [str(b) for b in blocks if "GPUHealthy" in b]
    return loop


def test_the_uninstall_loop_removes_the_condition_and_the_taint(tmp_path: Path) -> None:
    state = tmp_path / "nodes.json"
    nodes = [
        _node("gpu-a", gpu_healthy=True, tainted=True),
        _node("gpu-b", gpu_healthy=True, tainted=False),  # no taint: nothing to fail on
        _node("cpu-c", gpu_healthy=False, tainted=False),
    ]
    state.write_text(json.dumps({"nodes": nodes}))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    env = fake_kubectl.install(bin_dir, state)

    result = subprocess.run(
        ["sh", "-c", _cleanup_loop()], env=env, capture_output=True, text=True, check=False
    )

    assert result.returncode == 0, result.stderr
    assert "error" not in result.stderr, result.stderr
    after = {n["metadata"]["name"]: n for n in json.loads(state.read_text())["nodes"]}
    for name, node in after.items():
        assert node["status"]["conditions"] == [{"type": "Ready", "status": "True"}], name
        assert node["spec"]["taints"] == [OTHER_TAINT], name


def test_the_stand_in_refuses_what_kubectl_taint_refuses(tmp_path: Path) -> None:
    """``kubectl taint`` takes ``nodes NAME``, not ``node/NAME`` (the loop once passed that, and
    hid the error)."""
    state = tmp_path / "nodes.json"
    state.write_text(json.dumps({"nodes": [_node("gpu-a", gpu_healthy=False, tainted=True)]}))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    env = fake_kubectl.install(bin_dir, state)
    run = ["kubectl", "taint", "node/gpu-a", f"{TAINT_KEY}:NoSchedule-"]

    result = subprocess.run(run, env=env, capture_output=True, text=True, check=False)

    assert result.returncode == 1
    assert result.stderr.startswith("error: invalid resource type node/gpu-a")
