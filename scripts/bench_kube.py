"""Node condition and events rows of scripts/bench: API requests one node makes, and a fleet's.

The node-health writer runs in-process against the API-server stand-in of tests/support (every
write schema-validated, every request recorded) on a synthetic node of ``--gpus`` GPUs, each held
by a pod, timed by a clock the bench moves by hand: an hour, a storm or an outage takes no wall
time, and the counts are exact (they do not depend on this machine's speed). Then faults with the
real clock: XID → the condition and the events written, in wall time.

- **at rest**: 24 hours with a poll every minute (the view never changes): requests per hour;
- **storm**: 1,000 XIDs in 10 s, on one GPU (mixed codes), and spread over every GPU: requests
  from the first XID until everything merged has gone out; and fifteen minutes in which every
  GPU fails and recovers again and again (1,000 changes a minute, XIDs of mixed codes):
  condition updates and requests in each minute (the first, and the most of any later one), and
  once it is over, the requests until every event's series holds its true count;
- **outage**: the API server down for 10 minutes while every GPU fails and half recover: the
  tries while it is down (they reach nobody), and the writes once it is back;
- the **fleet** of ``--fleet-nodes`` such nodes, extrapolated from those counts: at rest, with 1 %
  of nodes in a storm at once, and the catch-up after an outage, which the backoff's full jitter
  spreads over its ceiling (60 s).
- **fault → condition, Node event, pod event** with the real clock (the loop's, which the bench
  moves on by hand too: :class:`SkipClock`): XID 79 on a GPU whose health has not changed for a
  minute, after a quiet spell (31 s after the last write) and 0.5-29.5 s after an earlier write
  (another GPU's recovery), until each is on the API server: p50 and p99.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import uvloop
from benchlib import Row, percentile
from support.clock import ManualClock
from support.fake_apiserver import FakeApiServer
from support.kubehealth import Follower
from support.noderig import NODE, Rig, last_xid, new_writer, storm_xid, with_health, writing
from support.synthetic import gpu_uuid, synthetic_snapshot

from gpuagent import logs
from gpuagent.domain.backoff import Backoff
from gpuagent.domain.devices import Condition, GpuHealth
from gpuagent.domain.snapshot import Snapshot
from gpuagent.kube.client import KubeApi, load_config
from gpuagent.kube.nodehealth import NodeHealthWriter
from gpuagent.state.clock import LoopClock, Timer
from gpuagent.state.store import DeviceStore

#: The target for a GPU's first change of health in a minute: on the API server within (p99).
NEWS_P99_S = 1.0
#: The target for a node whose every GPU flaps: requests a minute after the first minute.
FLAPPING_AFTER = 20


class SkipClock:
    """The event loop's clock, which the bench also moves on by hand: a quiet spell, or most of
    a window, skipped without spending it (a writer waiting looks at the time again on the
    store's next change, which is where each measurement starts)."""

    def __init__(self) -> None:
        self.offset = 0.0
        self.waiting = 0  # waits in progress

    def now(self) -> float:
        return asyncio.get_running_loop().time() + self.offset

    async def wait(self, event: asyncio.Event, seconds: float) -> bool:
        self.waiting += 1
        try:
            return await LoopClock().wait(event, seconds)
        finally:
            self.waiting -= 1

    def call_at(self, when: float, callback: Callable[[], None]) -> Timer:
        """A timer at ``when`` of this clock (the loop's time plus the offset when it is made):
        a wait in progress until it fires or is cancelled."""
        self.waiting += 1
        ended = False

        def end() -> None:
            nonlocal ended
            if not ended:
                ended = True
                self.waiting -= 1

        def fire() -> None:
            end()
            callback()

        handle = asyncio.get_running_loop().call_at(when - self.offset, fire)
        return _SkipTimer(handle, end)

    async def skip(self, seconds: float, writer: Follower, store: DeviceStore) -> None:
        """Once ``writer`` has seen the store as it is and waits (its batch done, so the time
        it noted is before the skip), move the clock ``seconds`` on."""
        await until(lambda: writer.seen_version == store.snapshot.version and self.waiting > 0)
        self.offset += seconds


class _SkipTimer:
    """A :class:`SkipClock` timer: cancelled, it is a wait no more."""

    def __init__(self, handle: asyncio.TimerHandle, end: Callable[[], None]) -> None:
        self._handle = handle
        self._end = end

    def cancel(self) -> None:
        self._handle.cancel()
        self._end()


async def until(check: Callable[[], bool], within: float = 10.0) -> None:
    """Until ``check`` holds, looked at every millisecond (``within``: a deadline for a bug)."""
    deadline = time.perf_counter() + within
    while not check():
        if time.perf_counter() > deadline:
            raise TimeoutError("not reached")
        await asyncio.sleep(0.001)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--fleet-nodes", type=int, default=5000,
                        help="nodes the node-condition rows extrapolate to")  # fmt: skip
    parser.add_argument("--kube-faults", type=int, default=40,
                        help="faults timed with the real clock, after a quiet spell and soon "
                             "after a write, each (node-condition rows)")  # fmt: skip


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


