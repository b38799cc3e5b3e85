"""The fleet model of scripts/bench: what 5,000 (``--fleet-nodes``) eight-GPU nodes cost Prometheus
and the API server, from counts measured on one node.

Measured per node (counts, exact: they do not depend on this machine's speed):

- **/metrics** (:mod:`bench_series`): series and gzip bytes of a node with 8 GPUs (a real agent's
  page), and of 8 GPUs time-sliced among 10 and 50 containers each;
- **API requests of the node-health writer** (:mod:`bench_kube`'s rigs: the stand-in API server,
  a clock moved by hand): a day at rest, a storm of 1,000 XIDs over every GPU, and a 10-minute
  outage in which every GPU fails and half recover;
- **API requests of the DRA slice publisher** (every GPU through DRA), likewise: at rest, a
  storm of faults and recoveries over every GPU (1,000 a minute for 3 minutes: each changes a
  device's taints; the first minute, and the most of a later one), 1,000 XIDs of mixed codes in
  a minute over every GPU (the first of each GPU taints it; the rest change no taint), the same
  outage.

The model: Prometheus scrapes every ``--scrape-interval`` seconds (15), so samples/s = series /
15 and bytes/s = gzip bytes / 15; at rest every node makes its at-rest requests; in a fault storm
1 % of the nodes storm at once (their first minute); after an outage every node catches up within
the backoff's ceiling (60 s, full jitter spreads it).
"""

from __future__ import annotations

import argparse
import itertools
import random
import shutil
import tempfile
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import bench_kube
import bench_series
import uvloop
from benchlib import Row
from support.clock import ManualClock
from support.fake_apiserver import FakeApiServer
from support.kubehealth import settle
from support.noderig import NODE, last_xid, storm_xid, with_health, writing
from support.synthetic import synthetic_snapshot

from gpuagent import logs
from gpuagent.domain.backoff import Backoff
from gpuagent.domain.devices import Condition, GpuHealth
from gpuagent.domain.dra import DraGpus, dra_devices
from gpuagent.domain.snapshot import Snapshot
from gpuagent.kube.client import KubeApi, load_config
from gpuagent.kube.slices import SlicePublisher
from gpuagent.state.store import DeviceStore

XID_79 = GpuHealth((Condition("xid", "79"),))
TARGET_SERIES = 2_500_000
TARGET_SAMPLES = 200_000
TARGET_STORM_WRITES = 170.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scrape-interval", type=float, default=15.0,
                        help="the fleet model's Prometheus scrape interval (s)")  # fmt: skip


# ----- the DRA publisher's requests --------------------------------------------------------------
@dataclass
class _Dra:
    server: FakeApiServer
    store: DeviceStore
    clock: ManualClock
    publisher: SlicePublisher

    async def settle(self, seconds: float = 0.0) -> None:
        await settle(self.clock, self.publisher, self.store, seconds)

    async def change(self, change: Callable[[Snapshot], Snapshot]) -> None:
        self.store.update(change)
        await self.settle()

    def requests(self) -> int:
        return len(self.server.requests)

    def writes(self, since: int = 0) -> int:
        verbs = ("CREATE", "REPLACE", "DELETE", "POST", "PUT")
        return sum(1 for verb, _ in self.server.requests[since:] if verb in verbs)


async def _with_dra(
    gpus: int, root: Path, body: Callable[[_Dra], Coroutine[Any, Any, dict[str, float]]]
) -> dict[str, float]:
    server = FakeApiServer(node=NODE)
    await server.start()
    api = KubeApi(load_config(server.kubeconfig(root / "kubeconfig-dra")), timeout=5.0)
    store = DeviceStore(synthetic_snapshot(gpus))
    clock = ManualClock()
    publisher = SlicePublisher(
        store, lambda s: dra_devices(s, DraGpus(all=True)), api, node=NODE,
        driver="gpu.nvidia.com", clock=clock, draw=random.Random(7).random,
    )  # fmt: skip
    rig = _Dra(server, store, clock, publisher)
    async with writing(server, api, publisher.run()):
        await rig.settle(0.2)
        await rig.settle(600.0)  # a quiet spell after the first publication
        out = await body(rig)
        assert server.invalid == [], server.invalid
        return out


