"""DRA rows of scripts/bench: NodePrepareResources for one claim, and fault → ResourceSlice taint.

The agent runs in-process (as the end-to-end tests run it) on simulated GPUs, all given to DRA,
with the API-server stand-in (aiohttp, every write schema-validated) and the plugin-watcher
stand-in (grpcio, in worker threads) of tests/support. In-process means the grpcio client shares
the interpreter with the agent: the round trips are upper bounds.

- ``NodePrepareResources`` p99 excluding the API read: the agent's own time per claim (it records
  the claim read separately), each claim prepared once and unprepared.
- The kubelet-side round trip, API read (from a local stand-in) included.
- fault → ResourceSlice updated, paced as in production (the publisher's clock is the loop's,
  moved on by hand too: :class:`bench_kube.SkipClock`): an XID injected over /sim/faults on a GPU
  whose health has not changed for a minute, until the API server holds the device's taint,
  after a quiet spell (31 s after the last write) and 0.5-29.5 s after an earlier write (the
  previous GPU's recovery, itself timed until its taint is gone).
- ``--dra-mig dynamic``: on simulated H100s (cap_sys_admin, the driver's MIG latencies slept as
  configured: 0.25 s to make a GPU instance, 0.1 s its compute instance), the kubelet-side round
  trip of a claim whose 1g.10gb is made on prepare until its CDI ID comes back, against the
  driver's creation latency (a 3g.40gb held meanwhile keeps MIG mode on, so no switch is timed);
  and what 8 H100s publish (devices, slices, bytes of their JSON).
- ``--dra-sharing mps`` (the stand-in ``nvidia-cuda-mps-control`` under the driver root, one
  daemon per GPU): claims with a share (``consumedCapacity``: 2 GiB, 10 % of compute) spread over
  the GPUs as they come and go, each GPU holding six (the oldest unprepared as a new one comes) —
  the agent's own time per claim (no API read; the target, 50 ms at p99, as the unshared claims'
  row is), the kubelet-side round trip (local API read included), the unprepares; and the same
  claims of whole GPUs without sharing, whose difference is what a share adds. Then the same
  with ``--dra-held`` claims held at once (25 per GPU on 8), shared and whole: a prepare's cost
  must not grow with the claims a node holds.
- A reboot under ``--dra-mig dynamic``: claims prepared on 8 simulated H100s (a 3g.40gb and four
  1g.10gb each), the agent stopped and started on a fresh simulated driver (a new boot: its MIG
  devices gone, MIG mode off), the kubelet's prepares of the same claims again: the round trip
  of each 1g.10gb's, whose MIG device is checked against the driver and made again (its GPU's
  3g.40gb asked again first, untimed, switches MIG mode back on), against the creation latency.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import bench_kube
import uvloop
from benchlib import Row, ms, percentile
from e2e.agentrun import running_agent
from support.fake_apiserver import FakeApiServer, claim
from support.fake_plugin_watcher import FakePluginWatcher
from support.grpcstubs import dra_stubs

from gpuagent import logs
from gpuagent.dra.endpoint import EndpointTiming
from gpuagent.gpu.sim import SimDriver, node_from_mapping
from gpuagent.gpu.sim.mpscontrol import install
from gpuagent.gpu.sim.spec import DEFAULT_CALL_LATENCY_S
from gpuagent.kube.slices import Backoff

NODE = "bench-node"
DRIVER = "gpu.nvidia.com"


MIG_NODE_GPUS = 8
#: What the simulated driver sleeps to make a 1g.10gb (gpu/sim/spec.py's defaults).
CREATION_S = (
    DEFAULT_CALL_LATENCY_S["nvmlDeviceCreateGpuInstanceWithPlacement"]
    + DEFAULT_CALL_LATENCY_S["nvmlGpuInstanceCreateComputeInstance"]
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dra-claims", type=int, default=300, help="claims prepared (DRA rows)")
    parser.add_argument(
        "--dra-mig-claims", type=int, default=30, help="MIG devices made on prepare (DRA rows)"
    )
    parser.add_argument("--dra-faults", type=int, default=20, help="faults injected (DRA rows)")
    parser.add_argument(
        "--dra-share-claims", type=int, default=200, help="claims with a share prepared (DRA rows)"
    )
    parser.add_argument(
        "--dra-held", type=int, default=200, help="claims the node holds in the held rows (DRA)"
    )


def _agent(
    api: FakeApiServer, root: Path, node: tuple[str, ...], **dra_options: Any
) -> tuple[tuple[str, ...], dict[str, Any]]:
    """The agent's arguments and options: ``node`` (the simulated node and what DRA serves on
    it), the API-server stand-in's credentials, the plugin, registry and CDI directories under
    ``root``, production's poll interval (the test runner's 0.05 s is for tests); ``dra_options``
    added to the DRA side's."""
    args = (
        *node,
        "--kubeconfig", str(api.kubeconfig(root / "kubeconfig")),
        "--plugins-dir", str(root / "plugins"),
        "--plugins-registry-dir", str(root / "registry"),
        "--cdi-spec-dir", str(root / "cdi"),
        "--poll-interval", "5",
    )  # fmt: skip
    timing = EndpointTiming(watch_interval=0.05)
    return args, {"node_name": NODE, "dra_options": {"endpoint_timing": timing, **dra_options}}


