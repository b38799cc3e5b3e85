"""A real Prometheus server scrapes a running agent; dashboards' queries and the alert rules work.

Uses Debian's ``prometheus`` package (``/usr/bin/prometheus``), installed by ``.ci/run``. The test
is skipped only when the binary is missing and ``TESTS_REQUIRE_PROMTOOL`` is unset.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from support.cgroups import Layout, cgroup_file, write_proc
from support.fake_cri import FakeCri, RuntimeContainer
from support.fake_podresources import FakePodResources, Held
from support.grpcstubs import CriStubs, StubModules
from support.promtool import prometheus_tool

from e2e.agentprocess import free_port
from e2e.agentrun import running_agent

ROOT = Path(__file__).resolve().parents[2]
MONITORING = ROOT / "manifests" / "monitoring"
GPUS = 4
WAIT = 60.0

# The NVIDIA DCGM Exporter Dashboard (grafana.com 12239) as dcgm-exporter ships it.
NVIDIA_DASHBOARD = (
    ROOT.parent / "shared" / "reference" / "dcgm-exporter" / ("dcgm-exporter-dashboard.json")
)
# Its aggregating panels (one series for the node); every other panel has one series per GPU.
TOTALS = {"GPU Avg. Temp", "GPU Power Total"}


def nvidia_dashboard() -> tuple[dict[str, str], dict[str, str]]:
    """Every query of NVIDIA's dashboard by panel title: (per-GPU panels, totals)."""
    if not NVIDIA_DASHBOARD.exists():
        pytest.skip(
            f"the project's reference data is not beside the repository ({NVIDIA_DASHBOARD})"
        )
    dashboard = json.loads(NVIDIA_DASHBOARD.read_text(encoding="utf-8"))
    per_gpu: dict[str, str] = {}
    totals: dict[str, str] = {}
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            (totals if panel["title"] in TOTALS else per_gpu)[panel["title"]] = target["expr"]
    variables = {v["name"]: v.get("query") for v in dashboard["templating"]["list"]}
    assert variables["instance"] == "label_values(DCGM_FI_DEV_GPU_TEMP, instance)"
    assert variables["gpu"] == "label_values(DCGM_FI_DEV_GPU_TEMP, gpu)"
    assert len(per_gpu) == len(RANGES), per_gpu
    assert set(totals) == TOTALS, totals
    return per_gpu, totals


# Plausible ranges of each panel's values in its unit.
RANGES = {
    "GPU Temperature": (1, 150),
    "GPU Power Usage": (1, 2000),
    "GPU SM Clocks": (1e8, 5e9),
    "GPU Utilization": (0, 100),
    "GPU Framebuffer Mem Used": (0, 200_000),
    "Tensor Core Utilization": (0, 1),
}


@dataclass
class Prometheus:
    url: str
    log: Path


