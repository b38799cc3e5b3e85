#!/usr/bin/env python3
"""Check gpuagent on a real NVIDIA GPU node: one command, a report and the raw files.

    scripts/gpu-check                          everything, into gpu-check-<time>/
    scripts/gpu-check -o DIR --gfd ./gpu-feature-discovery --samples 30
    scripts/gpu-check --simulate 2 -o DIR      the same steps on the simulator (no GPU; a dry run)

It never changes the GPU's settings (MIG mode, compute mode, clocks, power limit, persistence
mode, ECC mode) and never resets it: every step only reads. The agent runs with
``--kubernetes=false`` and writes its files (node labels, CDI spec) into the output directory,
not the node's. Run it as root on the GPU node, from a checkout with gpuagent installed
(``pip install -e '.[test]'``).

Steps, each recorded in ``steps.json`` (``report.md`` says what each found):

1. the driver: pynvml loads ``libnvidia-ml.so.1`` (else: says why, runs nothing, exit 3);
2. ``scripts/nvml-capture`` → ``capture.json``: every call the agent makes, its answer and
   latency (``--anonymise``: the GPUs' UUIDs replaced);
3. the real-driver contract tests (``tests/gpu/test_contract.py -k real``) → ``contract.txt``;
4. the agent on the real driver for ``--samples`` seconds: its ``/metrics`` once a second beside
   ``nvidia-smi --query-gpu`` → ``samples.csv``, the last ``agent-metrics.txt``, its node labels
   ``agent-labels.txt``, its log ``agent.log``;
5. with ``--gfd BIN``: NVIDIA's GPU feature discovery, ``--oneshot`` → ``gfd-labels.txt``;
6. ``report.md`` (:mod:`gpu_check_report`).

Exit status: 0 when every step ran and every check agreed, 1 when one did not, 2 for bad
arguments, 3 without a usable NVIDIA driver.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_check_report import AGENT_COLUMNS, SMI_QUERY, metric_values, write_report

ROOT = Path(__file__).resolve().parent.parent
EXIT_OK, EXIT_DISAGREES, EXIT_USAGE, EXIT_NO_DRIVER = 0, 1, 2, 3
STEP_TIMEOUT_S = 600.0
AGENT_START_S = 60.0


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="gpu-check",
        description="Check gpuagent on this node's NVIDIA GPUs (read-only: never changes the "
        "GPU's settings, never resets it) and write a report.",
    )
    parser.add_argument("-o", "--output", type=Path, help="output directory (new or empty)")
    parser.add_argument("--gfd", type=Path, help="a GPU feature discovery binary to compare")
    parser.add_argument(
        "--samples", type=int, default=10, help="seconds of /metrics beside nvidia-smi (10)"
    )
    parser.add_argument("--anonymise", action="store_true", help="random UUIDs in the capture")
    parser.add_argument("--simulate", type=int, metavar="N", help="N simulated GPUs (dry run)")
    args = parser.parse_args(argv)
    if not 1 <= args.samples <= 3600:
        parser.error(f"--samples must be from 1 to 3600, got {args.samples}")
    if args.simulate is not None and not 1 <= args.simulate <= 64:
        parser.error(f"--simulate must be from 1 to 64 GPUs, got {args.simulate}")
    if args.gfd is not None and not os.access(args.gfd, os.X_OK):
        parser.error(f"--gfd {args.gfd}: not an executable file")
    if args.output is None:
        args.output = Path(f"gpu-check-{datetime.now(UTC):%Y%m%dT%H%M%SZ}")
    if args.output.exists() and any(args.output.iterdir()):
        parser.error(f"--output {args.output}: not empty (its files would be mixed up)")
    return args


def driver_problem() -> str | None:
    """Why this machine's NVIDIA driver cannot be used through pynvml; ``None`` when it can."""
    try:
        import pynvml  # noqa: PLC0415

        pynvml.nvmlInit()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    pynvml.nvmlShutdown()
    return None


class Steps:
    """What each step did, kept in ``steps.json`` as it goes."""

    def __init__(self, out: Path) -> None:
        self.path = out / "steps.json"
        self.steps: dict[str, dict[str, Any]] = {}

    def record(self, name: str, rc: int | None, started: float, note: str = "") -> None:
        seconds = round(time.monotonic() - started, 2)
        self.steps[name] = {"rc": rc, "seconds": seconds, "note": note}
        self.path.write_text(json.dumps(self.steps, indent=1) + "\n")

    def run(self, name: str, argv: list[str], log: Path, timeout: float = STEP_TIMEOUT_S) -> int:
        """Run ``argv`` from the checkout, its output into ``log``; its exit status."""
        started = time.monotonic()
        with log.open("w") as output:
            try:
                done = subprocess.run(argv, cwd=ROOT, stdout=output, stderr=subprocess.STDOUT,
                                      timeout=timeout, check=False)  # fmt: skip
            except subprocess.TimeoutExpired:
                self.record(name, None, started, f"timed out after {timeout:g} s")
                return 1
        self.record(name, done.returncode, started)
        return done.returncode


def capture(steps: Steps, out: Path, args: argparse.Namespace) -> int:
    argv = [sys.executable, str(ROOT / "scripts/nvml_capture.py"), "-o", str(out / "capture.json")]
    if args.simulate:
        argv += ["--simulate", str(args.simulate)]
    if args.anonymise:
        argv.append("--anonymise")
    return steps.run("capture", argv, out / "capture.log")


def contract(steps: Steps, out: Path, args: argparse.Namespace) -> int:
    if args.simulate:
        steps.record("contract", None, time.monotonic(), "a simulated node")
        return 0
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
            "tests/gpu/test_contract.py", "-k", "real", "-rs"]  # fmt: skip
    return steps.run("contract", argv, out / "contract.txt")