def _started() -> None:
    """What the agent does once started in its own process (gpuagent.app.tuning): what start-up
    built leaves the cyclic collector's view. In-process, without it, a full collection walks
    the agent, the stand-ins and the bench alike (70-85 ms on 8 H100s) and lands on a claim."""
    gc.collect()
    gc.freeze()


async def _wait(check: Any) -> None:
    deadline = time.perf_counter() + 10.0
    while not check():
        if time.perf_counter() > deadline:
            raise TimeoutError("condition not reached")
        await asyncio.sleep(0.001)


async def _measure(gpus: int, claims: int, faults: int, root: Path) -> dict[str, list[float]]:
    clock = bench_kube.SkipClock()
    api = FakeApiServer(node=NODE)
    await api.start()
    stubs = dra_stubs()
    watcher = FakePluginWatcher(root / "registry", stubs)
    args, options = _agent(
        api, root, ("--simulate", str(gpus), "--dra-gpus", "all"),
        backoff=Backoff(initial=0.05, maximum=0.5),
        clock=clock,  # production's pacing; quiet spells skipped, not spent
    )  # fmt: skip
    out: dict[str, list[float]] = {"round_trip": [], "quiet": [], "soon": [], "to_clear": []}
    try:
        async with running_agent(root / "device-plugins", args, agent_options=options) as run:
            reg = await watcher.aregister(await watcher.afind())
            await _wait(lambda: len(api.devices()) == gpus)
            _started()
            name = sorted(api.devices())[0]
            for i in range(claims):
                uid = f"bench-{i}"
                api.add_claim(claim("bench", f"c{i}", uid, [("gpu", DRIVER, NODE, name)]))
                started = time.perf_counter()
                response = await watcher.aprepare(reg, [("bench", f"c{i}", uid)])
                out["round_trip"].append(time.perf_counter() - started)
                assert response.claims[uid].error == "", response.claims[uid].error
                await watcher.aunprepare(reg, [("bench", f"c{i}", uid)])
            out["prepare"] = list(run.dra.stats.prepare_seconds)
            out["api_read"] = list(run.dra.stats.api_read_seconds)
            await _faults(run, api, clock, faults, out)
            assert api.invalid == [], api.invalid
    finally:
        await api.stop()
    return out


async def _faults(
    run: Any, api: FakeApiServer, clock: bench_kube.SkipClock, faults: int, out: Any
) -> None:
    """Faults over the GPUs in turn, each on a GPU whose health has not changed for a minute:
    the previous GPU recovers (the earlier write), then after a quiet spell or soon after it
    (0.5-29.5 s of the publisher's clock, skipped) the next fails: until each is in the slice."""
    names = {d["attributes"]["uuid"]["string"]: n for n, d in api.devices().items()}
    gpus = [(g.index, names[g.uuid]) for g in run.agent.store.snapshot.gpus if g.uuid in names]
    rng = random.Random(5)

    def tainted(name: str, want: bool = True) -> Callable[[], bool]:
        return lambda: bool(api.devices()[name].get("taints")) == want

    publisher, store = run.dra.publisher, run.agent.store
    previous: tuple[int, str] | None = None
    for n in range(2 * faults):
        gpu, name = gpus[n % len(gpus)]
        await clock.skip(61.0, publisher, store)  # no GPU changed for a minute; budget refilled
        if previous is not None:
            started = time.perf_counter()
            await run.fault({"gpu": previous[0], "fault": "recover"})
            await _wait(tainted(previous[1], want=False))
            out["to_clear"].append(time.perf_counter() - started)
        quiet = n % 2 == 1
        await clock.skip(31.0 if quiet else rng.uniform(0.5, 29.5), publisher, store)
        started = time.perf_counter()
        await run.fault({"gpu": gpu, "fault": "xid", "xid": 48})
        await _wait(tainted(name))
        out["quiet" if quiet else "soon"].append(time.perf_counter() - started)
        previous = (gpu, name)


