"""What the bench scripts share: a row of the table and the table printed, percentiles and
milliseconds as the rows show them, a free port, and a real agent run as a separate process on
simulated GPUs (with the temporary socket directory it serves in).

Every ``bench_*.py`` module imports this one and none imports ``bench.py`` (which imports them
all): the scripts' imports have no circle (``tests/test_architecture.py`` holds them to it).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass
class Row:
    """One measure: what, its value, its target (``""``: none) and whether it met it."""

    what: str
    value: str
    target: str
    met: bool | None


def table(rows: list[Row]) -> str:
    width = max(len(r.what) for r in rows)
    vwidth = max(len(r.value) for r in rows)
    lines = [f"{'measure':<{width}}  {'value':<{vwidth}}  target", "-" * (width + vwidth + 20)]
    for r in rows:
        mark = "" if r.met is None else ("  ok" if r.met else "  MISSED")
        lines.append(f"{r.what:<{width}}  {r.value:<{vwidth}}  {r.target}{mark}")
    return "\n".join(lines)


def percentile(values: Sequence[float], p: float) -> float:
    """The ``p``-th percentile of ``values`` (nearest rank)."""
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1))))
    return ordered[k]


def ms(seconds: float, digits: int = 2) -> str:
    return f"{seconds * 1000:.{digits}f} ms"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Agent:
    """A running agent process and its metrics port."""

    proc: subprocess.Popen[bytes]
    port: int
    started: float

    def post_fault(self, body: dict[str, object]) -> None:
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/sim/faults",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=5) as response:
            response.read()

    def get(self, path: str) -> bytes:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as r:
            return bytes(r.read())

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime + stime

    def rss_mib(self) -> tuple[float, float]:
        status = Path(f"/proc/{self.proc.pid}/status").read_text().splitlines()
        values = {k: v for k, _, v in (line.partition(":") for line in status)}
        return int(values["VmRSS"].split()[0]) / 1024, int(values["VmHWM"].split()[0]) / 1024


@contextmanager
def agent(
    socket_dir: Path, gpus: int, extra: list[str] | None = None, *, sim_config: Path | None = None
) -> Iterator[Agent]:
    """gpuagent on ``gpus`` simulated GPUs (or the node of ``sim_config``), serving the kubelet
    in ``socket_dir``; stopped with SIGTERM afterwards."""
    port = free_port()
    started = time.monotonic()
    node = ["--sim-config", str(sim_config)] if sim_config else ["--simulate", str(gpus)]
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "gpuagent",
            *node,
            "--socket-dir", str(socket_dir),
            "--metrics-address", f"127.0.0.1:{port}",
            "--log-level", "warning",
            *(extra or []),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        yield Agent(proc, port, started)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def tempdir() -> Iterator[Path]:
    """A device-plugin socket directory in a fresh temporary directory, removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="gab-", dir="/tmp"))
    try:
        yield path / "device-plugins"
    finally:
        shutil.rmtree(path, ignore_errors=True)
