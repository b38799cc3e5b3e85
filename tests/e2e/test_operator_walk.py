"""What an operator trying the agent by hand meets: answers cut short by a pipe, contradictions
and mistakes named by what was typed, in one line, before anything starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.fake_apiserver import FakeApiServer

from e2e.agentprocess import T, free_port

pytestmark = pytest.mark.slow


def _into_a_closed_pipe(*args: str) -> subprocess.CompletedProcess[str]:
    """``gpuagent ARGS | head -0``, deterministically: the pipe's reader is gone before the
    agent writes a byte."""
    reader, writer = os.pipe()
    os.close(reader)
    try:
        return subprocess.run(
            [sys.executable, "-m", "gpuagent", *args],
            stdout=writer,
            stderr=subprocess.PIPE,
            text=True,
            timeout=T,
            check=False,
        )
    finally:
        os.close(writer)


@pytest.mark.parametrize(
    "args", [["--check-config", "CONFIG"], ["--help"], ["--version"]], ids=lambda a: a[0]
)
def test_an_answer_whose_reader_closed_the_pipe_ends_quietly(
    args: list[str], tmp_path: Path
) -> None:
    config = tmp_path / "gpuagent.yaml"
    config.write_text("version: v1\nsimulate: 1\n")
    result = _into_a_closed_pipe(*[str(config) if a == "CONFIG" else a for a in args])
    assert (result.returncode, result.stderr) == (0, "")


@pytest.mark.parametrize("credentials", [True, False], ids=["credentials", "no-credentials"])
def test_a_dra_gpu_the_node_lacks_is_the_one_error_and_nothing_is_made(
    short_tmp_path: Path, credentials: bool
) -> None:
    """Checked against the node before anything is served or written, whether or not the API
    server can be reached: the error alone after the start's two lines, no directory, socket or
    file left behind, no shutdown lines."""
    absent = "GPU-00000000-0000-0000-0000-000000000000"
    made = {
        name: short_tmp_path / name
        for name in ("device-plugins", "plugins", "registry", "cdi", "features")
    }
    args = [
        "--simulate", "2", "--dra-gpus", absent, "--log-format", "json",
        "--socket-dir", str(made["device-plugins"]),
        "--plugins-dir", str(made["plugins"]),
        "--plugins-registry-dir", str(made["registry"]),
        "--cdi-spec-dir", str(made["cdi"]),
        "--node-labels-file", str(made["features"]),
        "--metrics-address", f"127.0.0.1:{free_port()}",
    ]  # fmt: skip
    if credentials:  # an API server that is not there: the check needs none
        server = FakeApiServer(node="n", port=free_port())
        args += ["--kubeconfig", str(server.kubeconfig(short_tmp_path / "kc"))]
    env = {k: v for k, v in os.environ.items() if k != "KUBERNETES_SERVICE_HOST"}

    result = subprocess.run(
        [sys.executable, "-m", "gpuagent", *args],
        capture_output=True, text=True, timeout=T, env=env, check=False,
    )  # fmt: skip

    assert result.returncode == 2, result.stderr
    entries = [json.loads(line) for line in result.stderr.splitlines()]  # every line is JSON
    # The start's lines (the settings, what the driver told of its GPUs), then the error alone:
    # nothing served, written or shut down around it.
    assert [e["event"] for e in entries if e["level"] != "info"] == ["configuration error"]
    assert entries[-1]["event"] == "configuration error"
    assert {e["event"] for e in entries[:-1]} <= {
        "running with config",
        "gpus discovered",
        "value not offered by this gpu or driver",
    }
    assert entries[-1]["error"].startswith(
        f"--dra-gpus: names {absent}, which this node does not have (it has GPU indexes 0-1 "
    )
    assert {name: path.exists() for name, path in made.items()} == dict.fromkeys(made, False)
