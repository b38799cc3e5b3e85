"""The agent as an operator runs it: a separate process, its exit codes and signals."""

from __future__ import annotations

import json
import os
import pty
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.fake_apiserver import FakeApiServer
from support.fake_kubelet import FakeKubelet

from e2e.agentprocess import (
    T,
    free_port,
    http_get,
    reaped,
    run_to_end,
    spawn,
    spawn_agent,
    wait_http,
)

pytestmark = pytest.mark.slow


@pytest.fixture
def agent_process(device_plugin_dir: Path) -> Iterator[tuple[subprocess.Popen[str], int]]:
    port = free_port()
    with reaped(spawn_agent(device_plugin_dir, port)) as proc:
        yield proc, port


def test_sigterm_ends_streams_removes_socket_exits_zero_quickly(
    fake_kubelet: FakeKubelet,
    device_plugin_dir: Path,
    agent_process: tuple[subprocess.Popen[str], int],
) -> None:
    proc, port = agent_process
    (reg,) = fake_kubelet.wait_for_registrations(1, T)
    reg.next_update(T)
    wait_http(port, "/readyz", 200)
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=T)
    _, stderr = proc.communicate()
    assert code == 0, stderr
    # Bounded by its own budgets, and none of them was needed: every step finished by itself.
    assert "did not stop in time" not in stderr
    assert "did not close in time" not in stderr
    assert "nvml shutdown did not return in time" not in stderr
    assert reg.wait_ended(T).code.name == "UNAVAILABLE"
    assert not (device_plugin_dir / "nvidia-gpu.sock").exists()
    events = [json.loads(line)["event"] for line in stderr.splitlines() if line.startswith("{")]
    assert "running with config" in events
    assert "registered with kubelet" in events
    assert events[-1] == "stopped"


def test_sigint_also_exits_zero(
    fake_kubelet: FakeKubelet, agent_process: tuple[subprocess.Popen[str], int]
) -> None:
    proc, _ = agent_process
    fake_kubelet.wait_for_registrations(1, T)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=T) == 0


def test_registered_soon_after_start(
    fake_kubelet: FakeKubelet, agent_process: tuple[subprocess.Popen[str], int]
) -> None:
    proc, _ = agent_process
    (reg,) = fake_kubelet.wait_for_registrations(1, T)
    first = reg.next_update(T)
    assert len(first.devices) == 2
    assert proc.poll() is None


@pytest.mark.parametrize(
    ("args", "env", "needle"),
    [
        pytest.param(["--device-id-strategy", "serial"], {}, "--device-id-strategy", id="flag"),
        pytest.param(["--simulate", "2"], {"MIG_STRATEGY": "weird"}, "MIG_STRATEGY", id="env"),
        pytest.param(["--resource-name", "Nvidia.com/gpu"], {}, "--resource-name",
                     id="resource-name"),
        pytest.param(["--simulate", "0"], {}, "--simulate", id="simulate-range"),
        pytest.param(["--bogus"], {}, "bogus", id="unknown-flag"),
        pytest.param(["--simulate", "1"], {"DP_DISABLE_HEALTHCHECKS": "oops"},
                     "DP_DISABLE_HEALTHCHECKS", id="healthcheck-spec"),
    ],
)  # fmt: skip
def test_invalid_settings_exit_2_naming_the_key(
    args: list[str], env: dict[str, str], needle: str
) -> None:
    result = run_to_end(*args, env=env)
    assert result.returncode == 2, result.stderr
    assert needle in result.stderr


def test_bad_config_file_exits_2_naming_the_key(short_tmp_path: Path) -> None:
    config = short_tmp_path / "gpuagent.yaml"
    config.write_text("version: v1\nsokcet-dir: /tmp/x\n")
    result = run_to_end("--config", str(config), "--simulate", "1")
    assert result.returncode == 2
    assert "sokcet-dir" in result.stderr


def test_bad_sim_config_exits_2_naming_the_key(short_tmp_path: Path) -> None:
    config = short_tmp_path / "node.yaml"
    config.write_text("version: v1\ngpus:\n  - memory_mib: lots\n")
    result = run_to_end("--sim-config", str(config))
    assert result.returncode == 2
    assert "memory_mib" in result.stderr