SHARE = {"memory": "2Gi", "compute": "10"}
#: Shares each GPU holds while claims come and go.
SHARES_PER_GPU = 6


async def _measure_shares(
    gpus: int, claims: int, root: Path, *, shared: bool = True, per_gpu: int = SHARES_PER_GPU
) -> dict[str, list[float]]:
    """Claims with a share of a GPU prepared (round trip, and the agent's own time), each GPU
    holding ``per_gpu`` of them as they come and go (the oldest unprepared: round trip; the
    first ``per_gpu`` a GPU is given are not timed); see the module's doc. ``shared=False``: the
    same claims of whole GPUs, without sharing (what the share adds is the difference)."""
    api = FakeApiServer(node=NODE)
    await api.start()
    watcher = FakePluginWatcher(root / "registry", dra_stubs())
    install(root / "driver")
    args, options = _agent(api, root, (
        "--simulate", str(gpus), "--dra-gpus", "all", "--dra-sharing", "mps" if shared else "none",
        "--nvidia-driver-root", str(root / "driver"), "--mps-root", str(root / "mps"),
    ))  # fmt: skip
    out: dict[str, list[float]] = {"round_trip": [], "unprepare": []}
    try:
        async with running_agent(root / "device-plugins", args, agent_options=options) as run:
            reg = await watcher.aregister(await watcher.afind())
            store = run.agent.store
            await _wait(lambda: len(store.snapshot.mps.daemons) == (gpus if shared else 0)
                        and all(d.up for d in store.snapshot.mps.daemons.values()))  # fmt: skip
            await _wait(lambda: len(api.devices()) == gpus)
            _started()
            names = sorted(api.devices())
            held = per_gpu * gpus
            for i in range(held + claims):
                uid, device = f"share-{i}", names[i % gpus]
                results = [("g", DRIVER, NODE, device)]
                api.add_claim(claim("b", uid, uid, results, consumed=SHARE if shared else None))
                trip = await _prepare(watcher, reg, uid)
                if i < held:  # each GPU given its per_gpu claims: not timed
                    continue
                out["round_trip"].append(trip)
                gone = f"share-{i - held}"  # the oldest claim goes: each GPU holds per_gpu
                started = time.perf_counter()
                await watcher.aunprepare(reg, [("b", gone, gone)])
                out["unprepare"].append(time.perf_counter() - started)
                if shared:
                    assert len(store.snapshot.shares) == held
            out["prepare"] = list(run.dra.stats.prepare_seconds[held:])
            assert api.invalid == [], api.invalid
    finally:
        await api.stop()
    return out