def _healed(gpu: int) -> Callable[[Snapshot], Snapshot]:
    return lambda s: with_health(s, gpu, GpuHealth())


#: Minutes of the flapping storm: long enough for the series held back to fall due twice.
FLAPPING_MINUTES = 15


async def _flapping(rig: Rig) -> dict[str, float]:
    """Fifteen minutes in which every GPU fails and recovers over and over (1,000 changes a
    minute, XIDs of mixed codes): condition updates and requests in each minute; then, the storm
    over, the requests and minutes until every event's series holds its true count, and whether
    the counts on the server add up to every failure and recovery (1 if they do)."""
    gpus = len(rig.store.snapshot.gpus)
    codes = itertools.cycle([79, 48, 94, 119, 62])
    patch = ("PATCH", f"/api/v1/nodes/{NODE}/status")
    updates, requests = [], []
    occurred = 0  # occurrences of events: a GPU failing is one on the Node and one on its pod
    failing: set[int] = set()
    for _ in range(FLAPPING_MINUTES):
        start = len(rig.requests())
        for n in range(1000):
            gpu = n % gpus
            if n % (2 * gpus) < gpus:
                rig.store.update(storm_xid(gpu, next(codes)))
                occurred += 0 if gpu in failing else 2  # a failing GPU's new XID: no event
                failing.add(gpu)
            else:
                rig.store.update(_healed(gpu))
                occurred += 1
                failing.discard(gpu)
            await rig.settle(0.06)
        updates.append(rig.requests(start).count(patch))
        requests.append(len(rig.requests(start)))
    start, ended = len(rig.requests()), rig.clock.now()
    while rig.writer.model.pending_events():
        await rig.settle(10.0)
    counted = sum(e.get("series", {}).get("count", 1) for e in rig.server.events.values())
    return {"first_updates": updates[0], "most_updates": max(updates[1:]),
            "first_requests": requests[0], "most_requests": max(requests[1:]),
            "tail_requests": len(rig.requests(start)),
            "tail_minutes": (rig.clock.now() - ended) / 60,
            "true": counted == occurred}  # fmt: skip


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


def _occurrences(events: list[dict[str, Any]], gpu: int) -> int:
    """How often the GPU's unhealthy event among ``events`` occurred (its series' count)."""
    return sum(
        e.get("series", {}).get("count", 1)
        for e in events
        if e["reason"] == "GPUUnhealthy" and f"GPU {gpu} (" in e["note"]
    )


