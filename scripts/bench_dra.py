"""DRA rows of scripts/bench: NodePrepareResources for one claim, and fault → ResourceSlice taint.

The agent runs in-process (as the end-to-end tests run it) on simulated GPUs, all given to DRA,
with the API-server stand-in (aiohttp, every write schema-validated) and the plugin-watcher
stand-in (grpcio, in worker threads) of tests/support. In-process means the grpcio client shares
the interpreter with the agent: the round trips are upper bounds.

- ``NodePrepareResources`` p99 excluding the API read: the agent's own time per claim (it records
  the claim read separately), each claim prepared once and unprepared.
- The kubelet-side round trip, API read (from a local stand-in) included.
- fault → ResourceSlice updated: an XID injected over /sim/faults until the API server holds the
  device's taint; then ``recover`` until the taint is gone.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import uvloop
from e2e.agentrun import running_agent
from support.fake_apiserver import FakeApiServer, claim
from support.fake_plugin_watcher import FakePluginWatcher
from support.grpcstubs import dra_stubs

from gpuagent import logs
from gpuagent.dra.endpoint import EndpointTiming
from gpuagent.kube.slices import Backoff, Coalescing

NODE = "bench-node"
DRIVER = "gpu.nvidia.com"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dra-claims", type=int, default=300, help="claims prepared (DRA rows)")
    parser.add_argument("--dra-faults", type=int, default=20, help="faults injected (DRA rows)")


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


async def _wait(check: Any) -> None:
    deadline = time.perf_counter() + 10.0
    while not check():
        if time.perf_counter() > deadline:
            raise TimeoutError("condition not reached")
        await asyncio.sleep(0.001)


async def _measure(gpus: int, claims: int, faults: int, root: Path) -> dict[str, list[float]]:
    api = FakeApiServer(node=NODE)
    await api.start()
    stubs = dra_stubs()
    watcher = FakePluginWatcher(root / "registry", stubs)
    args = (
        "--simulate", str(gpus), "--dra-gpus", "all",
        "--kubeconfig", str(api.kubeconfig(root / "kubeconfig")),
        "--plugins-dir", str(root / "plugins"),
        "--plugins-registry-dir", str(root / "registry"),
        "--cdi-spec-dir", str(root / "cdi"),
        "--poll-interval", "5",  # production's default; the test runner's 0.05 s is for tests
    )  # fmt: skip
    options = {
        "node_name": NODE,
        "dra_options": {
            "endpoint_timing": EndpointTiming(watch_interval=0.05),
            "backoff": Backoff(initial=0.05, maximum=0.5),
            # Each fault after a quiet spell, as one is (0.2 s gathering what it changes); the
            # merging of a storm's changes (30 s windows) is measured by tests/kube/test_slices.py.
            "coalescing": Coalescing(window=0.0),
        },
    }
    out: dict[str, list[float]] = {"round_trip": [], "to_taint": [], "to_clear": []}
    try:
        async with running_agent(root / "device-plugins", args, agent_options=options) as run:
            reg = await watcher.aregister(await watcher.afind())
            await _wait(lambda: len(api.devices()) == gpus)
            name = sorted(api.devices())[0]
            for i in range(claims):
                uid = f"bench-{i}"
                api.add_claim(claim("bench", f"c{i}", uid, [("gpu", DRIVER, NODE, name)]))
                started = time.perf_counter()
                response = await watcher.aprepare(reg, [("bench", f"c{i}", uid)])
                out["round_trip"].append(time.perf_counter() - started)
                assert response.claims[uid].error == "", response.claims[uid].error
                await watcher.aunprepare(reg, [("bench", f"c{i}", uid)])
            assert run.agent.dra is not None
            out["prepare"] = list(run.agent.dra.stats.prepare_seconds)
            out["api_read"] = list(run.agent.dra.stats.api_read_seconds)
            device = api.devices()[name]
            uuid = device["attributes"]["uuid"]["string"]
            gpu = next(g.index for g in run.agent.store.snapshot.gpus if g.uuid == uuid)

            def tainted() -> bool:
                return bool(api.devices()[name].get("taints"))

            for _ in range(faults):
                started = time.perf_counter()
                await run.fault({"gpu": gpu, "fault": "xid", "xid": 48})
                await _wait(tainted)
                out["to_taint"].append(time.perf_counter() - started)
                started = time.perf_counter()
                await run.fault({"gpu": gpu, "fault": "recover"})
                await _wait(lambda: not tainted())
                out["to_clear"].append(time.perf_counter() - started)
            assert api.invalid == [], api.invalid
    finally:
        await api.stop()
    return out


def rows(args: argparse.Namespace, row: Any) -> list[Any]:
    logs.configure("console", "warning")  # the in-process agent's info lines would drown the table
    root = Path(tempfile.mkdtemp(prefix="gad-", dir="/tmp"))
    try:
        m = uvloop.run(_measure(args.gpus, args.dra_claims, args.dra_faults, root))
    finally:
        shutil.rmtree(root, ignore_errors=True)

    def ms(seconds: float) -> str:
        return f"{seconds * 1000:.2f} ms"

    prepare = _p(m["prepare"], 99)
    taint = _p(m["to_taint"], 99)
    return [
        row(f"DRA NodePrepareResources p50, 1 claim ({len(m['prepare'])}), no API read",
            ms(statistics.median(m["prepare"])), "", None),
        row("DRA NodePrepareResources p99, 1 claim, no API read", ms(prepare), "< 20 ms",
            prepare < 0.020),
        row("DRA NodePrepareResources round trip p99 (kubelet side, local API read)",
            ms(_p(m["round_trip"], 99)), "", None),
        row("DRA claim read from the API server p50", ms(statistics.median(m["api_read"])), "",
            None),
        row(f"DRA fault → ResourceSlice tainted p50 ({len(m['to_taint'])})",
            ms(statistics.median(m["to_taint"])), "", None),
        row("DRA fault → ResourceSlice tainted p99", ms(taint), "< 1 s", taint < 1.0),
        row("DRA recover → ResourceSlice taint cleared p99", ms(_p(m["to_clear"], 99)), "",
            None),
    ]  # fmt: skip
