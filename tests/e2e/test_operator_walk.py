"""What an operator trying the agent by hand meets: answers cut short by a pipe, contradictions
and mistakes named by what was typed, in one line, before anything starts."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from support.fake_apiserver import FakeApiServer

from e2e.agentprocess import T, free_port
from gpuagent.app.parts.http import listen
from gpuagent.config import ConfigError, load_settings

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


@pytest.mark.parametrize(
    ("given", "named"),
    [
        (["--metrics-address", "nosuchhost.invalid:9513"], "--metrics-address"),
        (["--check-config", "CONFIG", "--metrics-address=nosuchhost.invalid:9513"],
         "--metrics-address"),
        (["ENV"], "GPUAGENT_METRICS_ADDRESS"),
    ],
    ids=["start", "check-config", "variable"],
)  # fmt: skip
def test_a_metrics_host_that_does_not_resolve_is_said_so(
    short_tmp_path: Path, given: list[str], named: str
) -> None:
    """Not the resolver's code as an errno ('Unknown error -2'): exit 2, one line, nothing
    started. (``.invalid`` never resolves: RFC 6761.)"""
    config = short_tmp_path / "gpuagent.yaml"
    config.write_text("version: v1\n")
    env = {**os.environ, "GPUAGENT_METRICS_ADDRESS": "nosuchhost.invalid:9513"}
    args = [str(config) if a == "CONFIG" else a for a in given if a != "ENV"]
    result = subprocess.run(
        [sys.executable, "-m", "gpuagent", "--simulate", "1", *args,
         "--socket-dir", str(short_tmp_path), "--log-format", "json"],
        capture_output=True, text=True, timeout=T, check=False,
        env=env if "ENV" in given else {**os.environ},
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    (line,) = result.stderr.splitlines()
    assert line.startswith(
        f"gpuagent: configuration error: {named}: host 'nosuchhost.invalid' does not resolve ("
    ), line


async def test_a_host_that_stops_resolving_before_the_bind_is_said_so() -> None:
    class Unresolved:
        async def bind(self) -> None:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    settings = load_settings(["--metrics-address", "gone.invalid:9513"], {})
    with pytest.raises(ConfigError) as caught:
        await listen(Unresolved(), settings)  # type: ignore[arg-type]
    assert str(caught.value) == (
        "--metrics-address: host 'gone.invalid' does not resolve (Name or service not known)"
    )
