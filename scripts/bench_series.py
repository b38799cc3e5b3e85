"""The /metrics size rows of scripts/bench: series, bytes and the event loop's stalls, per shape.

Counts, not timings (they do not depend on this machine's speed), for the node shapes of issue 24:

* **8 GPUs**: a real agent's whole page on 8 simulated GPUs (``--simulate 8``, per-container
  accounting on, no API server: the node condition's families absent), once every GPU has been
  probed twice (the GPM ratios and the NVLink rate are there from the second probe);
* **8 GPUs x 10 / x 50 containers**: the device part — every ``DCGM_FI_*`` series and the per-GPU
  and per-container families — rendered in process from a synthetic snapshot of 8 GPUs with every
  field NVML offers (more than the simulator's), each GPU time-sliced among 10 or 50 containers
  that all use it; plus that real agent's own part (the families the device part does not have).

Each shape is measured as shipped (the defaults) and with the options that bring the earlier
series back (``--dcgm-series-per-container --detailed-agent-metrics``). Then the loop: back-to-back
cold scrapes at 8 x 50 (each a new snapshot version, rendered and gzipped as a scrape does) while a
probe task asks ``call_later`` for a callback every millisecond and records how late each fires.
"""

from __future__ import annotations

import asyncio
import gc
import gzip
import http.client
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from benchlib import Row, agent, percentile, tempdir
from prometheus_client.parser import text_string_to_metric_families
from support.synthetic import full_telemetry, synthetic_snapshot, with_usage

from gpuagent.web.metrics import MetricsRenderer

SHAPES: dict[str, int] = {"8 GPUs": 0, "8 GPUs x 10 containers": 10, "8 GPUs x 50 containers": 50}
TARGETS = {"8 GPUs": 300, "8 GPUs x 50 containers": 2500}
RAW_TARGET = 500_000
GZIP_TARGET = 40_000
OWN_TARGET = 30
STALL_TARGET = 0.005


def series_of(text: str) -> int:
    return sum(1 for line in text.splitlines() if line and not line.startswith("#"))


def families_of(text: str) -> set[str]:
    return {f.name for f in text_string_to_metric_families(text)}


def own_part(page: str, device_families: set[str]) -> str:
    """The lines of ``page`` whose family is not one of the device part's."""
    kept = []
    for line in page.splitlines():
        name = line.split(" ")[2] if line.startswith("#") else line.split("{")[0].split(" ")[0]
        base = name.removesuffix("_bucket").removesuffix("_sum").removesuffix("_count")
        if not {name, base, name.removesuffix("_total")} & device_families:
            kept.append(line + "\n")
    return "".join(kept)


def device_part(replicas: int, compatible: bool) -> str:
    snapshot = synthetic_snapshot(8, replicas=max(1, replicas))
    if replicas:
        snapshot = with_usage(snapshot)
    else:
        snapshot = replace(snapshot, pods=replace(snapshot.pods, allocated=()))
    renderer = MetricsRenderer("bench-node", "bench", series_per_container=compatible)
    return renderer.devices(snapshot).text.decode()


def _complete(page: str) -> bool:
    """Every GPU read twice (the GPM ratios and the NVLink rate need two probes: at the default
    poll, 5 s after the first), and an earlier scrape timed."""
    lines = page.splitlines()
    twice = sum(line.startswith("DCGM_FI_PROF_GR_ENGINE_ACTIVE{") for line in lines) == 8
    return twice and "gpuagent_scrape_duration_seconds_count" in page


def real_agent_pages() -> dict[bool, str]:
    """A real agent's /metrics on 8 simulated GPUs, by ``--detailed-agent-metrics``."""
    pages = {}
    for detailed in (False, True):
        extra = ["--container-accounting=true"]
        if detailed:
            extra.append("--detailed-agent-metrics")
        with tempdir() as d, agent(d, 8, extra) as a:
            deadline = time.monotonic() + 30
            page = ""
            while time.monotonic() < deadline:
                try:
                    page = a.get("/metrics").decode()
                except (OSError, http.client.HTTPException):
                    page = ""
                if _complete(page):
                    break
                time.sleep(0.2)
            pages[detailed] = a.get("/metrics").decode()
    return pages


def sizes() -> Iterator[dict[str, Any]]:
    pages = real_agent_pages()
    plain = device_part(0, False)
    for compatible in (False, True):
        own = own_part(pages[compatible], families_of(plain))
        for shape, replicas in SHAPES.items():
            text = device_part(replicas, compatible) + own if replicas else pages[compatible]
            yield {
                "shape": shape,
                "compatible": compatible,
                "series": series_of(text),
                "own": series_of(own),
                "raw": len(text.encode()),
                "gzip": len(gzip.compress(text.encode(), 1)),
            }


