"""A rolling update with surge: a second agent on the node takes over, the first stands by."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import pytest
from support.fake_kubelet import FakeKubelet

from e2e.agentprocess import free_port, spawn_agent, wait_http

pytestmark = pytest.mark.slow
T = 15.0


def _spawn(socket_dir: Path) -> tuple[subprocess.Popen[str], int]:
    port = free_port()
    return spawn_agent(socket_dir, port), port


def test_new_agent_takes_over_and_the_old_one_stands_by(
    fake_kubelet: FakeKubelet, device_plugin_dir: Path
) -> None:
    old, old_port = _spawn(device_plugin_dir)
    new: subprocess.Popen[str] | None = None
    try:
        fake_kubelet.wait_for_registrations(1, T)
        new, new_port = _spawn(device_plugin_dir)
        fake_kubelet.wait_for_registrations(2, T)
        # No ping-pong: the old agent says it stands by (it registers again only once the new
        # agent's socket is gone or the kubelet restarts), and the new one is registered.
        assert "another plugin serves this socket" in wait_http(old_port, "/readyz", 503)
        wait_http(new_port, "/readyz", 200)
        assert len(fake_kubelet.attempts) == 2
        sock = device_plugin_dir / "nvidia-gpu.sock"
        before = sock.stat().st_ino
        old.send_signal(signal.SIGTERM)
        assert old.wait(T) == 0
        assert sock.exists(), "the old agent removed the new agent's socket"
        assert sock.stat().st_ino == before  # so the new agent has no reason to register again
        assert len(fake_kubelet.attempts) == 2
        wait_http(new_port, "/readyz", 200)
        latest = fake_kubelet.latest()
        assert latest.ended is None, "the new agent's stream must stay open"
    finally:
        for proc in (old, new):
            if proc is not None and proc.poll() is None:
                proc.kill()
            if proc is not None:
                proc.communicate(timeout=T)


def test_the_old_agent_says_the_new_one_left_not_that_the_kubelet_restarted(
    fake_kubelet: FakeKubelet, device_plugin_dir: Path
) -> None:
    """The new agent stops first (a rollback, or a second agent run by hand): the one standing by
    serves and registers again, and says why as it was: the kubelet did not restart."""
    old, old_port = _spawn(device_plugin_dir)
    new: subprocess.Popen[str] | None = None
    try:
        fake_kubelet.wait_for_registrations(1, T)
        new, _ = _spawn(device_plugin_dir)
        fake_kubelet.wait_for_registrations(2, T)
        assert "another plugin serves this socket" in wait_http(old_port, "/readyz", 503)
        new.send_signal(signal.SIGTERM)
        new.communicate(timeout=T)
        assert new.returncode == 0
        fake_kubelet.wait_for_registrations(3, T)
        wait_http(old_port, "/readyz", 200)
        old.send_signal(signal.SIGTERM)
        _, stderr = old.communicate(timeout=T)
        events = [json.loads(line)["event"] for line in stderr.splitlines()]
        again = [e for e in events if "registering again" in e]
        assert again == [
            "the plugin that took over our socket is gone; serving and registering again"
        ]
    finally:
        for proc in (old, new):
            if proc is not None and proc.poll() is None:
                proc.kill()
            if proc is not None and proc.stdout is not None and not proc.stdout.closed:
                proc.communicate(timeout=T)
