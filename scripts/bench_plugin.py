"""The device-plugin figures, measured the same way for any plugin binary.

A plugin is a command line run as a child process (use ``exec`` in a wrapper script: the process
started is the one measured) with ``{socket_dir}`` and ``{kubelet_socket}`` replaced by the
kubelet stand-in's directory and socket, and ``{port}`` by a free TCP port. The kubelet stand-in is
the grpcio one of ``tests/support`` (its own stubs), so every plugin meets the same client. Per
run of one plugin:

* start → registered: process start until ``Register`` reaches the kubelet, kubelet already up
  (``--startups`` starts, each a fresh process, after one uncounted warm-up start);
* then one long-lived process: ``Allocate`` round trips as the kubelet sees them (two devices per
  request, one on a one-GPU node, from the first ListAndWatch update); kubelet restart →
  ``Register`` received again; idle CPU (every thread's scheduler time) and wake-ups (voluntary
  context switches of all its threads) while registered with one ListAndWatch stream open and
  nothing else happening; RSS at the end.

``--compare NAME=COMMAND`` (repeatable) measures other plugins beside gpuagent, runs interleaved
(gpuagent, then each other, ``--runs`` times), and prints the median of the runs per figure.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchlib import Row, free_port, percentile, tempdir


@dataclass(frozen=True)
class Plugin:
    name: str
    argv: tuple[str, ...]  # with {socket_dir}, {kubelet_socket}, {port} placeholders

    def command(self, socket_dir: Path, port: int) -> list[str]:
        values = {
            "socket_dir": str(socket_dir),
            "kubelet_socket": str(socket_dir / "kubelet.sock"),
            "port": str(port),
        }
        return [arg.format(**values) for arg in self.argv]


def gpuagent(
    gpus: int,
    python: str = sys.executable,
    extra: Sequence[str] = (),
    *,
    sim_config: Path | None = None,
) -> Plugin:
    """gpuagent on ``gpus`` simulated GPUs, or on the node ``sim_config`` describes (a replay)."""
    node = ("--sim-config", str(sim_config)) if sim_config else ("--simulate", str(gpus))
    return Plugin(
        "gpuagent",
        (python, "-m", "gpuagent", *node, "--socket-dir", "{socket_dir}",
         "--metrics-address", "127.0.0.1:{port}", "--log-level", "warning", *extra),
    )  # fmt: skip


def replay_config(capture: Path, directory: Path) -> Path:
    """A ``--sim-config`` replaying ``capture`` (``scripts/nvml-capture``): the captured node, its
    answers and each call's captured latency."""
    path = directory / "replay.yaml"
    path.write_text(f"version: v1\ncapture: {json.dumps(str(capture.resolve()))}\n")
    return path


def parse_compare(spec: str) -> Plugin:
    """``NAME=COMMAND``, the command shell-quoted (``env K=V command …`` sets its environment)."""
    name, sep, command = spec.partition("=")
    if not sep or not name or not command or name == "gpuagent":
        raise SystemExit(f"--compare wants NAME=COMMAND (NAME not gpuagent), got {spec!r}")
    return Plugin(name, tuple(shlex.split(command)))


@dataclass
class Process:
    proc: subprocess.Popen[bytes]
    started: float

    def cpu_seconds(self) -> float:
        """CPU time of every thread, in nanoseconds as the scheduler counts it (schedstat):
        clock ticks (``/proc/PID/stat``) are too coarse for an idle process's short bursts."""
        total = 0
        for task in Path(f"/proc/{self.proc.pid}/task").iterdir():
            try:
                total += int((task / "schedstat").read_text().split()[0])
            except (OSError, ValueError):
                continue  # the thread ended
        return total / 1e9

    def wakeups(self) -> int:
        """Voluntary context switches of every thread: each is a sleep ended by a wake-up."""
        total = 0
        for task in Path(f"/proc/{self.proc.pid}/task").iterdir():
            try:
                status = (task / "status").read_text()
            except OSError:
                continue  # the thread ended
            for line in status.splitlines():
                if line.startswith("voluntary_ctxt_switches:"):
                    total += int(line.split()[1])
        return total

    def memory_mib(self) -> tuple[float, float]:
        """(VmRSS, VmHWM) in MiB."""
        values = {}
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            values[key] = value
        return int(values["VmRSS"].split()[0]) / 1024, int(values["VmHWM"].split()[0]) / 1024


