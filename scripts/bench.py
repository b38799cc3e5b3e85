"""Benchmark gpuagent as a separate process, driven by the grpcio kubelet stand-in.

Measures, on simulated GPUs, the device-plugin figures of ``bench_plugin.py`` (start →
registered, kubelet restart → registered again, Allocate round trip, RSS, idle CPU and wake-ups:
the same for any plugin binary given with ``--compare``), then gpuagent's own: preferred
allocation, the agent's own part of an ``Allocate``, fault injected → Unhealthy seen on the
ListAndWatch stream, ``/metrics``, DRA, per-container accounting, MPS sharing's daemon (start,
lost, restarted), what a poll round costs the store's consumers, and what a poll costs on the
replayed real H200 (NVML time, idle CPU). Prints a table with each target; exits 0 even when a
target is missed (the numbers are for people, not a gate: shared machines are noisy).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import bench_accounting  # noqa: E402
import bench_answers  # noqa: E402
import bench_dra  # noqa: E402
import bench_fleet  # noqa: E402
import bench_health  # noqa: E402
import bench_kube  # noqa: E402
import bench_metrics  # noqa: E402
import bench_mps  # noqa: E402
import bench_plugin  # noqa: E402
import bench_poll  # noqa: E402
import bench_series  # noqa: E402
import bench_start  # noqa: E402
import bench_watch  # noqa: E402
from bench_preferred import bench_preferred  # noqa: E402
from benchlib import Row, agent, ms, percentile, table, tempdir  # noqa: E402
from support.fake_kubelet import FakeKubelet  # noqa: E402
from support.grpcstubs import StubModules, kubelet_stubs  # noqa: E402

REAL_H200 = ROOT.parent / "shared" / "reference" / "real-h200" / "capture-h200.json"


def health(update: Any) -> dict[str, str]:
    return {d.ID: d.health for d in update.devices}


def shows(device_id: str, state: str) -> Callable[[Any], bool]:
    """A predicate: the ListAndWatch update shows ``device_id`` in ``state``."""
    return lambda update: health(update)[device_id] == state


def bench_running(stubs: StubModules, args: argparse.Namespace) -> list[Row]:
    rows: list[Row] = []
    with tempdir() as d, FakeKubelet(d, stubs) as kubelet, agent(d, args.gpus) as a:
        (reg,) = kubelet.wait_for_registrations(1, 30)
        first = reg.next_update(10)
        ids = [dev.ID for dev in first.devices]

        # GetPreferredAllocation round trip, as the kubelet sees it.
        latencies = []
        for i in range(args.allocations // 4):
            size = 1 + i % (len(ids) - 1)
            t0 = time.perf_counter()
            kubelet.preferred(ids, ids[i % len(ids) : i % len(ids) + 1], size)
            latencies.append(time.perf_counter() - t0)
        p99 = percentile(latencies, 99)
        rows.append(Row(f"GetPreferredAllocation round trip p50, {len(ids)} GPUs",
                        ms(percentile(latencies, 50)), "", None))  # fmt: skip
        rows.append(Row(f"GetPreferredAllocation round trip p99, {len(ids)} GPUs", ms(p99),
                        "< 5 ms", p99 < 0.005))  # fmt: skip

        # Fault → Unhealthy on the stream, and recover → Healthy.
        to_unhealthy, to_healthy = [], []
        for i in range(args.faults):
            gpu = i % len(ids)
            t0 = time.perf_counter()
            a.post_fault({"gpu": gpu, "fault": "xid", "xid": 79})
            reg.wait_until(shows(ids[gpu], "Unhealthy"), 10)
            to_unhealthy.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            a.post_fault({"gpu": gpu, "fault": "recover"})
            reg.wait_until(shows(ids[gpu], "Healthy"), 10)
            to_healthy.append(time.perf_counter() - t0)
        p99 = percentile(to_unhealthy, 99)
        rows.append(Row("XID → Unhealthy on stream p50", ms(percentile(to_unhealthy, 50)), "",
                        None))  # fmt: skip
        rows.append(Row("XID → Unhealthy on stream p99", ms(p99), "< 100 ms", p99 < 0.1))
        rows.append(Row("recover → Healthy on stream p99", ms(percentile(to_healthy, 99)), "",
                        None))  # fmt: skip

        # One scrape, for scale.
        t0 = time.perf_counter()
        size = len(a.get("/metrics"))
        rows.append(Row("GET /metrics", f"{ms(time.perf_counter() - t0)}, {size} bytes", "",
                        None))  # fmt: skip
    return rows


def plugin_runs(
    stubs: StubModules, plugins: list[bench_plugin.Plugin], args: argparse.Namespace
) -> dict[str, list[bench_plugin.Figures]]:
    """Each plugin's figures, ``--runs`` times, interleaved."""
    runs: dict[str, list[bench_plugin.Figures]] = {p.name: [] for p in plugins}
    for n in range(args.runs):
        for plugin in plugins:
            print(f"run {n + 1}/{args.runs}: {plugin.name}", file=sys.stderr, flush=True)
            runs[plugin.name].append(
                bench_plugin.measure(
                    plugin, stubs,
                    startups=args.startups, allocations=args.allocations,
                    restarts=args.restarts, idle_seconds=args.idle_seconds, log=args.plugin_log,
                )
            )  # fmt: skip
    return runs


