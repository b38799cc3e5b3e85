"""The per-container accounting part of scripts/bench (also runnable alone).

* **Poll cost per GPU** with 50 processes on each of 8 simulated GPUs, in process: the GPU's whole
  probe (telemetry plus the per-process reads, through pynvml on the simulated driver, every poll
  seeing a new utilisation sample of all 50 processes), plus its share of the accountant's round
  (cgroups from the /proc reader's cache, the pure accounting) — what one poll costs per GPU.
* **CRI calls at rest**: a real agent (``--simulate 8``) with 400 processes in 400 containers, a
  CRI stand-in and cgroup files under ``--proc-root``; the runtime's calls once everything is
  named, over a window of polls.
* **Scrape p99 at 8 GPUs x 50 containers**: the same agent, every GPU time-sliced among its 50
  containers (so every dcgm-exporter family has 400 series too), scraped with gzip over one
  keep-alive connection while it polls every second.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from benchlib import Row, agent, ms, percentile, table, tempdir  # noqa: E402
from support.cgroups import LAYOUTS, cgroup_file, write_proc  # noqa: E402
from support.clock import FakeClock  # noqa: E402
from support.fake_cri import FakeCri, RuntimeContainer  # noqa: E402
from support.fake_kubelet import FakeKubelet  # noqa: E402
from support.fake_podresources import FakePodResources, Held  # noqa: E402
from support.grpcstubs import CriStubs, StubModules, cri_stubs, kubelet_stubs  # noqa: E402

GPUS = 8
PER_GPU = 50


def _pid(gpu: int, n: int) -> int:
    return 10_000 + gpu * 1000 + n


def _container_id(pid: int) -> str:
    return f"{pid:064x}"


def _pod_uid(pid: int) -> str:
    return f"{pid:08x}-0000-4000-8000-{pid:012x}"


def _write_cgroups(root: Path) -> Path:
    files = {}
    for gpu in range(GPUS):
        for n in range(PER_GPU):
            pid = _pid(gpu, n)
            layout = LAYOUTS[pid % len(LAYOUTS)]
            files[pid] = cgroup_file(layout, _pod_uid(pid), _container_id(pid))
    return write_proc(root, files)


# ----- poll cost, in process ---------------------------------------------------------------------
def bench_poll_cost(cycles: int) -> dict[str, float]:
    from gpuagent.domain.accounting import Ledger, account  # noqa: PLC0415
    from gpuagent.domain.devices import Allocated, Attribution, PodRef  # noqa: PLC0415
    from gpuagent.domain.snapshot import Snapshot  # noqa: PLC0415
    from gpuagent.gpu.nvml import Nvml  # noqa: PLC0415
    from gpuagent.gpu.sim import SimDriver, install, node_from_count, uninstall  # noqa: PLC0415
    from gpuagent.gpu.sim.processes import SAMPLE_PERIOD_US  # noqa: PLC0415
    from gpuagent.gpu.sim.spec import SimLatency  # noqa: PLC0415
    from gpuagent.runtime.procfs import ProcReader  # noqa: PLC0415
    from gpuagent.web.metrics import MetricsRenderer  # noqa: PLC0415

    clock = FakeClock(1000.0)
    # No simulated per-call latency: what is measured is the agent's own work per poll (with the
    # simulator's Python), as when the target was set; the simulator's default latencies are
    # wall-clock sleeps, in the health bench's "poll cycle per GPU" row.
    node = replace(node_from_count(GPUS), latency=SimLatency(default_s=0.0, calls={}))
    driver = SimDriver(node, clock=clock)

    def probes(nvml: Nvml) -> list[float]:
        out = []
        for _ in range(cycles):
            clock.now += SAMPLE_PERIOD_US / 1e6
            for index in range(GPUS):
                t0 = time.perf_counter()
                nvml.probe(index)
                out.append(time.perf_counter() - t0)
        return out

    install(driver)
    with tempfile.TemporaryDirectory() as tmp:
        nvml = Nvml(sysfs_root=Path(tmp))
        try:
            nvml.init()
            gpus = nvml.discover()
            bare = probes(nvml)  # without processes: telemetry alone
            for gpu in range(GPUS):
                for n in range(PER_GPU):
                    driver.add_process(gpu, _pid(gpu, n), 100, 1 + n % 2)
            loaded = probes(nvml)
            clock.now += SAMPLE_PERIOD_US / 1e6
            read = [nvml.probe(i) for i in range(GPUS)]
            assert all(p.processes and len(p.processes.processes) == PER_GPU for p in read)
            assert all(len(p.processes.samples or ()) == PER_GPU for p in read if p.processes)
        finally:
            nvml.shutdown()
            uninstall()
        snapshot = Snapshot(
            gpus=tuple(
                replace(g, processes=p.processes, telemetry=p.telemetry)
                for g, p in zip(gpus, read, strict=True)
            )
        )
        proc = ProcReader(_write_cgroups(Path(tmp) / "proc"))
        names = {
            _container_id(_pid(g, n)): PodRef("bench", f"pod-{g}-{n}", "main")
            for g in range(GPUS)
            for n in range(PER_GPU)
        }
        pids = [p.pid for g in snapshot.gpus if g.processes for p in g.processes.processes]
        proc.owners(pids)  # first sight: the files are read once
        ledger = Ledger()
        rounds = []
        for _ in range(cycles):
            t0 = time.perf_counter()
            owners = proc.owners(pids)
            usage, ledger = account(snapshot, owners, names, ledger)
            rounds.append(time.perf_counter() - t0)
        assert len(usage.containers) == GPUS * PER_GPU
        assert all(u.pod for u in usage.containers)
        # A new snapshot version's device part (the first scrape after a poll): every GPU
        # time-sliced among its 50 containers, so each dcgm-exporter family has 400 series too.
        held = tuple(
            Allocated("bench", f"pod-{g.index}-{n}", "main", "nvidia.com/gpu", (f"{g.uuid}::{n}",))
            for g in snapshot.gpus
            for n in range(PER_GPU)
        )
        shown = replace(snapshot, usage=usage, pods=Attribution(held, refreshed_at=1.0))
        renderer = MetricsRenderer("bench-node", "bench")
        renders = []
        for version in range(1, 51):
            t0 = time.perf_counter()
            renderer.devices(replace(shown, version=version)).gzip(b"")
            renders.append(time.perf_counter() - t0)
    probe = statistics.mean(loaded)
    accounting = statistics.mean(rounds) / GPUS
    return {
        "probe_bare": statistics.mean(bare),
        "probe": probe,
        "probe_p99": percentile(loaded, 99),
        "accounting_per_gpu": accounting,
        "poll_per_gpu": probe + accounting,
        "render": statistics.median(renders),
    }


# ----- a real agent ------------------------------------------------------------------------------
def _get(port: int, path: str) -> bytes:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
        return bytes(r.read())


def _post(port: int, path: str, body: object) -> None:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=10) as r:
        r.read()


def _named_containers(text: str) -> int:
    """Containers with a running process and a name (holders are named by pod-resources alone)."""
    return sum(
        1
        for line in text.splitlines()
        if line.startswith("gpuagent_container_gpu_processes{")
        and 'pod=""' not in line
        and not line.endswith(" 0")
    )


def bench_agent(
    stubs: StubModules,
    cri_stubs: CriStubs,
    window: float,
    scrapes: int,
) -> dict[str, float]:
    with tempdir() as d:
        base = d.parent
        proc = _write_cgroups(base / "proc")
        containers = [
            RuntimeContainer(_container_id(_pid(g, n)), "bench", f"pod-{g}-{n}", "main",
                             pod_uid=_pod_uid(_pid(g, n)))
            for g in range(GPUS) for n in range(PER_GPU)
        ]  # fmt: skip
        with (
            FakePodResources(base / "pr" / "kubelet.sock", stubs) as pr,
            FakeCri(base / "cri" / "containerd.sock", cri_stubs) as cri,
            FakeKubelet(d, stubs) as kubelet,
        ):
            cri.set(containers)
            # Every GPU time-sliced among its 50 containers, as the kubelet lists them.
            pr.set(
                Held("bench", f"pod-{g}-{n}", "main", "nvidia.com/gpu", (f"{g}::{n}",))
                for g in range(GPUS) for n in range(PER_GPU)
            )  # fmt: skip
            extra = [
                "--pod-resources-socket", str(pr.socket_path),
                "--device-id-strategy", "index",
                "--cri-socket", str(cri.socket_path),
                # No kubelet log links here (an empty directory): the CRI stand-in names all.
                "--container-logs-dir", str(proc),
                "--proc-root", str(proc),
                "--poll-interval", "1",
            ]  # fmt: skip
            with agent(d, GPUS, extra) as a:
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    try:
                        _get(a.port, "/sim/gpus")
                        break
                    except OSError:
                        time.sleep(0.05)
                for g in range(GPUS):
                    for n in range(PER_GPU):
                        body = {"gpu": g, "pid": _pid(g, n), "memory_mib": 100, "sm_util": 1}
                        _post(a.port, "/sim/processes", body)
                while _named_containers(_get(a.port, "/metrics").decode()) < GPUS * PER_GPU:
                    if time.monotonic() > deadline:
                        raise RuntimeError("the agent did not name every container in 60 s")
                    time.sleep(0.2)
                named_after = cri.calls
                t0 = time.monotonic()
                time.sleep(window)
                at_rest = cri.calls - named_after
                elapsed = time.monotonic() - t0
                conn = http.client.HTTPConnection("127.0.0.1", a.port, timeout=30)
                headers = {"Accept-Encoding": "gzip"}
                size = 0
                for _ in range(100):  # warm-up
                    conn.request("GET", "/metrics", headers=headers)
                    size = len(conn.getresponse().read())
                latencies = []
                for _ in range(scrapes):
                    t1 = time.perf_counter()
                    conn.request("GET", "/metrics", headers=headers)
                    conn.getresponse().read()
                    latencies.append(time.perf_counter() - t1)
                conn.close()
                during_scrapes = cri.calls - named_after - at_rest
                page = _get(a.port, "/metrics").decode()
                alone, scraped = _allocations(kubelet, a.port, scrapes)
                rss, hwm = a.rss_mib()
    series = sum(1 for line in page.splitlines() if line and not line.startswith("#"))
    return {
        "allocate_p99": percentile(alone, 99),
        "allocate_scraped_p99": percentile(scraped, 99),
        "series": series,
        "raw_bytes": len(page.encode()),
        "rss": rss,
        "hwm": hwm,
        "refreshes": named_after,
        "at_rest": at_rest,
        "per_minute": at_rest * 60 / elapsed,
        "window": elapsed,
        "during_scrapes": during_scrapes,
        "scrape_p50": percentile(latencies, 50),
        "scrape_p99": percentile(latencies, 99),
        "gzip_bytes": size,
    }


def _allocations(kubelet: FakeKubelet, port: int, count: int) -> tuple[list[float], list[float]]:
    """Allocate round trips as the kubelet sees them: alone, then while another client scrapes
    /metrics back to back (gzip; a new version to render and compress after every poll)."""
    (reg,) = kubelet.wait_for_registrations(1, 30)
    ids = [dev.ID for dev in reg.next_update(10).devices]

    def timed() -> list[float]:
        out = []
        for i in range(count):
            t0 = time.perf_counter()
            kubelet.allocate([ids[i % len(ids)]])
            out.append(time.perf_counter() - t0)
        return out

    alone = timed()
    stop = threading.Event()

    def scrape() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        while not stop.is_set():
            conn.request("GET", "/metrics", headers={"Accept-Encoding": "gzip"})
            conn.getresponse().read()
        conn.close()

    scraper = threading.Thread(target=scrape)
    scraper.start()
    try:
        scraped = timed()
    finally:
        stop.set()
        scraper.join(30)
    return alone, scraped


def rows(stubs: StubModules, args: argparse.Namespace) -> list[Row]:
    out = []
    poll = bench_poll_cost(args.poll_cycles)
    out.append(Row("poll per GPU, 8 GPUs x 50 processes, no sim latency (probe + accounting)",
                   ms(poll["poll_per_gpu"], 3), "< 2 ms",
                   poll["poll_per_gpu"] < 0.002))  # fmt: skip
    out.append(Row("  probe per GPU with 50 processes / without any (p99 with)",
                   f"{ms(poll['probe'], 3)} / {ms(poll['probe_bare'], 3)} "
                   f"({ms(poll['probe_p99'], 3)})", "", None))  # fmt: skip
    out.append(Row("  accounting per GPU (cgroups cached, 400 containers)",
                   ms(poll["accounting_per_gpu"], 3), "", None))  # fmt: skip
    out.append(Row("/metrics 8 GPUs x 50 containers: new version, render+gzip p50",
                   ms(poll["render"], 3), "", None))  # fmt: skip
    r = bench_agent(stubs, cri_stubs(), args.cri_window, args.accounting_scrapes)
    out.append(Row(f"CRI calls naming 400 containers / at rest ({r['at_rest']} in "
                   f"{r['window']:.0f} s of 1 s polls)",
                   f"{r['refreshes']} / {r['per_minute']:.1f}/min", "0/min beyond the refresh",
                   r["at_rest"] == 0))  # fmt: skip
    out.append(Row(f"CRI calls during {args.accounting_scrapes:,} scrapes",
                   str(r["during_scrapes"]), "0", r["during_scrapes"] == 0))  # fmt: skip
    out.append(Row("/metrics 8 GPUs x 50 containers: end to end p50 / p99",
                   f"{ms(r['scrape_p50'], 3)} / {ms(r['scrape_p99'], 3)}, "
                   f"{r['gzip_bytes'] / 1024:.0f} KiB gzip",
                   "p99 < 5 ms", r["scrape_p99"] < 0.005))  # fmt: skip
    out.append(Row("/metrics 8 GPUs x 50 containers, a real agent's page: series, raw",
                   f"{r['series']:,}, {r['raw_bytes'] / 1000:,.0f} KB",
                   "<= 2,500, <= 500 KB",
                   r["series"] <= 2500 and r["raw_bytes"] <= 500_000))  # fmt: skip
    out.append(Row("Allocate p99 at 8 GPUs x 50 containers: alone / during back-to-back scrapes",
                   f"{ms(r['allocate_p99'], 3)} / {ms(r['allocate_scraped_p99'], 3)}", "",
                   None))  # fmt: skip
    out.append(Row("RSS of that agent after the scrapes (peak)",
                   f"{r['rss']:.1f} MiB ({r['hwm']:.1f})", "<= 75 MiB",
                   r["rss"] <= 75))  # fmt: skip
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--poll-cycles", type=int, default=200,
                        help="polls of 8 GPUs timed for the poll cost")  # fmt: skip
    parser.add_argument("--cri-window", type=float, default=30.0,
                        help="seconds at rest counting CRI calls")  # fmt: skip
    parser.add_argument("--accounting-scrapes", type=int, default=2000,
                        help="scrapes at 8 GPUs x 50 containers")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    add_arguments(parser)
    args = parser.parse_args()
    print(table(rows(kubelet_stubs(), args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
