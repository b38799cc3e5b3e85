"""Node condition and events rows of scripts/bench: API requests one node makes, and a fleet's.

The node-health writer runs in-process against the API-server stand-in of tests/support (every
write schema-validated, every request recorded) on a synthetic node of ``--gpus`` GPUs, each held
by a pod, timed by a clock the bench moves by hand: an hour, a storm or an outage takes no wall
time, and the counts are exact (they do not depend on this machine's speed). Then one fault with
the real clock: XID → the condition written, in wall time.

- **at rest**: 24 hours with a poll every minute (the view never changes): requests per hour;
- **storm**: 1,000 XIDs in 10 s, on one GPU (mixed codes), and spread over every GPU: requests
  from the first XID until everything merged has gone out;
- **outage**: the API server down for 10 minutes while every GPU fails and half recover: the
  tries while it is down (they reach nobody), and the writes once it is back;
- the **fleet** of ``--fleet-nodes`` such nodes, extrapolated from those counts: at rest, with 1 %
  of nodes in a storm at once, and the catch-up after an outage, which the backoff's full jitter
  spreads over its ceiling (60 s).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import uvloop
from support.clock import ManualClock
from support.fake_apiserver import FakeApiServer
from support.noderig import NODE, Rig, last_xid, new_writer, storm_xid, writing
from support.synthetic import synthetic_snapshot
from support.waiting import eventually

from gpuagent import logs
from gpuagent.domain.devices import Condition
from gpuagent.domain.pacing import Backoff
from gpuagent.kube.client import KubeApi, load_config
from gpuagent.kube.nodehealth import NodeHealthWriter
from gpuagent.state.store import DeviceStore


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--fleet-nodes", type=int, default=5000,
                        help="nodes the node-condition rows extrapolate to")  # fmt: skip


async def _with_rig(
    gpus: int, root: Path, body: Callable[[Rig], Coroutine[Any, Any, dict[str, float]]]
) -> dict[str, float]:
    server = FakeApiServer(node=NODE)
    await server.start()
    clock = ManualClock()
    rng = random.Random(7)
    store = DeviceStore(synthetic_snapshot(gpus, replicas=1))
    writer, api = new_writer(server, store, clock, rng.random, root / "kubeconfig")
    rig = Rig(server, store, clock, writer, iter(()))
    async with writing(server, api, writer.run()):
        await rig.settle(0.2)
        await rig.clock.advance(100.0)
        await rig.settle()
        out = await body(rig)
        assert server.invalid == [], server.invalid
        return out


async def _at_rest(rig: Rig) -> dict[str, float]:
    start = len(rig.requests())
    per_hour: list[int] = []
    for _ in range(24):
        before = len(rig.requests())
        for minute in range(60):
            await rig.change(last_xid(minute))
            await rig.settle(60.0)
        per_hour.append(len(rig.requests()) - before)
    return {"total": len(rig.requests()) - start, "max_hour": max(per_hour), "hours": 24}


def _storm(spread: bool) -> Callable[[Rig], Coroutine[Any, Any, dict[str, float]]]:
    async def storm(rig: Rig) -> dict[str, float]:
        gpus = len(rig.store.snapshot.gpus)
        start = len(rig.requests())
        codes = itertools.cycle([79, 48, 13, 94, 119, 62, 13, 95])
        for i in range(1000):
            rig.store.update(storm_xid(i % gpus if spread else 3, next(codes)))
            if i % 10 == 9:
                await rig.settle(0.1)
        await rig.settle(120.0)
        return {"requests": len(rig.requests()) - start}

    return storm


async def _outage(rig: Rig) -> dict[str, float]:
    gpus = len(rig.store.snapshot.gpus)
    await rig.server.stop()
    for index in range(gpus):
        await rig.fail(index, Condition("xid", "79"))
        await rig.settle(20.0)
    for index in range(gpus // 2):
        await rig.heal(index)
        await rig.settle(20.0)
    down = rig.clock.now()
    while rig.clock.now() - down < 600.0 - 20.0 * gpus * 1.5:
        await rig.settle(10.0)
    tries = sum(n for (_, result), n in rig.writer.pacer.counts.counts.items()
                if result == "unreachable")  # fmt: skip
    before = len(rig.requests())
    await rig.server.start()
    back = rig.clock.now()
    while len(rig.requests()) == before:
        await rig.settle(1.0)
    first = rig.clock.now() - back
    await rig.settle(120.0)
    return {"tries": tries, "catch_up": len(rig.requests()) - before, "first_after": first}


async def _outage_at_rest(rig: Rig) -> dict[str, float]:
    """An hour down with nothing changing: only the heartbeat that falls due waits and retries."""
    await rig.server.stop()
    for minute in range(60):
        await rig.change(last_xid(minute))
        await rig.settle(60.0)
    tries = sum(n for (_, result), n in rig.writer.pacer.counts.counts.items()
                if result == "unreachable")  # fmt: skip
    before = len(rig.requests())
    await rig.server.start()
    await rig.settle(120.0)
    return {"tries": tries, "catch_up": len(rig.requests()) - before}


async def _xid_latency(root: Path) -> float:
    """Wall time from an XID (the store's change) to the condition on the API server, real clock."""
    server = FakeApiServer(node=NODE)
    await server.start()
    api = KubeApi(load_config(server.kubeconfig(root / "kubeconfig-rt")), timeout=2.0)
    store = DeviceStore(synthetic_snapshot(8, replicas=1))
    writer = NodeHealthWriter(store, api, node=NODE)
    async with writing(server, api, writer.run()):
        await eventually(lambda: server.condition() is not None, what="the first write")
        await asyncio.sleep(31.0)  # a quiet spell (the window after the first write)
        started = time.perf_counter()
        store.update(storm_xid(3, 79))
        await eventually(lambda: (server.condition() or {}).get("status") == "False")
        took = time.perf_counter() - started
        await eventually(lambda: len(server.events) == 2, what="the events written too")
        return took


async def _measure(gpus: int, root: Path) -> dict[str, dict[str, float]]:
    return {
        "rest": await _with_rig(gpus, root, _at_rest),
        "storm_one": await _with_rig(gpus, root, _storm(spread=False)),
        "storm_all": await _with_rig(gpus, root, _storm(spread=True)),
        "outage": await _with_rig(gpus, root, _outage),
        "outage_rest": await _with_rig(gpus, root, _outage_at_rest),
        "latency": {"xid": await _xid_latency(root)},
    }


def rows(args: argparse.Namespace, row: Any) -> list[Any]:
    logs.configure("console", "warning")
    root = Path(tempfile.mkdtemp(prefix="gak-", dir="/tmp"))
    try:
        m = uvloop.run(_measure(args.gpus, root))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    fleet = args.fleet_nodes
    rest, one, spread, outage = m["rest"], m["storm_one"], m["storm_all"], m["outage"]
    quiet = m["outage_rest"]
    per_hour = rest["total"] / rest["hours"]
    ceiling = Backoff().maximum
    storm_nodes = fleet // 100
    # The worst storm (spread over every GPU) from 1 % of the fleet at once, over its first minute.
    storm_rate = storm_nodes * spread["requests"] / 60 + (fleet - storm_nodes) * per_hour / 3600
    return [
        row("node condition at rest: requests per node per hour (24 h; max in any hour)",
            f"{per_hour:.2f} ({rest['max_hour']:.0f})", "<= 2", rest["max_hour"] <= 2),
        row("storm, 1,000 XIDs in 10 s on one GPU: requests", f"{one['requests']:.0f}", "<= 20",
            one["requests"] <= 20),
        row(f"storm, 1,000 XIDs in 10 s over {args.gpus} GPUs: requests",
            f"{spread['requests']:.0f}", "<= 20", spread["requests"] <= 20),
        row("outage 10 min, every GPU fails, half recover: tries while down (reach nobody)",
            f"{outage['tries']:.0f}", "", None),
        row("outage: writes once the API server is back (one per changed object)",
            f"{outage['catch_up']:.0f}", "", None),
        row("outage of an hour at rest: tries while down; writes once back",
            f"{quiet['tries']:.0f}; {quiet['catch_up']:.0f}", "", None),
        row("outage: first write after the API server is back (full jitter, <= 60 s)",
            f"{outage['first_after']:.0f} s", f"<= {ceiling:.0f} s",
            outage["first_after"] <= ceiling + 1),
        row("XID → GPUHealthy False on the API server, real clock, after a quiet spell",
            f"{m['latency']['xid'] * 1000:.0f} ms", "< 2 s", m["latency"]["xid"] < 2.0),
        row(f"fleet of {fleet:,} nodes at rest: API requests/s", f"{fleet * per_hour / 3600:.2f}",
            "", None),
        row(f"fleet of {fleet:,}, 1 % storming over every GPU at once: API requests/s "
            "(first minute)", f"{storm_rate:.1f}", "", None),
        row(f"fleet of {fleet:,} during an hour-long outage at rest: tries/s (reach nobody)",
            f"{fleet * quiet['tries'] / 3600:.0f}", "", None),
        row(f"fleet of {fleet:,} after an outage at rest: catch-up requests/s (over "
            f"{ceiling:.0f} s)", f"{fleet * quiet['catch_up'] / ceiling:.0f}", "", None),
        row(f"fleet of {fleet:,} after an outage in which every GPU failed: catch-up "
            f"requests/s (over {ceiling:.0f} s)", f"{fleet * outage['catch_up'] / ceiling:.0f}",
            "", None),
    ]  # fmt: skip
