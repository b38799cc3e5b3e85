"""Store rows of scripts/bench: what one poll round costs the store's consumers.

In process, on the event loop the agent uses (uvloop): a node of ``--gpus`` GPUs whose store
takes one update per GPU per round (new telemetry, as the poller stores each probe), followed
by a few turns of the loop so every consumer that woke runs. The consumers are the agent's own,
built as it builds them: a ListAndWatch stream per resource, DRA's device health stream and
ResourceSlice publisher (against an API server stand-in that only counts), the node-label and
CDI-spec keepers (writing to a temporary directory), and per-container accounting. The figure is
the round's time with them minus the round's time without any (the updates and the turns
alone): the work every consumer does to learn that a poll changed nothing it serves.

Run alone: ``.venv/bin/python scripts/bench_watch.py`` (from the repository root).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Coroutine
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import uvloop

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from benchlib import Row, table  # noqa: E402
from support.nodes import gpu, node  # noqa: E402

from gpuagent import logs  # noqa: E402
from gpuagent._proto import v1beta1 as pb  # noqa: E402
from gpuagent.domain.containers import ContainerSettings, DeviceListStrategy  # noqa: E402
from gpuagent.domain.devices import Telemetry  # noqa: E402
from gpuagent.domain.dra import DraGpus, dra_devices  # noqa: E402
from gpuagent.domain.plan import Plan  # noqa: E402
from gpuagent.domain.serving import ResourceView, ServingPolicy  # noqa: E402
from gpuagent.domain.snapshot import Snapshot  # noqa: E402
from gpuagent.dra.health import DeviceHealthStreams  # noqa: E402
from gpuagent.dra.service import DraConfig  # noqa: E402
from gpuagent.kube.slices import SlicePublisher  # noqa: E402
from gpuagent.kubelet.plugin import DevicePluginService  # noqa: E402
from gpuagent.nodefiles.cdicontent import CdiTarget  # noqa: E402
from gpuagent.nodefiles.cdikeeper import CdiSpecKeeper  # noqa: E402
from gpuagent.nodefiles.labelkeeper import LabelTarget, NodeFiles  # noqa: E402
from gpuagent.runtime.accountant import Accountant  # noqa: E402
from gpuagent.runtime.cri import CriClient  # noqa: E402
from gpuagent.runtime.procfs import ProcReader  # noqa: E402
from gpuagent.state.store import DeviceStore, per_snapshot  # noqa: E402

TURNS = 8  # loop turns after each update: enough for every woken consumer to run and wait again


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--watch-rounds", type=int, default=2000,
                        help="poll rounds timed for the store rows")  # fmt: skip
    parser.add_argument("--watch-streams", type=int, default=16,
                        help="ListAndWatch streams of the many-streams row")  # fmt: skip


class _CountingApi:
    """The API server as the slice publisher sees it, answering at once."""

    def __init__(self) -> None:
        self.writes = 0

    async def node_uid(self, node: str) -> str:
        return "uid"

    async def slices(self, node: str, driver: str) -> list[dict[str, Any]]:
        return []

    async def create_slice(self, manifest: dict[str, Any]) -> str:
        self.writes += 1
        return str(self.writes)

    async def replace_slice(self, manifest: dict[str, Any]) -> str:
        self.writes += 1
        return str(self.writes)

    async def delete_slice(self, name: str) -> None:
        self.writes += 1


def _consumers(
    store: DeviceStore, root: Path, streams: int, agent: bool
) -> list[Coroutine[Any, Any, None]]:
    stopping = asyncio.Event()
    view = ResourceView()
    jobs: list[Coroutine[Any, Any, None]] = []
    for _ in range(streams):
        service = DevicePluginService(store, view, "nvidia.com/gpu", stopping)
        jobs.append(_drain(service.list_and_watch(pb.Empty())))
    if not agent:
        return jobs

    # As the DRA side derives them: once per snapshot for all its consumers.
    devices = per_snapshot(lambda s: dra_devices(s, DraGpus(all=True)))

    health = DeviceHealthStreams(store, devices, DraConfig("gpu.nvidia.com", "node"), stopping)
    api: Any = _CountingApi()
    publisher = SlicePublisher(store, devices, api, node="node", driver="gpu.nvidia.com")
    labels = LabelTarget(root / "features", root / "machine-type", root / "sys")
    cdi = CdiSpecKeeper(store, CdiTarget(spec_dir=root / "cdi", read_root=root / "driver"))
    accountant = Accountant(store, ProcReader(root / "proc"), CriClient(root / "cri.sock"))
    jobs += [
        _drain(health.updates()),
        publisher.run(),
        NodeFiles(store, labels=labels).run(),
        cdi.run(),
        accountant.run(),
    ]
    return jobs


async def _drain(stream: AsyncIterator[object]) -> None:
    async for _ in stream:
        pass


async def _round_seconds(gpus: int, rounds: int, streams: int, agent: bool) -> list[float]:
    """CPU seconds per poll round (``gpus`` updates and their turns), the consumers running."""
    containers = ContainerSettings(strategies=(DeviceListStrategy.CDI_CRI,))
    plan = Plan(serving=ServingPolicy(containers=containers))
    store = DeviceStore(node(*(gpu(i) for i in range(gpus))), plan=plan)
    with tempfile.TemporaryDirectory() as tmp:
        tasks = [asyncio.create_task(job) for job in _consumers(store, Path(tmp), streams, agent)]
        try:
            for _ in range(50):  # first values, first files: before the clock starts
                await asyncio.sleep(0)
            took = []
            for n in range(rounds):
                started = time.process_time()
                for index in range(gpus):
                    reading = Telemetry(temperature_c=40.0 + n % 7, energy_mj=float(n))
                    store.update(partial(_reading, index=index, telemetry=reading))
                    for _ in range(TURNS):
                        await asyncio.sleep(0)
                took.append(time.process_time() - started)
            return took
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task


def _reading(snapshot: Snapshot, index: int, telemetry: Telemetry) -> Snapshot:
    gpus = tuple(replace(g, telemetry=telemetry) if g.index == index else g for g in snapshot.gpus)
    return replace(snapshot, gpus=gpus)


def measure(gpus: int, rounds: int, streams: int) -> dict[str, float]:
    """Median µs per poll round: bare, the agent's consumers, and ``streams`` streams alone."""

    def median_us(streams: int, agent: bool) -> float:
        took = uvloop.run(_round_seconds(gpus, rounds, streams, agent))
        return statistics.median(took) * 1e6

    bare = median_us(0, False)
    return {
        "bare": bare,
        "agent": median_us(1, True) - bare,
        "streams": median_us(streams, False) - bare,
    }


def rows(args: argparse.Namespace) -> list[Row]:
    logs.configure("console", "warning")
    m = measure(args.gpus, args.watch_rounds, args.watch_streams)
    shape = f"poll round, {args.gpus} GPUs"
    return [
        Row(f"{shape}: the store's updates alone", f"{m['bare']:.0f} µs", "", None),
        Row(f"{shape}: the agent's consumers (7), added", f"{m['agent']:.0f} µs", "", None),
        Row(
            f"{shape}: {args.watch_streams} ListAndWatch streams, added",
            f"{m['streams']:.0f} µs",
            "",
            None,
        ),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gpus", type=int, default=8)
    add_arguments(parser)
    args = parser.parse_args()
    print(table(rows(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