async def _dra_at_rest(rig: _Dra) -> dict[str, float]:
    """An hour of polls that change readings only."""
    start = rig.requests()
    for minute in range(60):
        await rig.change(last_xid(minute))
        await rig.settle(60.0)
    return {"per_hour": rig.requests() - start}


def _health(gpu: int, health: GpuHealth) -> Callable[[Snapshot], Snapshot]:
    """A change of the store: GPU ``gpu``'s health becomes ``health``."""
    return lambda snapshot: with_health(snapshot, gpu, health)


async def _dra_storm(rig: _Dra) -> dict[str, float]:
    """Faults and recoveries over every GPU, 1,000 a minute for 3 minutes (each a change of a
    device's taints): slice updates in each minute."""
    gpus = len(rig.store.snapshot.gpus)
    start = rig.requests()
    by_minute: list[int] = []
    for n in range(3000):
        state = XID_79 if n % (2 * gpus) < gpus else GpuHealth()
        await rig.change(_health(n % gpus, state))
        await rig.settle(0.06)
        if n % 1000 == 999:
            by_minute.append(rig.writes(start) - sum(by_minute))
    lists = sum(1 for verb, _ in rig.server.requests[start:] if verb == "LIST")
    return {"minute": by_minute[0], "most_after": max(by_minute[1:]), "lists": lists}


async def _dra_xid_storm(rig: _Dra) -> dict[str, float]:
    """1,000 XIDs of mixed codes in a minute over every GPU: the first of each GPU taints it, the
    rest change no taint (one per cause, its value fixed while the cause holds)."""
    gpus = len(rig.store.snapshot.gpus)
    start = rig.requests()
    codes = itertools.cycle([79, 48, 94, 119, 62])
    for n in range(1000):
        await rig.change(storm_xid(n % gpus, next(codes)))
        await rig.settle(0.06)
    return {"minute": rig.writes(start)}