def bench_preferred_search() -> list[Row]:
    """The preferred-allocation search alone (the domain function the service calls)."""
    rows = []
    for gpus, replicas, target in ((16, 0, 0.050), (8, 48, 0.005)):
        timing = bench_preferred(gpus, replicas=replicas, calls=500)
        shape = f"{gpus} GPUs" + (f" x {replicas} replicas" if replicas else "")
        rows.append(Row(f"preferred-allocation search p50, {shape}", f"{timing.p50_ms:.2f} ms",
                        "", None))  # fmt: skip
        rows.append(Row(f"preferred-allocation search p99, {shape}", f"{timing.p99_ms:.2f} ms",
                        f"< {target * 1000:.0f} ms", timing.p99_ms < target * 1000))  # fmt: skip
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--startups", type=int, default=5)
    parser.add_argument("--allocations", type=int, default=2000)
    parser.add_argument("--faults", type=int, default=100)
    parser.add_argument("--restarts", type=int, default=20)
    parser.add_argument("--idle-seconds", type=float, default=20.0)
    parser.add_argument("--runs", type=int, default=1,
                        help="runs of the device-plugin figures (median reported)")  # fmt: skip
    parser.add_argument("--only-plugin", action="store_true",
                        help="the device-plugin figures only (bench_plugin.py)")  # fmt: skip
    parser.add_argument(
        "--compare", action="append", default=[], metavar="NAME=COMMAND",
        help="also measure this plugin's device-plugin figures, runs interleaved with gpuagent's; "
        "{socket_dir}, {kubelet_socket} and {port} in COMMAND are filled in (repeatable)",
    )  # fmt: skip
    parser.add_argument("--plugin-log", type=Path, help="append the plugins' output here")
    parser.add_argument(
        "--replay", nargs="?", const=REAL_H200, type=Path, metavar="CAPTURE",
        help="gpuagent's device-plugin runs on a replayed node instead of --gpus simulated ones: "
        "the capture's GPUs, answers and call latencies (default: the real H200 of "
        "../shared/reference/real-h200)",
    )  # fmt: skip
    parser.add_argument("--agent-arg", action="append", default=[], metavar="ARG",
                        help="one more argument for gpuagent's device-plugin runs (repeatable), "
                        "e.g. --agent-arg=--poll-interval=3600")  # fmt: skip
    parser.add_argument(
        "--agent-python", default=sys.executable,
        help="the interpreter that runs gpuagent for the device-plugin figures (e.g. one of a "
        "virtual environment with only `pip install .` in it, as shipped)",
    )  # fmt: skip
    parser.add_argument(
        "--no-bytecode-cache", action="store_true",
        help="leave the plugins' bytecode as the environment has it (by default they keep "
        "compiled bytecode in a temporary cache, as the image has it: see bytecode_cache)",
    )  # fmt: skip
    parser.add_argument("--json", type=Path, help="also write the rows here")
    bench_metrics.add_arguments(parser)
    bench_series.add_arguments(parser)
    bench_fleet.add_arguments(parser)
    parser.add_argument("--only-fleet", action="store_true",
                        help="the fleet model's rows only (and its inputs)")  # fmt: skip
    parser.add_argument("--only-series", action="store_true",
                        help="the /metrics series, bytes and loop-stall rows only")  # fmt: skip
    bench_dra.add_arguments(parser)
    parser.add_argument("--only-dra", action="store_true", help="run the DRA rows only")
    parser.add_argument(
        "--only-dra-shares", action="store_true", help="run the DRA rows of shared claims only"
    )
    bench_kube.add_arguments(parser)
    parser.add_argument("--only-kube", action="store_true",
                        help="run the node condition and events rows only")  # fmt: skip
    parser.add_argument("--only-accounting", action="store_true",
                        help="run the per-container accounting rows only")  # fmt: skip
    bench_accounting.add_arguments(parser)
    parser.add_argument("--only-health", action="store_true",
                        help="run the health, start-up and poll-round rows only")  # fmt: skip
    bench_health.add_arguments(parser)
    bench_watch.add_arguments(parser)
    parser.add_argument("--only-poll", action="store_true",
                        help="the poll cost on the replayed real H200, idle CPU")  # fmt: skip
    bench_poll.add_arguments(parser)
    parser.add_argument("--only-mps", action="store_true",
                        help="run the MPS daemon rows only")  # fmt: skip
    bench_mps.add_arguments(parser)
    parser.add_argument("--only-start", action="store_true",
                        help="start → registered of a plain and a DRA node (--replay, "
                        "--startups, --start-rounds)")  # fmt: skip
    bench_start.add_arguments(parser)
    args = parser.parse_args()

    if args.only_dra_shares:
        print(table(bench_dra.share_rows(args)))
        return 0
    if args.only_dra:
        print(table(bench_dra.rows(args)))
        return 0
    if args.only_kube:
        print(table(bench_kube.rows(args)))
        return 0
    if args.only_series:
        print(table(bench_series.rows(args)))
        return 0
    if args.only_fleet:
        print(table(bench_fleet.rows(args)))
        return 0
    with tempfile.TemporaryDirectory() as stubs_dir:
        stubs = kubelet_stubs()
        if not args.no_bytecode_cache:
            bench_plugin.bytecode_cache(Path(stubs_dir) / "pycache")
            bench_plugin.warm_bytecode(sys.executable)
            if args.agent_python != sys.executable:
                bench_plugin.warm_bytecode(args.agent_python)
        if args.only_accounting:
            print(table(bench_accounting.rows(stubs, args)))
            return 0
        if args.only_poll:
            print(table(bench_poll.rows(stubs, args)))
            print(bench_poll.breakdown(args))
            return 0
        if args.only_mps:
            print(table(bench_mps.rows(stubs, args)))
            return 0
        if args.only_health:
            startup = bench_plugin.start_times(
                bench_plugin.gpuagent(args.gpus, args.agent_python), stubs,
                startups=args.startups,
            )  # fmt: skip
            rows = [Row(f"start → registered p50 ({args.startups} runs, warm)",
                        ms(statistics.median(startup)), "", None)]  # fmt: skip
            rows += [r for r in bench_running(stubs, args) if "→" in r.what]
            rows += bench_health.rows(stubs, args)
            rows += bench_watch.rows(args)
            print(table(rows))
            return 0
        replay = bench_plugin.replay_config(args.replay, Path(stubs_dir)) if args.replay else None
        if args.only_start:
            print(table(bench_start.rows(stubs, args, Path(stubs_dir), replay)))
            return 0
        plugins = [
            bench_plugin.gpuagent(args.gpus, args.agent_python, args.agent_arg, sim_config=replay)
        ]
        plugins += [bench_plugin.parse_compare(spec) for spec in args.compare]
        runs = plugin_runs(stubs, plugins, args)
        rows = bench_plugin.rows(runs)
        if args.compare or args.only_plugin:
            print(table(rows))
            if args.compare:
                print()
                print(bench_plugin.compare_table(runs))
            return 0
        rows += bench_running(stubs, args)
        rows += bench_preferred_search()
        rows += bench_answers.rows()
        rows += bench_metrics.rows(stubs, args)
        rows += bench_series.rows(args)
        rows += bench_fleet.rows(args)
        rows += bench_dra.rows(args)
        rows += bench_kube.rows(args)
        rows += bench_accounting.rows(stubs, args)
        rows += bench_mps.rows(stubs, args)
        rows += bench_health.rows(stubs, args)
        rows += bench_watch.rows(args)
        rows += bench_poll.rows(stubs, args)
    print(f"gpuagent bench: {args.gpus} simulated GPUs, Python {sys.version.split()[0]}, "
          f"{os.cpu_count()} CPUs")  # fmt: skip
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps([r.__dict__ for r in rows], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
