"""The /metrics part of scripts/bench: scrape latency and throughput, pod-resources calls, RSS.

Three node shapes, each served by a separate process (``--serve-synthetic``) that runs gpuagent's
own HTTP server and renderer over a synthetic snapshot (the simulator need not support the shape):

* ``8 GPUs``;
* ``8 GPUs x 7 MIG``: every GPU split into seven 1g instances (56 series per family);
* ``1,024 replicas``: 8 GPUs shared by 128 time-slicing replicas each, every replica held by its
  own pod (1,024 series per family).

The serving process bumps the snapshot version every ``poll`` seconds with new telemetry (as the
NVML poller does), so cold renders happen at their real rate. Scrapes ask for gzip, as Prometheus
does, over one keep-alive connection. "Server side" is the handler's own time (the
``gpuagent_scrape_duration_seconds`` measurement, recorded exactly); "end to end" is the client's.

Then a real agent (``--simulate 8``) with a pod-resources stand-in: List calls per minute at rest,
and RSS before and after 10,000 scrapes.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from benchlib import Row, agent, free_port, ms, percentile, tempdir  # noqa: E402
from support.fake_podresources import FakePodResources, Held  # noqa: E402
from support.grpcstubs import StubModules  # noqa: E402
from support.synthetic import full_telemetry, synthetic_snapshot  # noqa: E402

SHAPES: dict[str, dict[str, Any]] = {
    "8 GPUs": {"gpus": 8},
    "8 GPUs x 7 MIG": {"gpus": 8, "mig": True},
    "1,024 replicas": {"gpus": 8, "replicas": 128},
}
TARGET_P99 = {"8 GPUs": 0.005, "1,024 replicas": 0.025}  # issue 4's targets


def serve_synthetic(shape: str, port: int, poll: float, out: Path) -> None:
    """Serve /metrics for ``shape`` until SIGTERM; then write the handler durations to ``out``."""
    import uvloop  # noqa: PLC0415

    from gpuagent.domain.readiness import Readiness  # noqa: PLC0415
    from gpuagent.state.store import DeviceStore  # noqa: PLC0415
    from gpuagent.web.histogram import SCRAPE_BUCKETS, Histogram  # noqa: PLC0415
    from gpuagent.web.metrics import MetricsRenderer  # noqa: PLC0415
    from gpuagent.web.server import HttpServer, build_app  # noqa: PLC0415

    class _Probes:
        def liveness(self) -> str | None:
            return None

        def readiness(self) -> Readiness:
            return Readiness()

        def freshness(self) -> str | None:
            return None

    async def main() -> None:
        store = DeviceStore(synthetic_snapshot(**SHAPES[shape]))
        renderer = MetricsRenderer("bench-node", "bench")
        durations: list[float] = []

        class Recording(Histogram):
            def observe(self, value: float) -> None:
                durations.append(value)
                super().observe(value)

        renderer.scrapes = Recording(SCRAPE_BUCKETS)
        server = HttpServer(build_app(store, renderer, _Probes()), "127.0.0.1", port)
        await server.start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        tick = 0
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), poll)
            except TimeoutError:
                tick += 1
                store.update(_with_telemetry(full_telemetry(tick)))
        await server.close()
        result = json.dumps({"durations": durations, "renders": renderer.device_renders})
        await asyncio.to_thread(out.write_text, result)

    uvloop.run(main())


def _with_telemetry(telemetry: Any) -> Callable[[Any], Any]:
    return lambda s: replace(s, gpus=tuple(replace(g, telemetry=telemetry) for g in s.gpus))


# ----- the client side ---------------------------------------------------------------------------
def _scrape(conn: http.client.HTTPConnection) -> int:
    conn.request("GET", "/metrics", headers={"Accept-Encoding": "gzip"})
    response = conn.getresponse()
    body = response.read()
    if response.status != 200:
        raise RuntimeError(f"/metrics answered {response.status}")
    return len(body)


def _wait_listening(port: int, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("the serving process exited")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            _scrape(conn)
        except OSError:
            time.sleep(0.05)
        else:
            conn.close()
            return
    raise RuntimeError("the serving process did not listen in 30 s")


def bench_shape(shape: str, scrapes: int, poll: float) -> dict[str, float]:
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "durations.json"
        proc = subprocess.Popen(
            [sys.executable, __file__, "--serve-synthetic", shape, "--port", str(port),
             "--poll", str(poll), "--out", str(out)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            _wait_listening(port, proc)
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            for _ in range(min(200, scrapes)):  # warm-up
                size = _scrape(conn)
            latencies = []
            started = time.perf_counter()
            for _ in range(scrapes):
                t0 = time.perf_counter()
                _scrape(conn)
                latencies.append(time.perf_counter() - t0)
            elapsed = time.perf_counter() - started
            conn.close()
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
        server = json.loads(out.read_text())
    durations = server["durations"][-scrapes:]
    return {
        "e2e_p50": percentile(latencies, 50),
        "e2e_p99": percentile(latencies, 99),
        "server_p50": percentile(durations, 50),
        "server_p99": percentile(durations, 99),
        "server_max": max(durations),
        "per_second": scrapes / elapsed,
        "gzip_bytes": size,
        "renders": server["renders"],
    }


def bench_cold_render(shape: str, runs: int = 20) -> tuple[float, float]:
    """A new snapshot version's device part, in process (the first scrape after a poll).

    Returns the p50 of the render alone and of render + gzip (the first gzip scrape of a version
    compresses the device part once, on the event loop).
    """
    from gpuagent.web.metrics import MetricsRenderer  # noqa: PLC0415

    renderer = MetricsRenderer("bench-node", "bench")
    base = synthetic_snapshot(**SHAPES[shape])
    render, gzipped = [], []
    for version in range(runs):
        t0 = time.perf_counter()
        renderer.devices(
            _with_telemetry(full_telemetry(version))(replace(base, version=2 * version))
        )
        render.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        snapshot = _with_telemetry(full_telemetry(version))(replace(base, version=2 * version + 1))
        renderer.devices(snapshot).gzip(b"")
        gzipped.append(time.perf_counter() - t0)
    return percentile(render, 50), percentile(gzipped, 50)


def bench_agent_at_rest(
    stubs: StubModules,
    idle_seconds: float,
    scrapes: int,
) -> dict[str, float]:
    """A real agent on 8 simulated GPUs: pod-resources calls at rest, RSS over many scrapes."""
    with tempdir() as d, FakePodResources(d.parent / "pod-resources" / "kubelet.sock", stubs) as pr:
        pr.set([Held("bench", "pod-0", "main", "nvidia.com/gpu", ("0",))])
        extra = ["--pod-resources-socket", str(pr.socket_path), "--device-id-strategy", "index"]
        with agent(d, 8, extra) as a:
            deadline = time.monotonic() + 30
            while pr.calls == 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(1.0)
            start_calls, t0 = pr.calls, time.monotonic()
            time.sleep(idle_seconds)
            calls = pr.calls - start_calls
            window = time.monotonic() - t0
            conn = http.client.HTTPConnection("127.0.0.1", a.port, timeout=30)
            for _ in range(1000):  # warm-up: caches, allocator arenas
                _scrape(conn)
            rss_before, _ = a.rss_mib()
            for _ in range(scrapes):
                _scrape(conn)
            rss_after, hwm = a.rss_mib()
            conn.close()
            calls_during_scrapes = pr.calls - start_calls - calls
    return {
        "calls_per_minute": calls * 60 / window,
        "calls": calls,
        "window": window,
        "rss_before": rss_before,
        "rss_after": rss_after,
        "hwm": hwm,
        "calls_during_scrapes": calls_during_scrapes,
    }


def rows(stubs: StubModules, args: argparse.Namespace) -> list[Row]:
    out = []
    for shape in SHAPES:
        render, gzipped = bench_cold_render(shape)
        target = TARGET_P99.get(shape)
        out.append(Row(f"/metrics {shape}: new version, render / render+gzip p50",
                       f"{ms(render)} / {ms(gzipped)}",
                       f"< {target * 1000:g} ms" if target else "",
                       gzipped < target if target else None))  # fmt: skip
        r = bench_shape(shape, args.scrapes, args.scrape_poll)
        target = TARGET_P99.get(shape)
        goal = f"p99 < {target * 1000:g} ms" if target else ""
        out.append(Row(f"/metrics {shape}: server side p50 / p99",
                       f"{ms(r['server_p50'])} / {ms(r['server_p99'])}", goal,
                       r["server_p99"] < target if target else None))  # fmt: skip
        out.append(Row(f"/metrics {shape}: end to end p50 / p99",
                       f"{ms(r['e2e_p50'])} / {ms(r['e2e_p99'])}", goal,
                       r["e2e_p99"] < target if target else None))  # fmt: skip
        floor = 1000 if shape == "8 GPUs" else None
        out.append(Row(f"/metrics {shape}: scrapes/s (1 connection, gzip)",
                       f"{r['per_second']:.0f}/s, {r['gzip_bytes'] / 1024:.0f} KiB, "
                       f"{r['renders']} renders",
                       "≥ 1,000/s" if floor else "",
                       r["per_second"] >= floor if floor else None))  # fmt: skip
    rest = bench_agent_at_rest(stubs, args.idle_seconds, args.rss_scrapes)
    out.append(Row(f"pod-resources List calls at rest ({rest['calls']} in {rest['window']:.0f} s)",
                   f"{rest['calls_per_minute']:.1f}/min", "≤ 12/min",
                   rest["calls_per_minute"] <= 12))  # fmt: skip
    out.append(Row(f"pod-resources calls during {args.rss_scrapes:,} scrapes",
                   f"{rest['calls_during_scrapes']}", "no per-scrape calls",
                   rest["calls_during_scrapes"] <= 2))  # fmt: skip
    growth = rest["rss_after"] - rest["rss_before"]
    out.append(Row(f"RSS before / after {args.rss_scrapes:,} scrapes (8 GPUs)",
                   f"{rest['rss_before']:.1f} / {rest['rss_after']:.1f} MiB "
                   f"(peak {rest['hwm']:.1f})",
                   "no growth (< 1 MiB)", growth < 1.0))  # fmt: skip
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scrapes", type=int, default=3000, help="scrapes per shape")
    parser.add_argument("--scrape-poll", type=float, default=5.0,
                        help="seconds between snapshot versions while scraping")  # fmt: skip
    parser.add_argument("--rss-scrapes", type=int, default=10_000)


def _serve_main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--serve-synthetic", choices=list(SHAPES), required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--poll", type=float, default=5.0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    serve_synthetic(args.serve_synthetic, args.port, args.poll, args.out)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    sys.exit(_serve_main())