async def _stalls(replicas: int, scrapes: int, asynchronous: bool) -> dict[str, float]:
    loop = asyncio.get_running_loop()
    renderer = MetricsRenderer("bench-node", "bench")
    # Every tenth version a pod set of its own: the label layout is built again (pods churn).
    bases = [with_usage(synthetic_snapshot(8, replicas=replicas, pod_prefix=p)) for p in "ab"]
    gc.collect()
    gc.freeze()  # as the agent does once started: what was built stays out of the collections
    late: list[float] = []
    held: list[float] = []
    last_cpu = [time.thread_time()]
    done = asyncio.Event()

    def tick(due: float) -> None:
        late.append(loop.time() - due)
        # The loop thread's own CPU time since the last tick: what held the loop, without the
        # time this process was not running at all (a busy machine).
        now = time.thread_time()
        held.append(now - last_cpu[0])
        last_cpu[0] = now
        if not done.is_set():
            loop.call_later(0.001, tick, loop.time() + 0.001)

    loop.call_later(0.001, tick, loop.time() + 0.001)
    scrape_s = []
    for version in range(scrapes):
        base = bases[version // 10 % 2]
        gpus = tuple(replace(g, telemetry=full_telemetry(version)) for g in base.gpus)
        snapshot = replace(base, version=version + 1, gpus=gpus)
        t0 = time.perf_counter()
        if asynchronous:
            part = await renderer.devices_async(snapshot)
            await part.deflate(0.001)
            part.gzip(b"")
        else:
            renderer.devices(snapshot).gzip(b"")
        scrape_s.append(time.perf_counter() - t0)
        await asyncio.sleep(0)
    done.set()
    await asyncio.sleep(0.01)
    return {
        "p50": percentile(scrape_s, 50),
        "p99": percentile(scrape_s, 99),
        "stall": max(late),
        "stall_p99": percentile(late, 99),
        "held": max(held),
    }


def rows(args: Any) -> list[Row]:
    out = []
    for r in sizes():
        mode = "--dcgm-series-per-container --detailed-agent-metrics" if r["compatible"] else ""
        name = f"/metrics {r['shape']}{' with ' + mode if mode else ''}"
        target = None if r["compatible"] else TARGETS.get(r["shape"])
        met = r["series"] <= target and r["own"] <= OWN_TARGET if target else None
        out.append(Row(f"{name}: series (agent's own)", f"{r['series']:,} ({r['own']})",
                       f"≤ {target:,}, own ≤ {OWN_TARGET}" if target else "", met))  # fmt: skip
        big = not r["compatible"] and r["shape"].endswith("50 containers")
        met = r["raw"] <= RAW_TARGET and r["gzip"] <= GZIP_TARGET if big else None
        out.append(Row(f"{name}: raw / gzip",
                       f"{r['raw'] / 1000:,.0f} KB / {r['gzip'] / 1000:,.1f} KB",
                       "≤ 500 KB / ≤ 40 KB" if big else "", met))  # fmt: skip
    for asynchronous in (False, True):
        s = asyncio.run(_stalls(50, args.stall_scrapes, asynchronous))
        how = "a family / 64 KiB at a time" if asynchronous else "at once (the earlier way)"
        out.append(Row(f"/metrics 8 x 50 cold scrape, rendered {how}: p50 / p99; loop lag "
                       "p99 / max",
                       f"{s['p50'] * 1000:.1f} / {s['p99'] * 1000:.1f} ms; "
                       f"{s['stall_p99'] * 1000:.1f} / {s['stall'] * 1000:.1f} ms",
                       "stall ≤ 5 ms" if asynchronous else "",
                       s["stall"] <= STALL_TARGET if asynchronous else None))  # fmt: skip
        out.append(Row(f"/metrics 8 x 50 cold scrape, rendered {how}: longest loop hold "
                       "(the loop thread's CPU time between probe ticks)",
                       f"{s['held'] * 1000:.1f} ms",
                       "≤ 5 ms" if asynchronous else "",
                       s["held"] <= STALL_TARGET if asynchronous else None))  # fmt: skip
    return out


def add_arguments(parser: Any) -> None:
    parser.add_argument("--stall-scrapes", type=int, default=200,
                        help="back-to-back cold scrapes the loop-lag probe watches")  # fmt: skip