@contextmanager
def running(plugin: Plugin, socket_dir: Path, *, log: Path | None = None) -> Iterator[Process]:
    out = open(log, "ab") if log is not None else subprocess.DEVNULL  # noqa: SIM115
    started = time.monotonic()
    proc = subprocess.Popen(plugin.command(socket_dir, free_port()), stdout=out, stderr=out)
    try:
        yield Process(proc, started)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if log is not None:
            out.close()  # type: ignore[union-attr]


@dataclass
class Figures:
    """One run's figures, seconds (or MiB, %, per second)."""

    start: list[float] = field(default_factory=list)
    start_cpu: list[float] = field(default_factory=list)  # the process's CPU time until then
    reregistered: list[float] = field(default_factory=list)
    allocate: list[float] = field(default_factory=list)
    idle_cpu_percent: float = 0.0
    idle_wakeups_per_s: float = 0.0
    rss_mib: float = 0.0
    hwm_mib: float = 0.0


def start_times(
    plugin: Plugin, stubs: Any, *, startups: int, log: Path | None = None
) -> list[float]:
    """Process start → ``Register`` received, ``startups`` times, the kubelet already up."""
    return start_figures(plugin, stubs, startups=startups, log=log)[0]


def start_figures(
    plugin: Plugin, stubs: Any, *, startups: int, log: Path | None = None
) -> tuple[list[float], list[float]]:
    """Process start → ``Register`` received, and the CPU time the process (every thread) had
    used by then, ``startups`` times, the kubelet already up. The CPU time is the steadier figure
    on a busy machine: the wall time counts the other processes' turns too."""
    from support.fake_kubelet import FakeKubelet  # noqa: PLC0415

    times, cpu = [], []
    for n in range(startups + 1):  # the first start is a warm-up (page cache, bytecode cache)
        with tempdir() as d, FakeKubelet(d, stubs) as kubelet, running(plugin, d, log=log) as p:
            (reg,) = kubelet.wait_for_registrations(1, 30)
            used = p.cpu_seconds()
            if n:
                times.append(reg.received_at - p.started)
                cpu.append(used)
    return times, cpu


def bytecode_cache(directory: Path) -> None:
    """Let the plugin processes started from now on keep compiled bytecode in ``directory``.

    The image runs bytecode compiled when it was built (pip compiles at install time); a source
    tree run with ``PYTHONDONTWRITEBYTECODE=1`` set (as on this project's machines) compiles every
    module of its own at every start instead. Python processes only; others ignore the variables.
    """
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    os.environ["PYTHONPYCACHEPREFIX"] = str(directory)


#: Imports every gpuagent module (and with them the libraries they import), compiling them.
_IMPORT_ALL = (
    "import importlib, pkgutil, gpuagent\n"
    "for m in pkgutil.walk_packages(gpuagent.__path__, 'gpuagent.'):\n"
    "    if not m.name.endswith('__main__'):\n"
    "        importlib.import_module(m.name)\n"
)


def warm_bytecode(python: str) -> None:
    """Compile gpuagent's modules, and the libraries they import, into the bytecode cache
    (:func:`bytecode_cache`) before any agent is measured, as the image has them: an agent that
    compiles its own at start holds ~15 MiB more afterwards (measured at 8 x 50: 76.4 MiB with
    a cold cache, 61.3 MiB with a warm one), which is the compiler's, not the agent's."""
    subprocess.run([python, "-c", _IMPORT_ALL], check=True, stdout=subprocess.DEVNULL)