async def _dra_outage(rig: _Dra) -> dict[str, float]:
    """10 minutes down while every GPU fails and half recover."""
    gpus = len(rig.store.snapshot.gpus)
    await rig.server.stop()
    for index in range(gpus):
        await rig.change(_health(index, XID_79))
        await rig.settle(20.0)
    for index in range(gpus // 2):
        await rig.change(_health(index, GpuHealth()))
        await rig.settle(20.0)
    while rig.clock.now() < 600.2 + 600.0:
        await rig.settle(10.0)
    counts = rig.publisher.pacer.counts.counts
    tries = sum(n for (_, result), n in counts.items() if result == "unreachable")
    before = rig.requests()
    await rig.server.start()
    await rig.settle(Backoff().maximum + 1.0)
    return {"tries": tries, "catch_up": rig.requests() - before}


async def _measure(gpus: int, root: Path) -> dict[str, dict[str, float]]:
    kube = bench_kube._with_rig  # the node-health rows' rig, shared
    return {
        "kube_rest": await kube(gpus, root, bench_kube._at_rest),
        "kube_storm": await kube(gpus, root, bench_kube._storm(spread=True)),
        "kube_outage": await kube(gpus, root, bench_kube._outage),
        "dra_rest": await _with_dra(gpus, root, _dra_at_rest),
        "dra_storm": await _with_dra(gpus, root, _dra_storm),
        "dra_xids": await _with_dra(gpus, root, _dra_xid_storm),
        "dra_outage": await _with_dra(gpus, root, _dra_outage),
    }


# ----- the model ---------------------------------------------------------------------------------
def fleet_model(
    sizes: list[dict[str, Any]], api: dict[str, dict[str, float]], nodes: int, scrape: float
) -> list[tuple[str, str, str, bool | None]]:
    """Rows (what, value, target, met) of ``nodes`` nodes from one node's counts."""
    out: list[tuple[str, str, str, bool | None]] = []
    for size in sizes:
        if size["compatible"]:
            continue
        series = nodes * size["series"]
        samples = series / scrape
        plain = size["shape"] == "8 GPUs"
        out.append((
            f"fleet of {nodes:,} nodes, {size['shape']}: series; samples/s; gzip MB/s into "
            "Prometheus",
            f"{series / 1e6:.2f} M; {samples / 1e3:.0f} k; "
            f"{nodes * size['gzip'] / scrape / 1e6:.1f}",
            "<= 2.5 M; <= 200 k" if plain else "",
            series <= TARGET_SERIES and samples <= TARGET_SAMPLES if plain else None,
        ))  # fmt: skip
    rest_kube = api["kube_rest"]["total"] / api["kube_rest"]["hours"] / 3600
    rest_dra = api["dra_rest"]["per_hour"] / 3600
    rest = nodes * (rest_kube + rest_dra)
    out.append((f"fleet of {nodes:,} at rest: API requests/s (node condition + DRA slices)",
                f"{rest:.2f}", "", None))  # fmt: skip
    storming = nodes // 100
    storm_node = api["kube_storm"]["requests"] + api["dra_storm"]["minute"]
    storm = storming * storm_node / 60 + (nodes - storming) * (rest_kube + rest_dra)
    out.append((f"fleet of {nodes:,}, 1 % in a fault storm (1,000 XIDs a minute over every GPU): "
                "API writes/s over its first minute",
                f"{storm:.1f}", f"<= {TARGET_STORM_WRITES:g}",
                storm <= TARGET_STORM_WRITES))  # fmt: skip
    ceiling = Backoff().maximum
    catch_up = api["kube_outage"]["catch_up"] + api["dra_outage"]["catch_up"]
    tries = api["kube_outage"]["tries"] + api["dra_outage"]["tries"]
    out.append((f"fleet of {nodes:,} during a 10-minute outage (every GPU fails, half recover): "
                "tries/s, reaching nobody", f"{nodes * tries / 600:.0f}", "", None))  # fmt: skip
    out.append((f"fleet of {nodes:,} after that outage: catch-up requests/s (over {ceiling:.0f} "
                "s, full jitter)", f"{nodes * catch_up / ceiling:.0f}", "", None))  # fmt: skip
    return out


def rows(args: argparse.Namespace) -> list[Row]:
    logs.configure("console", "warning")
    root = Path(tempfile.mkdtemp(prefix="gaf-", dir="/tmp"))
    try:
        api = uvloop.run(_measure(args.gpus, root))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    sizes = list(bench_series.sizes())
    storm = api["dra_storm"]
    out = [
        Row("DRA slices at rest: API requests per node per hour",
            f"{api['dra_rest']['per_hour']:.0f}", "0", api["dra_rest"]["per_hour"] == 0),
        Row("DRA storm, 1,000 XIDs of mixed codes in 60 s over every GPU: slice updates",
            f"{api['dra_xids']['minute']:.0f}", "<= 2", api["dra_xids"]["minute"] <= 2),
        Row("DRA storm, every GPU failing and recovering, 1,000 changes a minute for 3 min: "
            "slice updates in the first minute; the most in a later one; LISTs",
            f"{storm['minute']:.0f}; {storm['most_after']:.0f}; {storm['lists']:.0f}",
            "later <= 2; 0", storm["most_after"] <= 2 and storm["lists"] == 0),
        Row("DRA outage 10 min, every GPU fails, half recover: tries while down; requests once "
            "back", f"{api['dra_outage']['tries']:.0f}; {api['dra_outage']['catch_up']:.0f}",
            "", None),
        Row("node condition: requests per node per hour at rest; in the storm; after the outage",
            f"{api['kube_rest']['total'] / api['kube_rest']['hours']:.2f}; "
            f"{api['kube_storm']['requests']:.0f}; {api['kube_outage']['catch_up']:.0f}",
            "", None),
    ]  # fmt: skip
    out += [Row(*r) for r in fleet_model(sizes, api, args.fleet_nodes, args.scrape_interval)]
    return out
