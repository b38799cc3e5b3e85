"""The agent as a separate process: started, asked over HTTP, and reaped whatever happens."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import AnyStr

T = 15.0
"""A bound on each wait here (a deadline for a broken build)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "gpuagent", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )


def run_to_end(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpuagent", *args],
        capture_output=True,
        text=True,
        timeout=T,
        env={**os.environ, **(env or {})},
        check=False,
    )


def http_get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def wait_http(port: int, path: str, status: int) -> str:
    deadline = time.monotonic() + T
    last: tuple[int, str] | None = None
    while time.monotonic() < deadline:
        try:
            last = http_get(port, path)
        except OSError:
            last = None
        if last is not None and last[0] == status:
            return last[1]
        time.sleep(0.02)
    raise AssertionError(f"{path} never answered {status}; last: {last}")


def spawn_agent(socket_dir: Path, port: int, *more: str) -> subprocess.Popen[str]:
    """The agent on two simulated GPUs, logging JSON, with ``more`` arguments."""
    return spawn(
        "--simulate", "2",
        "--socket-dir", str(socket_dir),
        "--metrics-address", f"127.0.0.1:{port}",
        "--log-format", "json",
        *more,
    )  # fmt: skip


@contextmanager
def reaped(proc: subprocess.Popen[AnyStr]) -> Iterator[subprocess.Popen[AnyStr]]:
    """``proc``, killed on the way out if it still runs, and its pipes drained."""
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=T)