async def _told(server: FakeApiServer, store: DeviceStore, gpu: int) -> dict[str, float]:
    """XID 79 on ``gpu``: seconds until the condition, the Node's event and the pod's (a new
    occurrence of each) are on ``server``."""
    pod = next(a.pod for a in store.snapshot.pods.allocated if gpu_uuid(gpu) in a.device_ids[0])
    node_before = _occurrences(server.node_events(), gpu)
    pod_before = _occurrences(server.pod_events("team-a", pod), gpu)
    checks: dict[str, Callable[[], bool]] = {
        "condition": lambda: f"GPU {gpu} (" in (server.condition() or {}).get("message", ""),
        "node_event": lambda: _occurrences(server.node_events(), gpu) > node_before,
        "pod_event": lambda: _occurrences(server.pod_events("team-a", pod), gpu) > pod_before,
    }
    started = time.perf_counter()
    store.update(lambda s: with_health(s, gpu, GpuHealth((Condition("xid", "79"),))))
    took: dict[str, float] = {}

    def seen() -> bool:
        now = time.perf_counter() - started
        took.update({what: now for what, check in checks.items() if what not in took and check()})
        return len(took) == len(checks)

    await until(seen)
    return took


async def _recovered(server: FakeApiServer, store: DeviceStore, gpu: int) -> None:
    store.update(lambda s: with_health(s, gpu, GpuHealth()))
    await until(lambda: f"GPU {gpu} (" not in (server.condition() or {}).get("message", ""))


async def _news_latency(root: Path, gpus: int, faults: int) -> dict[str, list[float]]:
    """Fault → condition, Node event, pod event with the real clock: each fault on a GPU whose
    health has not changed for a minute, after a quiet spell and soon after another write."""
    server = FakeApiServer(node=NODE)
    await server.start()
    api = KubeApi(load_config(server.kubeconfig(root / "kubeconfig-news")), timeout=2.0)
    store = DeviceStore(synthetic_snapshot(gpus, replicas=1))
    clock = SkipClock()
    writer = NodeHealthWriter(store, api, node=NODE, clock=clock)
    rng = random.Random(11)
    out: dict[str, list[float]] = {}
    async with writing(server, api, writer.run()):
        await until(lambda: server.condition() is not None)
        previous: int | None = None
        for n in range(2 * faults):
            gpu, quiet = n % gpus, n % 2 == 1
            await clock.skip(61.0, writer, store)  # no GPU changed for a minute; budget refilled
            if previous is not None:  # the earlier write: the last GPU recovers
                await _recovered(server, store, previous)
            await clock.skip(31.0 if quiet else rng.uniform(0.5, 29.5), writer, store)
            for what, seconds in (await _told(server, store, gpu)).items():
                out.setdefault(f"{'quiet' if quiet else 'soon'}_{what}", []).append(seconds)
            previous = gpu
        assert server.invalid == [], server.invalid
    return out


async def _measure(gpus: int, faults: int, root: Path) -> dict[str, Any]:
    return {
        "rest": await _with_rig(gpus, root, _at_rest),
        "storm_one": await _with_rig(gpus, root, _storm(spread=False)),
        "storm_all": await _with_rig(gpus, root, _storm(spread=True)),
        "flapping": await _with_rig(gpus, root, _flapping),
        "outage": await _with_rig(gpus, root, _outage),
        "outage_rest": await _with_rig(gpus, root, _outage_at_rest),
        "news": await _news_latency(root, gpus, faults),
    }


def _news_rows(news: dict[str, list[float]]) -> list[Row]:
    out = []
    for when, words in (("quiet", "after a quiet spell"), ("soon", "0.5-29.5 s after a write")):
        p50 = {what: statistics.median(news[f"{when}_{what}"]) for what in _NEWS}
        p99 = {what: percentile(news[f"{when}_{what}"], 99) for what in _NEWS}
        worst = max(p99.values())
        out.append(Row(
            f"XID → condition / Node event / pod event, real clock, {words} "
            f"({len(news[f'{when}_condition'])}): p50; p99",
            "; ".join(" / ".join(f"{d[w] * 1000:.0f}" for w in _NEWS) for d in (p50, p99))
            + " ms", f"p99 <= {NEWS_P99_S:g} s", worst <= NEWS_P99_S,
        ))  # fmt: skip
    return out


