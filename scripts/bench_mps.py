"""Benchmark rows for MPS sharing (issue 31), a real agent process on simulated GPUs with the
stand-in ``nvidia-cuda-mps-control`` (gpuagent.gpu.sim.mpscontrol) under its driver root:

- agent start → every MPS replica Healthy on the kubelet stand-in's ListAndWatch stream, and
  the control daemon's start (its pid file written) → the same;
- the daemon lost (SIGKILL) → its replicas Unhealthy on the stream (target ≤ 2 s), and → Healthy
  again once the agent has started and configured a new one (target ≤ 5 s), over ``--mps-cycles``
  losses, each of a daemon that had been up for the keeper's ``stable`` time (a daemon killed
  sooner is a crash loop, and its restarts back off as they should).

The stand-in is a Python program: each of its client invocations (one per GPU's limit, one for
the thread percentage) starts an interpreter, which the real binary does not; the configuring
part of a start is slower here than on a node.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import time
from collections.abc import Callable
from typing import Any

from benchlib import Row, agent, percentile, tempdir
from support.fake_kubelet import FakeKubelet
from support.grpcstubs import StubModules

from gpuagent.gpu.sim.mpscontrol import PID_FILE, install
from gpuagent.mps.daemon import Timing

RESOURCE = "nvidia.com/gpu"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mps-replicas", type=int, default=4, help="MPS replicas per GPU")
    parser.add_argument("--mps-cycles", type=int, default=20, help="daemon kills to time")


def _all(state: str) -> Callable[[Any], bool]:
    return lambda update: bool(update.devices) and all(d.health == state for d in update.devices)


def _percentiles(values: list[float]) -> str:
    p99 = percentile(values, 99)
    return (
        f"p50 {statistics.median(values) * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms, "
        f"max {max(values) * 1000:.0f} ms"
    )


def rows(stubs: StubModules, args: argparse.Namespace) -> list[Row]:
    sharing = f"{{mps: {{resources: [{{name: {RESOURCE}, replicas: {args.mps_replicas}}}]}}}}"
    with tempdir() as d, FakeKubelet(d, stubs) as kubelet:
        driver, mps_root = d.parent / "driver", d.parent / "mps"
        install(driver)
        pid_file = mps_root / RESOURCE / "pipe" / PID_FILE
        extra = ["--nvidia-driver-root", str(driver), "--mps-root", str(mps_root),
                 "--sharing", sharing]  # fmt: skip
        with agent(d, args.gpus, extra) as a:
            (reg,) = kubelet.wait_for_registrations(1, 60)
            reg.wait_until(_all("Healthy"), 60)
            healthy_at = time.time()
            from_agent = time.monotonic() - a.started
            from_daemon = healthy_at - pid_file.stat().st_mtime
            lost, back = [], []
            for _ in range(args.mps_cycles):
                time.sleep(Timing().stable)  # up long enough: a loss, not a crash loop
                pid = int(pid_file.read_text())
                t0 = time.monotonic()
                os.kill(pid, signal.SIGKILL)
                reg.wait_until(_all("Unhealthy"), 10)
                lost.append(time.monotonic() - t0)
                reg.wait_until(_all("Healthy"), 30)
                back.append(time.monotonic() - t0)
    shape = f"{args.gpus} GPUs x {args.mps_replicas} replicas"
    return [
        Row(f"MPS: agent start → replicas Healthy on stream, {shape}", f"{from_agent:.2f} s",
            "", None),
        Row(f"MPS: daemon started → replicas Healthy on stream, {shape}",
            f"{from_daemon:.2f} s", "", None),
        Row(f"MPS: daemon lost → replicas Unhealthy on stream ({args.mps_cycles} kills)",
            _percentiles(lost), "≤ 2 s", max(lost) <= 2.0),
        Row(f"MPS: daemon lost → restarted, replicas Healthy on stream ({args.mps_cycles} kills)",
            _percentiles(back), "≤ 5 s", max(back) <= 5.0),
    ]  # fmt: skip