def measure(
    plugin: Plugin,
    stubs: Any,
    *,
    startups: int,
    allocations: int,
    restarts: int,
    idle_seconds: float,
    log: Path | None = None,
) -> Figures:
    from support.fake_kubelet import FakeKubelet  # noqa: PLC0415

    start, start_cpu = start_figures(plugin, stubs, startups=startups, log=log)
    figures = Figures(start=start, start_cpu=start_cpu)
    with tempdir() as d, FakeKubelet(d, stubs) as kubelet, running(plugin, d, log=log) as p:
        (reg,) = kubelet.wait_for_registrations(1, 30)
        ids = [dev.ID for dev in reg.next_update(30).devices]
        if not ids:
            raise SystemExit(f"{plugin.name} lists no device; the bench needs one")
        size = min(2, len(ids))  # two devices a request (one on a one-GPU node)
        for i in range(50):  # warm-up: connections, caches, the first responses
            kubelet.allocate([ids[i % len(ids)]])
        for i in range(allocations):
            chosen = [ids[(i + k) % len(ids)] for k in range(size)]
            t0 = time.perf_counter()
            kubelet.allocate(chosen)
            figures.allocate.append(time.perf_counter() - t0)
        for n in range(2, restarts + 2):
            kubelet.restart()
            regs = kubelet.wait_for_registrations(n, 30)
            figures.reregistered.append(regs[-1].received_at - kubelet.restarts[-1])
            regs[-1].next_update(30)  # serving again before the next restart
        time.sleep(2.0)  # let the last restart's work settle
        cpu0, wake0, t0 = p.cpu_seconds(), p.wakeups(), time.monotonic()
        time.sleep(idle_seconds)
        elapsed = time.monotonic() - t0
        figures.idle_cpu_percent = (p.cpu_seconds() - cpu0) / elapsed * 100
        figures.idle_wakeups_per_s = (p.wakeups() - wake0) / elapsed
        figures.rss_mib, figures.hwm_mib = p.memory_mib()
    return figures


# Each figure: its label, how it is read from one run, its format, and gpuagent's target.
FIGURES: list[tuple[str, Any, str, tuple[str, Any] | None]] = [
    ("start → registered p50", lambda f: statistics.median(f.start), "ms", ("< 250 ms", 0.25)),
    ("start → registered max", lambda f: max(f.start), "ms", None),
    ("start → registered, CPU used p50", lambda f: statistics.median(f.start_cpu), "ms", None),
    ("kubelet restart → re-registered p50", lambda f: statistics.median(f.reregistered), "ms",
     None),
    ("kubelet restart → re-registered p99", lambda f: percentile(f.reregistered, 99), "ms",
     ("< 20 ms", 0.020)),
    ("kubelet restart → re-registered max", lambda f: max(f.reregistered), "ms", None),
    ("Allocate round trip p50", lambda f: percentile(f.allocate, 50), "ms", ("< 0.6 ms", 0.0006)),
    ("Allocate round trip p99", lambda f: percentile(f.allocate, 99), "ms", ("< 2 ms", 0.002)),
    ("RSS (peak)", lambda f: f.rss_mib, "MiB", ("< 45 MB", 45 / 1.048576)),
    ("idle CPU", lambda f: f.idle_cpu_percent, "%", ("< 0.3 % of a core", 0.3)),
    ("idle wake-ups (all threads)", lambda f: f.idle_wakeups_per_s, "/s", None),
]  # fmt: skip


def show(value: float, unit: str, figures: Figures | None = None) -> str:
    if unit == "ms":
        return f"{value * 1000:.2f} ms"
    if unit == "MiB":
        return f"{value:.1f} MiB" + (f" ({figures.hwm_mib:.1f})" if figures else "")
    if unit == "%":
        return f"{value:.2f} % of a core"
    return f"{value:.1f} /s"


def rows(runs: Mapping[str, list[Figures]]) -> list[Row]:
    """gpuagent's rows (median of its runs) with their targets; other plugins in the value."""
    out = []
    for label, read, unit, target in FIGURES:
        values = {name: statistics.median(read(f) for f in figs) for name, figs in runs.items()}
        ours = values["gpuagent"]
        last = runs["gpuagent"][-1] if unit == "MiB" else None
        text = show(ours, unit, last)
        others = [f"{name}: {show(v, unit)}" for name, v in values.items() if name != "gpuagent"]
        if others:
            text += " (" + "; ".join(others) + ")"
        runs_note = (
            f" (median of {len(runs['gpuagent'])} runs)" if len(runs["gpuagent"]) > 1 else ""
        )
        if target is None:
            out.append(Row(label + runs_note, text, "", None))
        else:
            out.append(Row(label + runs_note, text, target[0], ours < target[1]))
    return out


def compare_table(runs: Mapping[str, list[Figures]]) -> str:
    """Every plugin side by side: the median of the runs, and each plugin against gpuagent."""
    names = list(runs)
    header = ["figure (median of runs)", *names]
    if len(names) > 1:
        header += [f"{n} / gpuagent" for n in names[1:]]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for label, read, unit, _ in FIGURES:
        values = [statistics.median(read(f) for f in runs[n]) for n in names]
        cells = [label, *(show(v, unit) for v in values)]
        cells += [f"{v / values[0]:.2f}x" if values[0] else "—" for v in values[1:]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
