"""Start → registered with and without the DRA side (``scripts/bench --only-start``).

The same agent started as a plain node and as a DRA node (``--dra-gpus all``, a kubeconfig of an
API server that is not there: registration with the kubelet needs none), starts interleaved, each
a fresh process measured from exec until ``Register`` reaches the kubelet stand-in
(:func:`bench_plugin.start_figures`), on ``--gpus`` simulated GPUs or the ``--replay`` node. The
CPU time the process had used by then is the steadier figure on a busy machine.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import bench_plugin
from benchlib import Row, free_port, ms
from support.fake_apiserver import FakeApiServer
from support.grpcstubs import StubModules

__all__ = ["add_arguments", "dra_args", "rows"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--start-rounds", type=int, default=3,
                        help="--only-start: rounds of --startups starts of each node, "
                        "interleaved")  # fmt: skip


def dra_args(directory: Path) -> tuple[str, ...]:
    """What makes the agent a DRA node, its directories under ``directory`` and its kubeconfig
    naming an API server that is not there."""
    directory.mkdir(parents=True, exist_ok=True)
    api = FakeApiServer(node="bench", port=free_port())  # (never started: nobody answers)
    kubeconfig = api.kubeconfig(directory / "kubeconfig")
    return (
        "--dra-gpus", "all", "--kubeconfig", str(kubeconfig),
        "--plugins-dir", str(directory / "plugins"),
        "--plugins-registry-dir", str(directory / "plugins_registry"),
        "--cdi-spec-dir", str(directory / "cdi"),
    )  # fmt: skip


def rows(
    stubs: StubModules, args: argparse.Namespace, directory: Path, replay: Path | None
) -> list[Row]:
    nodes = {
        "plain": bench_plugin.gpuagent(args.gpus, args.agent_python, sim_config=replay),
        "DRA": bench_plugin.gpuagent(
            args.gpus, args.agent_python, dra_args(directory / "dra"), sim_config=replay
        ),
    }
    wall: dict[str, list[float]] = {name: [] for name in nodes}
    cpu: dict[str, list[float]] = {name: [] for name in nodes}
    for _ in range(args.start_rounds):
        for name, plugin in nodes.items():
            times, used = bench_plugin.start_figures(plugin, stubs, startups=args.startups)
            wall[name] += times
            cpu[name] += used
    where = f"replayed {args.replay.name}" if replay else f"{args.gpus} simulated GPUs"
    out = []
    for name in nodes:
        runs = f"{len(wall[name])} starts, {where}"
        out.append(Row(f"start → registered p50 / max, {name} node ({runs})",
                       f"{ms(statistics.median(wall[name]), 1)} / {ms(max(wall[name]), 1)}",
                       "", None))  # fmt: skip
        out.append(Row(f"start → registered, CPU used by then p50, {name} node",
                       ms(statistics.median(cpu[name]), 1), "", None))  # fmt: skip
    return out