def test_no_driver_with_fail_on_init_error_exits_1(short_tmp_path: Path) -> None:
    result = run_to_end(
        "--socket-dir", str(short_tmp_path), "--metrics-address", f"127.0.0.1:{free_port()}"
    )
    assert result.returncode == 1
    assert "driver unavailable" in result.stderr.lower()
    assert "--simulate" in result.stderr  # what to do on a machine without NVIDIA GPUs


def test_no_driver_without_fail_on_init_error_serves_probes(short_tmp_path: Path) -> None:
    port = free_port()
    args = (
        "--fail-on-init-error=false",
        "--socket-dir", str(short_tmp_path),
        "--metrics-address", f"127.0.0.1:{port}",
    )  # fmt: skip
    with reaped(spawn(*args)) as proc:
        body = wait_http(port, "/readyz", 503)
        assert "driver unavailable" in body
        wait_http(port, "/healthz", 200)
        metrics = wait_http(port, "/metrics", 200)
        assert "gpuagent_driver_up 0" in metrics
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=T) == 0


def test_check_config_prints_the_effective_settings_and_starts_nothing(
    short_tmp_path: Path,
) -> None:
    config = short_tmp_path / "gpuagent.yaml"
    config.write_text("version: v1\nmig-strategy: mixed\nsimulate: 2\n")
    port = free_port()
    result = run_to_end(
        "--check-config", str(config), "--metrics-address", f"127.0.0.1:{port}",
        env={"NODE_NAME": "gpu-node-1"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    settings = json.loads(result.stdout)
    assert settings["mig_strategy"] == "mixed"
    assert settings["simulate"] == 2
    assert settings["node_name"] == "gpu-node-1"
    assert result.stderr == ""  # no log: nothing started
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # nobody listened there


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        pytest.param("version: v1\nsharing: {timeSlicing: {resources: [{name: gpu, replicas: 1}]}}"
                     "\n", "replicas", id="one-replica"),
        pytest.param("version: v1\nweb-config-file: /nonexistent/web.yml\n", "web-config-file",
                     id="web-config-missing"),
        pytest.param("version: v1\ndisable-healthchecks: oops\n", "healthchecks",
                     id="healthcheck-spec"),
    ],
)  # fmt: skip
def test_check_config_exits_2_naming_the_key(short_tmp_path: Path, body: str, needle: str) -> None:
    config = short_tmp_path / "gpuagent.yaml"
    config.write_text(body)
    result = run_to_end("--check-config", str(config))
    assert result.returncode == 2
    assert result.stdout == ""
    (line,) = result.stderr.strip().splitlines()
    assert needle in line


@pytest.mark.parametrize("check", [False, True], ids=["start", "check-config"])
def test_dra_without_kubernetes_exits_2_naming_both_keys(short_tmp_path: Path, check: bool) -> None:
    """A GPU for DRA on a node without Kubernetes would be offered nowhere."""
    config = short_tmp_path / "gpuagent.yaml"
    config.write_text("version: v1\nkubernetes: false\n")
    where = ("--check-config",) if check else ("--simulate", "1", "--config")
    result = run_to_end(*where, str(config), env={"GPUAGENT_DRA_GPUS": "0"})
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert "GPUAGENT_DRA_GPUS" in line
    assert "config file key 'kubernetes' false" in line