@pytest.fixture
def prometheus_factory(tmp_path: Path) -> Iterator[Any]:
    binary = prometheus_tool("prometheus")
    procs: list[subprocess.Popen[bytes]] = []

    def start(target: str) -> Prometheus:
        port = free_port()
        config = tmp_path / "prometheus.yml"
        config.write_text(
            yaml.safe_dump(
                {
                    "global": {
                        "scrape_interval": "500ms",
                        "scrape_timeout": "400ms",
                        "evaluation_interval": "500ms",
                    },
                    "rule_files": [str(MONITORING / "alerts.yaml")],
                    "scrape_configs": [
                        {"job_name": "gpuagent", "static_configs": [{"targets": [target]}]}
                    ],
                }
            )
        )
        log = tmp_path / "prometheus.log"
        with log.open("wb") as out:
            procs.append(
                subprocess.Popen(
                    [
                        binary,
                        f"--config.file={config}",
                        f"--storage.tsdb.path={tmp_path / 'data'}",
                        f"--web.listen-address=127.0.0.1:{port}",
                        "--log.level=warn",
                    ],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        return Prometheus(f"http://127.0.0.1:{port}", log)

    try:
        yield start
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)


async def api(http: aiohttp.ClientSession, prom: Prometheus, path: str, **params: str) -> Any:
    async with http.get(prom.url + path, params=params) as response:
        body = await response.json()
    assert body["status"] == "success", body
    return body["data"]


async def until(what: str, check: Any, prom: Prometheus) -> Any:
    deadline = time.monotonic() + WAIT
    last: object = None
    while time.monotonic() < deadline:
        try:
            last = await check()
        except (aiohttp.ClientError, AssertionError) as exc:
            last = exc
        else:
            if last:
                return last
        await asyncio.sleep(0.2)
    log = prom.log.read_text(errors="replace")[-3000:] if prom.log.exists() else ""
    raise AssertionError(f"{what}: never true; last {last!r}\nprometheus log:\n{log}")


def substitute(expr: str, instance: str, gpus: list[str]) -> str:
    return (
        expr.replace("$instance", instance)
        .replace("$gpu", "(" + "|".join(gpus) + ")")
        .replace("$__rate_interval", "5s")
        .replace("$__range", "1m")
    )


@pytest.fixture
def pod_resources(short_tmp_path: Path, grpc_stubs: StubModules) -> Iterator[FakePodResources]:
    with FakePodResources(short_tmp_path / "pr" / "kubelet.sock", grpc_stubs) as fake:
        fake.set([
            Held("ml", "train-0", "main", "nvidia.com/gpu", ("0",)),
            # GPU 3 time-sliced between two notebooks (replica IDs of the index strategy).
            Held("ds", "nb-0", "lab", "nvidia.com/gpu", ("3::0",)),
            Held("ds", "nb-1", "lab", "nvidia.com/gpu", ("3::1",)),
        ])  # fmt: skip
        yield fake


# Processes on the simulated GPUs (per-container panels): train-0 on the GPU it holds, a miner on
# one nobody was allocated. Their cgroup files and the runtime's names, as on a containerd node.
TRAINER = RuntimeContainer(
    "a" * 64, "ml", "train-0", "main", pod_uid="11111111-2222-4333-8444-555555555555"
)
MINER = RuntimeContainer(
    "b" * 64, "sneaky", "miner", "main", pod_uid="66666666-7777-4888-8999-000000000000"
)


@pytest.fixture
def runtime(short_tmp_path: Path, cri_stubs: CriStubs) -> Iterator[FakeCri]:
    with FakeCri(short_tmp_path / "cri" / "containerd.sock", cri_stubs) as fake:
        fake.set([TRAINER, MINER])
        yield fake


@pytest.mark.asyncio(loop_factories=["uvloop"])
@pytest.mark.slow
async def test_prometheus_scrapes_and_dashboards_see_every_gpu(
    device_plugin_dir: Path,
    pod_resources: FakePodResources,
    runtime: FakeCri,
    prometheus_factory: Any,
    tmp_path: Path,
) -> None:
    layout = Layout("containerd", "systemd", 2)
    proc = write_proc(
        tmp_path / "proc",
        {pid: cgroup_file(layout, c.pod_uid, c.id) for pid, c in ((100, TRAINER), (200, MINER))},
    )
    args = ("--simulate", str(GPUS), "--device-id-strategy", "index",
            "--pod-resources-socket", str(pod_resources.socket_path),
            "--cri-socket", str(runtime.socket_path), "--proc-root", str(proc))  # fmt: skip
    async with running_agent(device_plugin_dir, args) as run, aiohttp.ClientSession() as http:
        target = f"127.0.0.1:{run.port}"
        status, _ = await run.fault({"gpu": 1, "fault": "xid", "xid": 79})
        assert status == 200
        for body in ({"gpu": 0, "pid": 100, "memory_mib": 8000, "sm_util": 40},
                     {"gpu": 2, "pid": 200, "memory_mib": 2000, "sm_util": 90}):  # fmt: skip
            async with http.post(run.base_url + "/sim/processes", json=body) as response:
                assert response.status == 200
        prom = prometheus_factory(target)

        async def ready() -> bool:
            async with http.get(prom.url + "/-/ready") as response:
                return response.status == 200

        await until("prometheus ready", ready, prom)

        async def scraped() -> bool:
            data = await api(http, prom, "/api/v1/query", query=f'up{{instance="{target}"}}')
            return bool(data["result"]) and data["result"][0]["value"][1] == "1"

        await until("target up", scraped, prom)

        # The dashboard's variables.
        async def instances() -> list[str]:
            found = await api(http, prom, "/api/v1/label/instance/values",
                              **{"match[]": "DCGM_FI_DEV_GPU_TEMP"})  # fmt: skip
            return list(found)

        assert await until("instance variable", instances, prom) == [target]
        gpus = await api(http, prom, "/api/v1/label/gpu/values",
                         **{"match[]": "DCGM_FI_DEV_GPU_TEMP"})  # fmt: skip
        assert sorted(gpus) == [str(i) for i in range(GPUS)]

        # Dashboard 12239, every query: one series per simulated GPU, in the panel's unit.
        dashboard_12239, dashboard_12239_totals = nvidia_dashboard()
        for title, expr in dashboard_12239.items():
            query = substitute(expr, target, gpus)

            async def per_gpu(query: str = query) -> list[Any]:
                data = await api(http, prom, "/api/v1/query", query=query)
                result: list[Any] = data["result"]
                return result if len(result) == GPUS else []

            result = await until(title, per_gpu, prom)
            assert sorted(r["metric"]["gpu"] for r in result) == sorted(gpus), title
            low, high = RANGES[title]
            for r in result:
                assert low <= float(r["value"][1]) <= high, (title, r)
        for title, expr in dashboard_12239_totals.items():
            data = await api(http, prom, "/api/v1/query", query=substitute(expr, target, gpus))
            assert len(data["result"]) == 1, title
        # Pod attribution reached Prometheus: GPU 0's series carry the pod that holds it.
        data = await api(http, prom, "/api/v1/query",
                         query='DCGM_FI_DEV_GPU_TEMP{pod!=""}')  # fmt: skip
        assert [(r["metric"]["gpu"], r["metric"]["pod"]) for r in data["result"]] == [
            ("0", "train-0")
        ]

        # GPU 3, shared by two pods, is one series per family (no pod's labels: the dashboards'
        # per-GPU queries above saw one series per GPU); who shares it is said per container.
        data = await api(http, prom, "/api/v1/query", query='DCGM_FI_DEV_GPU_TEMP{gpu="3"}')
        assert [r["metric"].get("pod", "") for r in data["result"]] == [""]
        data = await api(http, prom, "/api/v1/query",
                         query='gpuagent_device_allocated{gpu="3"}')  # fmt: skip
        assert sorted(r["metric"]["pod"] for r in data["result"]) == ["nb-0", "nb-1"]

        # The per-container families name the GPU by its index; the rest of its identity joins
        # from the info metric, as docs/metrics.md shows ("Joining a GPU's identity").
        joined = (
            "gpuagent_container_gpu_memory_used_bytes"
            " * on (instance, gpu) group_left (uuid, model_name) gpuagent_gpu_info"
        )

        async def memory_with_identity() -> list[Any]:
            data = await api(http, prom, "/api/v1/query", query=joined)
            result: list[Any] = data["result"]
            return (
                result if {r["metric"].get("pod") for r in result} >= {"train-0", "miner"} else []
            )

        result = await until("per-container join", memory_with_identity, prom)
        found = {r["metric"]["pod"]: r for r in result if r["metric"]["pod"]}
        for pod, gpu, mib in (("train-0", 0, 8000), ("miner", 2, 2000)):
            metric = found[pod]["metric"]
            assert (metric["gpu"], metric["uuid"]) == (str(gpu), run.uuids[gpu]), metric
            assert metric["model_name"], metric
            assert "UUID" not in metric, metric
            assert float(found[pod]["value"][1]) == mib * 1024 * 1024
        data = await api(http, prom, "/api/v1/query",
                         query=f"sum by (model_name, namespace) ({joined})")  # fmt: skip
        assert {r["metric"]["namespace"] for r in data["result"]} >= {"ml", "sneaky"}

        # Our dashboard: every panel's every query returns data.
        dashboard = json.loads((MONITORING / "dashboard.json").read_text())
        for panel in dashboard["panels"]:
            for target_def in panel.get("targets", []):
                query = substitute(target_def["expr"], target, gpus)

                async def has_data(query: str = query) -> bool:
                    data = await api(http, prom, "/api/v1/query", query=query)
                    return bool(data["result"])

                await until(f"dashboard panel {panel['title']!r}: {query}", has_data, prom)

        # The alert rules load and evaluate without errors; the unhealthy GPU is pending/firing.
        async def rules_evaluated() -> list[Any]:
            data = await api(http, prom, "/api/v1/rules")
            rules = [rule for group in data["groups"] for rule in group["rules"]]
            done = all(r["lastEvaluation"] > "2000" for r in rules)
            return rules if rules and done else []

        rules = await until("rules evaluated", rules_evaluated, prom)
        assert {r["health"] for r in rules} == {"ok"}, [r for r in rules if r["health"] != "ok"]

        async def unhealthy_alert() -> list[Any]:
            data = await api(http, prom, "/api/v1/alerts")
            return [a for a in data["alerts"] if a["labels"]["alertname"] == "GPUUnhealthy"]

        alerts = await until("GPUUnhealthy pending", unhealthy_alert, prom)
        assert [a["labels"]["gpu"] for a in alerts] == ["1"]  # one alert for the GPU
        assert "xid 79" in alerts[0]["annotations"]["description"]
