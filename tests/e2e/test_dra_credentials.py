"""A DRA node's credentials refused: before anything starts, though the API client is imported only
once the kubelet has its device plugin (the check needs only the files: gpuagent.kube.credentials).
What the client's models alone refuse (a value of the wrong type) is said once the side is built,
after the registration: exit 2 too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.fake_kubelet import FakeKubelet

from e2e.agentprocess import T, free_port

pytestmark = pytest.mark.slow

CLUSTER = {"name": "c", "cluster": {"server": "http://127.0.0.1:9"}}
CONTEXT = {"name": "x", "context": {"cluster": "c"}}


def _kubeconfig(**changes: object) -> str:
    config = {"clusters": [CLUSTER], "contexts": [CONTEXT], "current-context": "x", **changes}
    return json.dumps(config)


def _agent(root: Path, socket_dir: Path, *more: str) -> subprocess.CompletedProcess[str]:
    """The agent as a DRA node under ``root``, run to its end (not in a pod)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_SERVICE_")}
    args = [
        "--simulate", "2", "--dra-gpus", "all", "--log-format", "json",
        "--socket-dir", str(socket_dir),
        "--plugins-dir", str(root / "plugins"),
        "--plugins-registry-dir", str(root / "registry"),
        "--cdi-spec-dir", str(root / "cdi"),
        "--node-labels-file", str(root / "features"),
        "--metrics-address", f"127.0.0.1:{free_port()}",
        *more,
    ]  # fmt: skip
    return subprocess.run(
        [sys.executable, "-m", "gpuagent", *args],
        capture_output=True, text=True, timeout=T, env=env, check=False,
    )  # fmt: skip


def _error(result: subprocess.CompletedProcess[str]) -> str:
    """The one error the agent logged on its way out (exit 2)."""
    assert result.returncode == 2, result.stderr
    entries = [json.loads(line) for line in result.stderr.splitlines()]
    (error,) = [e for e in entries if e["level"] == "error"]
    assert error["event"] == "configuration error"
    return str(error["error"])


@pytest.mark.parametrize(
    ("content", "said"),
    [
        (None, "--kubeconfig: KC: no such file"),
        ("clusters: [c\n", "--kubeconfig: KC: 2:1: expected ',' or ']'"),
        (_kubeconfig(**{"current-context": "y"}), "--kubeconfig: KC: current-context 'y': no such"),
        (_kubeconfig(clusters=[]), "--kubeconfig: KC: context 'x': no cluster named 'c'"),
        ("", "--dra-gpus: needs API server credentials: in-cluster service account: "
             "KUBERNETES_SERVICE_HOST unset"),
    ],
    ids=["no-file", "not-yaml", "no-such-context", "no-such-cluster", "not-in-a-pod"],
)  # fmt: skip
def test_credentials_that_cannot_be_loaded_are_refused_before_anything_starts(
    fake_kubelet: FakeKubelet, device_plugin_dir: Path, short_tmp_path: Path,
    content: str | None, said: str,
) -> None:  # fmt: skip
    """Exit 2 with the one line naming the setting; no registration, nothing made."""
    kubeconfig = short_tmp_path / "kc"
    if content:
        kubeconfig.write_text(content)
    given = ("--kubeconfig", str(kubeconfig)) if content != "" else ()
    result = _agent(short_tmp_path, device_plugin_dir, *given)

    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.splitlines()  # (the one line: nothing started, so nothing logged)
    expected = "gpuagent: configuration error: " + said.replace("KC", str(kubeconfig))
    assert line.startswith(expected), line
    assert fake_kubelet.attempts == []
    made = [p.name for p in short_tmp_path.iterdir() if p.name not in {"kc", "device-plugins"}]
    assert made == []
    assert [p.name for p in device_plugin_dir.glob("*.sock")] == [
        "kubelet.sock"
    ]  # (the stand-in's)


def test_a_value_only_the_client_refuses_is_said_once_the_side_is_built(
    fake_kubelet: FakeKubelet, device_plugin_dir: Path, short_tmp_path: Path
) -> None:
    """A flag of the wrong type: the client's models refuse it, the check of the files cannot;
    the device plugin has registered by then, and the agent stops with exit 2 naming it."""
    kubeconfig = short_tmp_path / "kc"
    wrong = {"name": "c", "cluster": {"server": "https://h", "insecure-skip-tls-verify": "maybe"}}
    kubeconfig.write_text(_kubeconfig(clusters=[wrong]))
    result = _agent(short_tmp_path, device_plugin_dir, "--kubeconfig", str(kubeconfig))

    error = _error(result)
    assert error.startswith(f"--kubeconfig: {kubeconfig}: Expected `bool`, got `str`"), error
    assert len(fake_kubelet.registrations) == 1