def test_dra_gpu_the_node_lacks_exits_2_once_the_gpus_are_known(short_tmp_path: Path) -> None:
    """Which GPUs the node has is known only once the driver has answered: then the agent stops
    with a configuration error naming the setting and the GPU (the API server need not answer)."""
    # An API server that is not there (never started): the check needs none.
    kubeconfig = FakeApiServer(node="n", port=free_port()).kubeconfig(short_tmp_path / "kc")
    result = run_to_end(
        "--simulate", "2", "--dra-gpus", "1,5", "--kubeconfig", str(kubeconfig),
        "--socket-dir", str(short_tmp_path / "dp"),
        "--plugins-dir", str(short_tmp_path / "plugins"),
        "--plugins-registry-dir", str(short_tmp_path / "registry"),
        "--cdi-spec-dir", str(short_tmp_path / "cdi"),
        "--metrics-address", f"127.0.0.1:{free_port()}", "--log-format", "json",
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    entries = [json.loads(line) for line in result.stderr.splitlines() if line.startswith("{")]
    (error,) = [e for e in entries if e["level"] == "error"]
    assert error["error"].startswith("--dra-gpus: names GPU 5, which this node does not have")


def test_metrics_port_in_use_exits_2_in_one_line(short_tmp_path: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = run_to_end(
            "--simulate", "1",
            "--socket-dir", str(short_tmp_path),
            "--metrics-address", f"127.0.0.1:{port}",
            "--log-format", "json",
        )  # fmt: skip
    assert result.returncode == 2, result.stderr
    entries = [json.loads(line) for line in result.stderr.splitlines()]  # every line is JSON
    # Said before anything starts: no shutdown lines before (or after) it.
    assert [(e["event"], e["level"]) for e in entries] == [
        ("running with config", "info"),
        ("configuration error", "error"),
    ]
    assert entries[1]["error"] == (
        f"--metrics-address: cannot listen on 127.0.0.1:{port}: Address already in use "
        "(another process holds it: dcgm-exporter?)"
    )


def test_unknown_gpuagent_variable_exits_2() -> None:
    result = run_to_end("--simulate", "1", env={"GPUAGENT_MIG_STRATEGIES": "mixed"})
    assert result.returncode == 2
    assert "GPUAGENT_MIG_STRATEGIES" in result.stderr
    assert "GPUAGENT_MIG_STRATEGY" in result.stderr


def _read_all(fd: int, into: list[bytes]) -> None:
    """Everything written to the pseudo-terminal ``fd`` until its last writer closes it."""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # EIO: the terminal's other end is closed
            return
        if not chunk:
            return
        into.append(chunk)


@pytest.mark.parametrize("terminal", [False, True], ids=["pipe", "terminal"])
def test_console_logs_are_in_colour_only_on_a_terminal(
    short_tmp_path: Path, terminal: bool
) -> None:
    """``--log-format console`` writes ANSI colour codes to a terminal, and none to a pipe (a
    file, ``kubectl logs``)."""
    port = free_port()
    args = [
        sys.executable, "-m", "gpuagent", "--simulate", "1", "--kubernetes=false",
        "--socket-dir", str(short_tmp_path), "--metrics-address", f"127.0.0.1:{port}",
        "--log-format", "console",
    ]  # fmt: skip
    written: list[bytes] = []
    reader = None
    if terminal:
        master, slave = pty.openpty()
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=slave)
        os.close(slave)
        reader = threading.Thread(target=_read_all, args=(master, written))
        reader.start()
    else:
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    with reaped(proc):
        wait_http(port, "/readyz", 200)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=T)
        assert proc.returncode == 0
        if reader is not None:
            reader.join(T)
            os.close(master)
        else:
            written.append(stderr)
    text = b"".join(written).decode()
    assert "running with config" in text
    assert "stopped" in text
    assert ("\x1b[" in text) is terminal, text[:300]


@pytest.mark.parametrize(
    ("option", "under"),
    [
        pytest.param("--socket-dir", False, id="socket-dir"),
        pytest.param("--socket-dir", True, id="under-a-file"),
        pytest.param("--pod-resources-socket", True, id="pod-resources-socket"),
        pytest.param("--plugins-registry-dir", False, id="dra-registry"),
    ],
)
@pytest.mark.parametrize("check", [False, True], ids=["start", "check-config"])
def test_a_socket_directory_that_is_a_file_exits_2_in_one_line(
    short_tmp_path: Path, option: str, under: bool, check: bool
) -> None:
    """A file where a socket directory should be (or above it) can never hold a socket: a
    configuration error naming the option and the file, before anything starts."""
    blocker = short_tmp_path / "not-a-dir"
    blocker.write_text("a file")
    value = blocker / "sub" if under else blocker
    if option == "--pod-resources-socket":
        value = value / "kubelet.sock"
    args = ["--simulate", "1", "--metrics-address", f"127.0.0.1:{free_port()}"]
    args += ["--socket-dir", str(short_tmp_path), option, str(value)]
    if option == "--plugins-registry-dir":
        args += ["--dra-gpus", "all"]
    if check:
        config = short_tmp_path / "gpuagent.yaml"
        config.write_text("version: v1\n")
        args += ["--check-config", str(config)]
    result = run_to_end(*args)
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        f"gpuagent: configuration error: {option}: {blocker} is not a directory"
    ]


