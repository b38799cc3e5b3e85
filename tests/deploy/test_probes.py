"""The agent started exactly as the DaemonSet starts it answers the probes its manifest names."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.fake_kubelet import FakeKubelet
from support.grpcstubs import StubModules

from deploy.kustomize import T, build, config_text, container, daemonset, image_env, manifest_env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _probe(port: int, probe: dict[str, Any]) -> int | None:
    url = f"http://127.0.0.1:{port}{probe['httpGet']['path']}"
    try:
        with urllib.request.urlopen(url, timeout=probe.get("timeoutSeconds", 1)) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        return int(error.code)
    except OSError:
        return None


def _wait_probe(port: int, probe: dict[str, Any], status: int) -> None:
    deadline = time.monotonic() + T
    last = None
    while time.monotonic() < deadline:
        last = _probe(port, probe)
        if last == status:
            return
        time.sleep(0.05)
    raise AssertionError(f"{probe['httpGet']['path']} never answered {status}; last {last}")


@pytest.fixture
def daemonset_agent(
    short_tmp_path: Path,
) -> Iterator[tuple[subprocess.Popen[str], dict[str, Any], Path, int, dict[str, Any]]]:
    """The agent started with the base DaemonSet's entrypoint, args and env (image ENV included).

    Overrides, appended after the manifest's args (flags take precedence over the config file),
    because a test cannot be a GPU node: ``--simulate 2`` (no driver here), ``--socket-dir`` and
    ``--pod-resources-socket`` under a temporary directory (the hostPath mounts), and
    ``--metrics-address 127.0.0.1:<free port>`` (:9400 may be taken). The config file is the
    ConfigMap's, at a temporary path instead of /etc/gpuagent.
    """
    docs = build("base")
    ctr = container(docs)
    _, pod, _ = daemonset(docs)
    config = short_tmp_path / "config.yaml"
    config.write_text(config_text(docs), encoding="utf-8")
    args = [f"--config={config}" if a.startswith("--config=") else a for a in ctr["args"]]
    socket_dir = short_tmp_path / "device-plugins"
    port = _free_port()
    overrides = [
        "--simulate", "2",
        "--socket-dir", str(socket_dir),
        "--pod-resources-socket", str(short_tmp_path / "pod-resources" / "kubelet.sock"),
        "--metrics-address", f"127.0.0.1:{port}",
    ]  # fmt: skip
    # The image's PATH points at its own virtual environment: here that is sys.executable's.
    env = {**image_env(), **manifest_env(ctr), "PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    assert ctr.get("command") is None, "the image's ENTRYPOINT (gpuagent) runs"
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpuagent", *args, *overrides],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        yield proc, ctr, socket_dir, port, pod
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=T)


@pytest.mark.slow
def test_agent_started_as_the_daemonset_answers_its_probes(
    daemonset_agent: tuple[subprocess.Popen[str], dict[str, Any], Path, int, dict[str, Any]],
    grpc_stubs: StubModules,
) -> None:
    proc, ctr, socket_dir, port, pod = daemonset_agent
    liveness, readiness = ctr["livenessProbe"], ctr["readinessProbe"]
    # Alive at once, not ready while no kubelet is there (the agent waits for kubelet.sock).
    _wait_probe(port, liveness, 200)
    assert _probe(port, readiness) == 503
    with FakeKubelet(socket_dir, grpc_stubs) as kubelet:
        (registration,) = kubelet.wait_for_registrations(1, T)
        assert registration.resource_name == "nvidia.com/gpu"
        assert len(registration.next_update(T).devices) == 2
        _wait_probe(port, readiness, 200)
        assert _probe(port, liveness) == 200
        # Stopping (what the kubelet does on a rolling update) ends before the kubelet's SIGKILL:
        # the wait's deadline is the grace period.
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=pod["terminationGracePeriodSeconds"])
        assert code == 0, proc.communicate()[1]
    _, stderr = proc.communicate(timeout=T)
    assert stderr.lstrip().startswith("{"), "log-format json from the ConfigMap"