def share_rows(args: argparse.Namespace) -> list[Row]:
    """The rows of claims with a share of a GPU (``--dra-sharing mps``), and of claims prepared
    while the node holds ``--dra-held`` others (shared and whole)."""
    logs.configure("console", "warning")
    many = max(1, args.dra_held // args.gpus)
    measured = []
    for shared, per_gpu in ((True, SHARES_PER_GPU), (False, SHARES_PER_GPU), (True, many),
                            (False, many)):  # fmt: skip
        root = Path(tempfile.mkdtemp(prefix="gad-", dir="/tmp"))
        try:
            measured.append(uvloop.run(_measure_shares(
                args.gpus, args.dra_share_claims, root, shared=shared, per_gpu=per_gpu
            )))  # fmt: skip
        finally:
            shutil.rmtree(root, ignore_errors=True)
    m, whole, held, held_whole = measured

    def spread(values: list[float]) -> str:
        return f"p50 {ms(statistics.median(values))}, p99 {ms(percentile(values, 99))}"

    trip, own = m["round_trip"], m["prepare"]
    shape = f"{len(trip)} claims, {SHARES_PER_GPU} held per GPU on {args.gpus}"
    kept = f"{many * args.gpus} held"
    return [
        Row(f"DRA shared claim: NodePrepareResources, no API read, {shape}", spread(own),
            "p99 ≤ 50 ms", percentile(own, 99) <= 0.050),
        Row("DRA shared claim: prepare round trip (kubelet side, local API read)", spread(trip),
            "", None),
        Row("DRA shared claim: unprepare round trip", spread(m["unprepare"]), "", None),
        Row("DRA the same claims of whole GPUs (--dra-sharing none): round trip",
            spread(whole["round_trip"]), "", None),
        Row("DRA the same claims of whole GPUs: NodePrepareResources, no API read",
            spread(whole["prepare"]), "", None),
        Row(f"DRA shared claim, {kept}: NodePrepareResources, no API read",
            spread(held["prepare"]), "p99 ≤ 50 ms", percentile(held["prepare"], 99) <= 0.050),
        Row(f"DRA shared claim, {kept}: unprepare round trip", spread(held["unprepare"]), "",
            None),
        Row(f"DRA whole-GPU claim, {kept}: NodePrepareResources, no API read",
            spread(held_whole["prepare"]), "p99 < 20 ms",
            percentile(held_whole["prepare"], 99) < 0.020),
    ]  # fmt: skip


def _mig_node(api: FakeApiServer, root: Path) -> tuple[tuple[str, ...], dict[str, Any]]:
    """The agent's arguments and options on 8 simulated H100s, MIG made on demand."""
    node = root / "node.yaml"
    gpus = [{"name": "H100"}] * MIG_NODE_GPUS
    node.write_text(json.dumps({"version": "v1", "gpus": gpus, "cap_sys_admin": True}))
    return _agent(
        api, root, ("--sim-config", str(node), "--dra-gpus", "all", "--dra-mig", "dynamic")
    )


async def _measure_mig(claims: int, root: Path) -> dict[str, Any]:
    """Round trips of prepares that make a 1g.10gb on GPU 0; what 8 H100s publish."""
    api = FakeApiServer(node=NODE)
    await api.start()
    watcher = FakePluginWatcher(root / "registry", dra_stubs())
    args, options = _mig_node(api, root)
    out: dict[str, Any] = {"round_trip": []}
    try:
        async with running_agent(root / "device-plugins", args, agent_options=options) as run:
            reg = await watcher.aregister(await watcher.afind())
            await _wait(lambda: len(api.devices()) == 26 * MIG_NODE_GPUS)
            out["devices"] = len(api.devices())
            out["slices"] = len(api.slices)
            out["bytes"] = sum(
                len(json.dumps(s, separators=(",", ":"))) for s in api.slices.values()
            )
            _started()
            api.add_claim(claim("b", "hold", "hold", [("m", DRIVER, NODE, "gpu-0-mig-3g40gb-9-4")]))
            held = await watcher.aprepare(reg, [("b", "hold", "hold")])
            assert held.claims["hold"].error == "", held.claims["hold"].error
            for i in range(claims):
                uid, name = f"mig-{i}", f"gpu-0-mig-1g10gb-19-{i % 4}"
                api.add_claim(claim("b", uid, uid, [("m", DRIVER, NODE, name)]))
                started = time.perf_counter()
                response = await watcher.aprepare(reg, [("b", uid, uid)])
                out["round_trip"].append(time.perf_counter() - started)
                assert response.claims[uid].error == "", response.claims[uid].error
                assert list(response.claims[uid].devices[0].cdi_device_ids)
                await watcher.aunprepare(reg, [("b", uid, uid)])
            out["prepare"] = list(run.dra.stats.prepare_seconds[1:])  # not the held one
            assert api.invalid == [], api.invalid
    finally:
        await api.stop()
    return out


async def _prepare(watcher: FakePluginWatcher, reg: Any, uid: str) -> float:
    """One claim (``b/<uid>``) prepared by the kubelet: its round trip."""
    started = time.perf_counter()
    response = await watcher.aprepare(reg, [("b", uid, uid)])
    seconds = time.perf_counter() - started
    assert response.claims[uid].error == "", response.claims[uid].error
    assert list(response.claims[uid].devices[0].cdi_device_ids)
    return seconds


async def _measure_reboot(root: Path) -> dict[str, Any]:
    """Round trips of 1g.10gb claims prepared again after a reboot (see the module's doc)."""
    api = FakeApiServer(node=NODE)
    await api.start()
    watcher = FakePluginWatcher(root / "registry", dra_stubs())
    args, options = _mig_node(api, root)
    config = json.loads((root / "node.yaml").read_text())
    holds = [f"hold-{g}" for g in range(MIG_NODE_GPUS)]
    smalls = [f"small-{g}-{s}" for g in range(MIG_NODE_GPUS) for s in range(4)]
    for g in range(MIG_NODE_GPUS):
        api.add_claim(
            claim("b", holds[g], holds[g], [("m", DRIVER, NODE, f"gpu-{g}-mig-3g40gb-9-4")])
        )
        for s in range(4):
            uid = f"small-{g}-{s}"
            api.add_claim(claim("b", uid, uid, [("m", DRIVER, NODE, f"gpu-{g}-mig-1g10gb-19-{s}")]))
    out: dict[str, Any] = {"first": [], "again": []}
    try:
        for key in ("first", "again"):
            sim = SimDriver(node_from_mapping(config))  # a boot of its own
            async with running_agent(
                root / "device-plugins", args, agent_options=options, simulator=sim
            ) as run:
                reg = await watcher.aregister(await watcher.afind())
                await _wait(lambda: len(api.devices()) == 26 * MIG_NODE_GPUS)
                _started()
                for g in range(MIG_NODE_GPUS):
                    await _prepare(watcher, reg, holds[g])  # MIG mode on: not timed
                    for uid in smalls[4 * g : 4 * g + 4]:
                        out[key].append(await _prepare(watcher, reg, uid))
                out[f"{key}_counted"] = run.dra.stats.gone_prepared_again
            assert api.invalid == [], api.invalid
    finally:
        await api.stop()
    return out


def rows(args: argparse.Namespace) -> list[Row]:
    logs.configure("console", "warning")  # the in-process agent's info lines would drown the table
    root = Path(tempfile.mkdtemp(prefix="gad-", dir="/tmp"))
    try:
        m = uvloop.run(_measure(args.gpus, args.dra_claims, args.dra_faults, root))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    root = Path(tempfile.mkdtemp(prefix="gad-", dir="/tmp"))
    try:
        mig = uvloop.run(_measure_mig(args.dra_mig_claims, root))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    root = Path(tempfile.mkdtemp(prefix="gad-", dir="/tmp"))
    try:
        reboot = uvloop.run(_measure_reboot(root))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    shares = share_rows(args)
    again = reboot["again"]
    again_p99 = percentile(again, 99)
    assert reboot["again_counted"] == len(again) + MIG_NODE_GPUS, reboot  # every one made again

    prepare = percentile(m["prepare"], 99)
    made = mig["round_trip"]
    made_p99 = percentile(made, 99)
    return [
        Row(f"DRA NodePrepareResources p50, 1 claim ({len(m['prepare'])}), no API read",
            ms(statistics.median(m["prepare"])), "", None),
        Row("DRA NodePrepareResources p99, 1 claim, no API read", ms(prepare), "< 20 ms",
            prepare < 0.020),
        Row("DRA NodePrepareResources round trip p99 (kubelet side, local API read)",
            ms(percentile(m["round_trip"], 99)), "", None),
        Row("DRA claim read from the API server p50", ms(statistics.median(m["api_read"])), "",
            None),
        Row(f"DRA fault → ResourceSlice tainted, after a quiet spell ({len(m['quiet'])}): "
            "p50; p99", f"{ms(statistics.median(m['quiet']))}; {ms(percentile(m['quiet'], 99))}",
            "p99 < 1 s", percentile(m["quiet"], 99) < 1.0),
        Row(f"DRA fault → ResourceSlice tainted, 0.5-29.5 s after a write ({len(m['soon'])}): "
            "p50; p99", f"{ms(statistics.median(m['soon']))}; {ms(percentile(m['soon'], 99))}",
            "p99 < 1 s", percentile(m["soon"], 99) < 1.0),
        Row("DRA recover → ResourceSlice taint cleared p50; p99",
            f"{ms(statistics.median(m['to_clear']))}; {ms(percentile(m['to_clear'], 99))}", "",
            None),
        Row(f"DRA dynamic MIG prepare → CDI ID p50 ({len(made)}, 1g.10gb made)",
            ms(statistics.median(made)), "", None),
        Row(f"DRA dynamic MIG prepare → CDI ID p99 (driver creation {ms(CREATION_S)})",
            ms(made_p99), f"< {ms(CREATION_S + 0.050)}", made_p99 < CREATION_S + 0.050),
        Row("DRA dynamic MIG NodePrepareResources p99, no API read",
            ms(percentile(mig["prepare"], 99)), "", None),
        Row(f"DRA dynamic MIG after a reboot: claim prepared again p50 ({len(again)}, made again)",
            ms(statistics.median(again)), "", None),
        Row(f"DRA dynamic MIG after a reboot: again p99 (driver creation {ms(CREATION_S)})",
            ms(again_p99), f"< {ms(CREATION_S + 0.100)}", again_p99 < CREATION_S + 0.100),
        Row("DRA dynamic MIG before the reboot: the same claims' first prepare p50 / p99",
            f"{ms(statistics.median(reboot['first']))} / {ms(percentile(reboot['first'], 99))}", "",
            None),
        Row(f"DRA dynamic MIG: {MIG_NODE_GPUS} H100s publish",
            f"{mig['devices']} devices, {mig['slices']} slices, {mig['bytes']} bytes", "", None),
        *shares,
    ]  # fmt: skip
