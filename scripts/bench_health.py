"""Benchmark rows for health and start-up on the strict simulator (issue 12).

- the poll cycle's cost per GPU with the simulator's default call latencies (in-process: the
  backend's probe of each of 8 GPUs, as the poller makes it, and its NVML calls);
- start → registered on a cold 8-GPU node (every GPU brought up by its first call, as without
  persistence mode: 1.5 s each by default) and on a driver answering every call in 100 ms.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import yaml
from benchlib import Row, agent, tempdir
from support.fake_kubelet import FakeKubelet
from support.grpcstubs import StubModules

from gpuagent.gpu import sim
from gpuagent.gpu.nvml import Nvml


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--health-poll-cycles", type=int, default=200, help="probe cycles for the poll-cost row")
    add("--cold-start-ms", type=float, default=1500.0, help="bring-up time of a cold GPU")
    add("--slow-call-ms", type=float, default=100.0, help="per-call latency of the slow driver")


class _Clock:
    """Monotonic seconds that the benchmark moves (so each probe takes a GPM sample)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def poll_cost(gpus: int, cycles: int) -> tuple[list[float], float]:
    """Seconds per GPU probe (one per GPU and cycle), and NVML calls per GPU and cycle."""
    clock = _Clock()
    driver = sim.SimDriver(sim.node_from_count(gpus), clock=clock)
    with tempfile.TemporaryDirectory() as sysfs, sim.installed(driver):
        backend = Nvml(Path(sysfs), clock=clock)
        backend.init()
        backend.discover()
        backend.open_events()
        try:
            for index in range(gpus):  # the first probe of each GPU only takes a GPM sample
                backend.probe(index)
            before = Counter(driver.calls)
            took = []
            for _ in range(cycles):
                clock.now += 5.0
                for index in range(gpus):
                    started = time.perf_counter()
                    backend.probe(index)
                    took.append(time.perf_counter() - started)
            calls = Counter(driver.calls)
            calls.subtract(before)
        finally:
            backend.shutdown()
    return took, calls.total() / (cycles * gpus)


def _startup(
    stubs: StubModules,
    node: dict[str, Any],
    timeout: float,
) -> float:
    """Process start → Register received by the kubelet, on the node described by ``node``."""
    with tempdir() as d, FakeKubelet(d, stubs) as kubelet:
        config = d.parent / "node.yaml"
        config.write_text(yaml.safe_dump(node))
        with agent(d, 0, sim_config=config) as a:
            (reg,) = kubelet.wait_for_registrations(1, timeout)
            return float(reg.received_at - a.started)


def rows(stubs: StubModules, args: argparse.Namespace) -> list[Row]:
    out = []
    took, calls = poll_cost(args.gpus, args.health_poll_cycles)
    p50, p99 = statistics.median(took), sorted(took)[int(0.99 * (len(took) - 1))]
    out.append(Row(f"poll cycle per GPU (probe), {args.gpus} GPUs, default sim latencies p50",
                   f"{p50 * 1000:.2f} ms, {calls:.0f} NVML calls", "", None))  # fmt: skip
    out.append(Row(f"poll cycle per GPU (probe), {args.gpus} GPUs, default sim latencies p99",
                   f"{p99 * 1000:.2f} ms", "", None))  # fmt: skip
    gpus: list[dict[str, object]] = [{} for _ in range(args.gpus)]
    cold = _startup(
        stubs,
        {"version": "v1", "gpus": gpus, "latency": {"cold_start_ms": args.cold_start_ms}},
        timeout=120,
    )
    out.append(Row(f"start → registered, cold {args.gpus}-GPU node "
                   f"({args.cold_start_ms / 1000:g} s per GPU bring-up)", f"{cold:.2f} s",
                   f"< {args.cold_start_ms / 1000 + 1:g} s",
                   cold < args.cold_start_ms / 1000 + 1))  # fmt: skip
    slow = _startup(
        stubs,
        {"version": "v1", "gpus": gpus,
         "latency": {"default_ms": args.slow_call_ms, "calls": {"nvmlEventSetWait_v2": 0}}},
        timeout=300,
    )  # fmt: skip
    out.append(Row(f"start → registered, {args.gpus} GPUs at {args.slow_call_ms:g} ms per call",
                   f"{slow:.2f} s", "registers", True))  # fmt: skip
    return out