def agent_argv(out: Path, args: argparse.Namespace) -> list[str]:
    argv = [sys.executable, "-m", "gpuagent", "--kubernetes=false",
            "--metrics-address", "127.0.0.1:0", "--poll-interval", "1",
            "--detailed-agent-metrics", "--log-format", "json",
            "--node-labels-file", str(out / "agent-labels.txt"),
            "--cdi-spec-dir", str(out / "cdi")]  # fmt: skip
    return argv + (["--simulate", str(args.simulate)] if args.simulate else [])


def listening_port(log: Path, agent: subprocess.Popen[bytes], within: float) -> int | None:
    """The port the agent's log says it listens on, once it does (None: it never did)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline and agent.poll() is None:
        for line in log.read_text(errors="replace").splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if isinstance(entry, dict) and entry.get("event") == "http listening":
                return int(entry["port"])
        time.sleep(0.1)
    return None


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return int(response.status), response.read().decode()
    except OSError as exc:
        code = getattr(exc, "code", 0)
        return int(code) if isinstance(code, int) else 0, str(exc)


def run_agent(steps: Steps, out: Path, args: argparse.Namespace) -> int:
    """Start the agent, sample it beside nvidia-smi, stop it (SIGTERM: its clean shutdown)."""
    started = time.monotonic()
    log = out / "agent.log"
    with log.open("wb") as output:
        agent = subprocess.Popen(agent_argv(out, args), cwd=out, stdout=output,
                                 stderr=subprocess.STDOUT)  # fmt: skip
    try:
        port = listening_port(log, agent, AGENT_START_S)
        if port is None:
            steps.record("agent", agent.poll(), started, "never served /metrics (agent.log)")
            return 1
        base = f"http://127.0.0.1:{port}"
        ready = wait_ready(base, AGENT_START_S)
        rows = sample(base, out, args.samples)
        note = f"{rows} sample rows" + ("" if ready else "; /readyz never answered 200")
    finally:
        rc = stop(agent)
    steps.record("agent", rc, started, note)
    return 0 if ready and rc == 0 else 1


def wait_ready(base: str, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if get(base + "/readyz")[0] == 200:
            return True
        time.sleep(0.2)
    return False


def stop(agent: subprocess.Popen[bytes]) -> int | None:
    if agent.poll() is None:
        agent.send_signal(signal.SIGTERM)
        try:
            agent.wait(timeout=10)
        except subprocess.TimeoutExpired:
            agent.kill()
            agent.wait()
    return agent.returncode


def sample(base: str, out: Path, seconds: int) -> int:
    """Once a second: the agent's readings beside nvidia-smi's, per GPU, into samples.csv."""
    header = ["t", "gpu", *AGENT_COLUMNS, *(f"smi_{q}" for q in SMI_QUERY)]
    rows = 0
    began = time.monotonic()
    with (out / "samples.csv").open("w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(header)
        for tick in range(seconds):
            time.sleep(max(0.0, began + tick + 1 - time.monotonic()))
            status, text = get(base + "/metrics")
            if status != 200:
                continue
            (out / "agent-metrics.txt").write_text(text)
            smi = nvidia_smi()
            t = round(time.monotonic() - began, 1)
            for gpu, values in sorted(metric_values(text).items()):
                agent = [values.get(c, "") for c in AGENT_COLUMNS]
                writer.writerow([t, gpu, *agent, *smi.get(gpu, [""] * len(SMI_QUERY))])
                rows += 1
    return rows


def nvidia_smi() -> dict[str, list[str]]:
    """``nvidia-smi --query-gpu`` (read-only) by GPU index; empty without nvidia-smi."""
    query = ",".join(["index", *SMI_QUERY])
    try:
        done = subprocess.run(["nvidia-smi", f"--query-gpu={query}",
                               "--format=csv,noheader,nounits"], capture_output=True,
                              text=True, timeout=30, check=False)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return {}
    found = {}
    for line in done.stdout.splitlines() if done.returncode == 0 else []:
        cells = [c.strip() for c in line.split(",")]
        if len(cells) == len(SMI_QUERY) + 1:
            found[cells[0]] = cells[1:]
    return found


def gfd(steps: Steps, out: Path, binary: Path | None) -> int:
    if binary is None:
        steps.record("gfd", None, time.monotonic(), "no --gfd binary given")
        return 0
    argv = [str(binary.resolve()), "--oneshot", "--no-timestamp",
            "--use-node-feature-api=false", f"--output-file={out / 'gfd-labels.txt'}"]  # fmt: skip
    return steps.run("gfd", argv, out / "gfd.log", timeout=120)


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    out: Path = args.output
    out.mkdir(parents=True, exist_ok=True)
    steps = Steps(out)
    started = time.monotonic()
    problem = None if args.simulate else driver_problem()
    note = problem or ("simulated" if args.simulate else "libnvidia-ml.so.1 loaded")
    steps.record("driver", 0 if problem is None else 1, started, note)
    if problem is not None:
        write_report(out)
        print(f"gpu-check: no usable NVIDIA driver here ({problem}); nothing was run. "
              f"See {out / 'report.md'}", file=sys.stderr)  # fmt: skip
        return EXIT_NO_DRIVER
    failed = 0
    for step in (capture, contract, run_agent):
        failed |= step(steps, out, args) != 0
    failed |= gfd(steps, out, args.gfd) != 0
    agreed = write_report(out)
    print(f"gpu-check: report in {out / 'report.md'}")
    return EXIT_OK if not failed and agreed else EXIT_DISAGREES


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