_NEWS = ("condition", "node_event", "pod_event")


def rows(args: argparse.Namespace) -> list[Row]:
    logs.configure("console", "warning")
    root = Path(tempfile.mkdtemp(prefix="gak-", dir="/tmp"))
    try:
        m = uvloop.run(_measure(args.gpus, args.kube_faults, root))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    fleet = args.fleet_nodes
    rest, one, spread, outage = m["rest"], m["storm_one"], m["storm_all"], m["outage"]
    flapping = m["flapping"]
    quiet = m["outage_rest"]
    per_hour = rest["total"] / rest["hours"]
    ceiling = Backoff().maximum
    storm_nodes = fleet // 100
    # The worst storm (spread over every GPU) from 1 % of the fleet at once, over its first minute.
    storm_rate = storm_nodes * spread["requests"] / 60 + (fleet - storm_nodes) * per_hour / 3600
    return [
        Row("node condition at rest: requests per node per hour (24 h; max in any hour)",
            f"{per_hour:.2f} ({rest['max_hour']:.0f})", "<= 2", rest["max_hour"] <= 2),
        Row("storm, 1,000 XIDs in 10 s on one GPU: requests", f"{one['requests']:.0f}", "<= 20",
            one["requests"] <= 20),
        Row(f"storm, 1,000 XIDs in 10 s over {args.gpus} GPUs: requests",
            f"{spread['requests']:.0f}", "<= 20", spread["requests"] <= 20),
        Row("storm, every GPU failing and recovering, 1,000 changes a minute for "
            f"{FLAPPING_MINUTES} min: condition updates a minute, first; most after",
            f"{flapping['first_updates']:.0f}; {flapping['most_updates']:.0f}", "after <= 2",
            flapping["most_updates"] <= 2),
        Row("the same storm: requests a minute (condition, events' series), first; most after",
            f"{flapping['first_requests']:.0f}; {flapping['most_requests']:.0f}",
            f"after <= {FLAPPING_AFTER}", flapping["most_requests"] <= FLAPPING_AFTER),
        Row("the storm over: requests until every series holds its true count; minutes; counts "
            "true", f"{flapping['tail_requests']:.0f}; {flapping['tail_minutes']:.1f}; "
            f"{'yes' if flapping['true'] else 'no'}", "yes", bool(flapping["true"])),
        Row("outage 10 min, every GPU fails, half recover: tries while down (reach nobody)",
            f"{outage['tries']:.0f}", "", None),
        Row("outage: writes once the API server is back (one per changed object)",
            f"{outage['catch_up']:.0f}", "", None),
        Row("outage of an hour at rest: tries while down; writes once back",
            f"{quiet['tries']:.0f}; {quiet['catch_up']:.0f}", "", None),
        Row("outage: first write after the API server is back (full jitter, <= 60 s)",
            f"{outage['first_after']:.0f} s", f"<= {ceiling:.0f} s",
            outage["first_after"] <= ceiling + 1),
        *_news_rows(m["news"]),
        Row(f"fleet of {fleet:,} nodes at rest: API requests/s", f"{fleet * per_hour / 3600:.2f}",
            "", None),
        Row(f"fleet of {fleet:,}, 1 % storming over every GPU at once: API requests/s "
            "(first minute)", f"{storm_rate:.1f}", "", None),
        Row(f"fleet of {fleet:,} during an hour-long outage at rest: tries/s (reach nobody)",
            f"{fleet * quiet['tries'] / 3600:.0f}", "", None),
        Row(f"fleet of {fleet:,} after an outage at rest: catch-up requests/s (over "
            f"{ceiling:.0f} s)", f"{fleet * quiet['catch_up'] / ceiling:.0f}", "", None),
        Row(f"fleet of {fleet:,} after an outage in which every GPU failed: catch-up "
            f"requests/s (over {ceiling:.0f} s)", f"{fleet * outage['catch_up'] / ceiling:.0f}",
            "", None),
    ]  # fmt: skip