@pytest.mark.parametrize(
    "option",
    [
        pytest.param("--config", id="config"),
        pytest.param("--sim-config", id="sim-config"),
        pytest.param("--web-config-file", id="web-config"),
    ],
)
def test_a_yaml_syntax_error_is_one_line_with_file_line_and_column(
    short_tmp_path: Path, option: str
) -> None:
    """A YAML syntax error in any file the agent reads at start: ``FILE:LINE:COL: what``, on one
    line, exit 2 (no traceback, no quoted lines and carets), named by the flag as typed."""
    broken = short_tmp_path / "broken.yaml"
    broken.write_text("version: v1\npoll-interval: [1\nsocket-dir: /x\n")
    args = [option, str(broken)]
    if option != "--sim-config":
        args += ["--simulate", "1"]
    result = run_to_end(*args)
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        f"gpuagent: configuration error: {option}: {broken}:3:11: expected ',' or ']', but got ':' "
        "(while parsing a flow sequence at 2:16)"
    ]


@pytest.mark.parametrize(
    ("args", "line"),
    [
        pytest.param(["--bogus"], "unrecognized arguments: --bogus", id="unknown-flag"),
        pytest.param(["--sokcet-dir", "/x"],
                     "unrecognized arguments: --sokcet-dir /x (did you mean --socket-dir?)",
                     id="misspelt-flag"),
        pytest.param(["--simulate"], "argument --simulate: expected one argument",
                     id="missing-value"),
        pytest.param(["--fail-on-init-error", "false"], "unrecognized arguments: false",
                     id="bool-with-a-separate-value"),
    ],
)  # fmt: skip
def test_a_usage_error_is_one_line_with_a_hint(args: list[str], line: str) -> None:
    """A flag argparse cannot take: one line and where to look, not the ~30 lines of usage."""
    result = run_to_end(*args)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [f"gpuagent: {line}; see gpuagent --help"]
    assert result.stdout == ""


def hung_calls(port: int) -> int:
    """Calls blocked in a hang on the simulated GPUs now (``/sim/gpus``)."""
    _, body = http_get(port, "/sim/gpus")
    return sum(int(gpu["hung_calls"]) for gpu in json.loads(body))


def test_sigterm_while_every_gpu_hangs_ends_the_streams_and_exits_0(
    fake_kubelet: FakeKubelet, device_plugin_dir: Path
) -> None:
    """Every GPU's NVML calls hang, one is blocked in the hang, and SIGTERM comes: the streams
    still end, the socket is removed, the driver is left to the kernel, and the process exits 0
    within the shutdown budget (2.5 s; measured, printed, not asserted: about 1.1 s here)."""
    port = free_port()
    with reaped(spawn_agent(device_plugin_dir, port, "--poll-interval", "0.1")) as proc:
        (reg,) = fake_kubelet.wait_for_registrations(1, T)
        reg.next_update(T)
        wait_http(port, "/readyz", 200)
        for gpu in (0, 1):
            request = urllib.request.Request(
                f"http://127.0.0.1:{port}/sim/faults",
                data=json.dumps({"gpu": gpu, "fault": "hang", "seconds": 600}).encode(),
                method="POST",
            )
            with urllib.request.urlopen(request, timeout=2) as response:
                assert response.status == 200
        deadline = time.monotonic() + T
        while hung_calls(port) < 1:
            assert time.monotonic() < deadline, "no call ever blocked in the hang"
            time.sleep(0.02)
        began = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=T)
        print(f"shutdown with every GPU hung: {time.monotonic() - began:.2f} s")
        _, stderr = proc.communicate()
    assert code == 0, stderr
    events = [json.loads(line)["event"] for line in stderr.splitlines()]
    assert events[events.index("signal received; shutting down") :] == [
        "signal received; shutting down",
        "shutting down",
        "list-and-watch stream closed",
        "nvml left to the process's exit: a call has not returned",
        "stopped",
    ]
    assert reg.wait_ended(T).code.name == "UNAVAILABLE"
    assert not (device_plugin_dir / "nvidia-gpu.sock").exists()
