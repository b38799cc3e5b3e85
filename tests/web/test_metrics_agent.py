"""The agent's own families on /metrics (pod resources, scrapes, NVML calls, Kubernetes requests,
MPS): aggregated unless detailed, few enough series for a fleet; and the whole exposition with
them passes promtool, each series once.
"""

from __future__ import annotations

from dataclasses import replace
from types import MappingProxyType

import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.metricstext import assert_unique_series, families, renderer, samples
from support.promtool import check_metrics
from support.synthetic import full_telemetry, synthetic_snapshot

from gpuagent.domain.devices import (
    Attribution,
    Condition,
    GpuHealth,
    Registration,
)
from gpuagent.domain.dra import DraGpus, DraPlan
from gpuagent.domain.mps import MpsState, MpsStatus
from gpuagent.state.counters import (
    AgentCounters,
    ApiReach,
    CriStats,
    DraCounters,
    KubeCounters,
    LogLinkStats,
    NvmlCallStats,
    PodResourcesStats,
)
from gpuagent.web.agentfamilies import dra_state_families
from gpuagent.web.exposition import render


def test_pod_resources_families() -> None:
    snapshot = synthetic_snapshot(1, replicas=2, refreshed_at=100.0)
    stats = PodResourcesStats(requests=7, errors=2, socket_present=True)
    text = renderer(detailed=True).render(snapshot, AgentCounters(pod_resources=stats))
    values = {name: samples(text, name)[0][1] for name in (
        "gpuagent_pod_resources_up", "gpuagent_pod_resources_socket_present",
        "gpuagent_pod_resources_requests_total", "gpuagent_pod_resources_errors_total",
        "gpuagent_pod_resources_age_seconds",
        "gpuagent_pod_resources_last_success_timestamp_seconds",
        "gpuagent_pod_resources_devices",
    )}  # fmt: skip
    assert values == {
        "gpuagent_pod_resources_up": 1,
        "gpuagent_pod_resources_socket_present": 1,
        "gpuagent_pod_resources_requests_total": 7,
        "gpuagent_pod_resources_errors_total": 2,
        "gpuagent_pod_resources_age_seconds": 30.0,
        "gpuagent_pod_resources_last_success_timestamp_seconds": 1e9 - 30.0,
        "gpuagent_pod_resources_devices": 2,
    }
    # By default the state and the failures, not the activity.
    text = renderer().render(snapshot, AgentCounters(pod_resources=stats))
    assert {f for f in families(text) if f.startswith("gpuagent_pod_resources")} == {
        "gpuagent_pod_resources_up", "gpuagent_pod_resources_socket_present",
        "gpuagent_pod_resources_errors", "gpuagent_pod_resources_age_seconds",
    }  # fmt: skip
    failing = replace(snapshot, pods=replace(snapshot.pods, error="socket absent"))
    text = renderer().render(failing, AgentCounters(pod_resources=stats))
    assert samples(text, "gpuagent_pod_resources_up")[0][1] == 0
    never = replace(snapshot, pods=Attribution(error="socket absent"))
    text = renderer().render(never, AgentCounters(pod_resources=stats))
    assert samples(text, "gpuagent_pod_resources_age_seconds") == []


def test_scrape_histogram_is_cumulative() -> None:
    r = renderer()
    for seconds in (0.0001, 0.003, 0.003, 2.0):
        r.scrapes.observe(seconds)
    text = r.render(synthetic_snapshot(1), AgentCounters())
    buckets = {s[0]["le"]: s[1] for s in samples(text, "gpuagent_scrape_duration_seconds_bucket")}
    assert buckets == {"0.01": 3, "0.25": 3, "+Inf": 4}
    assert samples(text, "gpuagent_scrape_duration_seconds_count")[0][1] == 4


NVML_CALLS = (
    NvmlCallStats("init", 1, 0.2, 0),
    NvmlCallStats("probe", 16, 0.04, 1),
    NvmlCallStats("nvmlDeviceGetTemperature", 16, 0.001, 0),
    NvmlCallStats("nvmlDeviceGetProcessesUtilizationInfo", 16, 0.002, 5),
)


def test_nvml_calls_are_aggregated_unless_detailed() -> None:
    counters = AgentCounters(nvml=NVML_CALLS)
    text = renderer().render(synthetic_snapshot(1), counters)
    # NVML functions that failed (the pieces of work are not calls); the poll's probe timed.
    made = samples(text, "gpuagent_nvml_calls_total")
    assert {s[0]["result"]: s[1] for s in made} == {"error": 5}
    assert samples(text, "gpuagent_nvml_call_duration_seconds_count") == [({"call": "probe"}, 16)]
    assert samples(text, "gpuagent_nvml_call_errors_total") == [({"call": "probe"}, 1)]
    detailed = renderer(detailed=True).render(synthetic_snapshot(1), counters)
    counts = samples(detailed, "gpuagent_nvml_call_duration_seconds_count")
    assert {s[0]["call"]: s[1] for s in counts} == {c.call: c.count for c in NVML_CALLS}
    errors = samples(detailed, "gpuagent_nvml_call_errors_total")
    assert {s[0]["call"]: s[1] for s in errors} == {c.call: c.errors for c in NVML_CALLS}
    made = samples(detailed, "gpuagent_nvml_calls_total")  # the successes too (activity)
    assert {s[0]["result"]: s[1] for s in made} == {"ok": 27, "error": 5}


def test_kube_requests_by_result_unless_detailed() -> None:
    kube = KubeCounters(requests=(
        ("event", "ok", 3), ("node", "ok", 1), ("node_condition", "ok", 2),
        ("node_condition", "throttled", 1),
    ))  # fmt: skip
    text = renderer().render(synthetic_snapshot(1), AgentCounters(kube=kube))
    requests = samples(text, "gpuagent_kube_requests_total")
    assert requests == [({"result": "ok"}, 6), ({"result": "throttled"}, 1)]
    assert samples(text, "gpuagent_kube_events_pending") == []
    detailed = renderer(detailed=True).render(synthetic_snapshot(1), AgentCounters(kube=kube))
    requests = samples(detailed, "gpuagent_kube_requests_total")
    assert [(s[0]["object"], s[0]["result"], s[1]) for s in requests] == list(kube.requests)
    assert samples(detailed, "gpuagent_kube_events_pending") == [({}, 0)]


def test_the_agents_own_series_fit_a_fleet() -> None:
    """A node's own series by default, every source reporting — the node condition and events,
    per-container accounting named by log links and the CRI, DRA — what an operator acts on, in
    at most 30 series, whatever the number of NVML functions or API objects."""
    snapshot = synthetic_snapshot(8)
    r = renderer()
    r.scrapes.observe(0.001)
    nvml = tuple(NvmlCallStats(f"nvmlCall{i}", 10, 0.01, i % 2) for i in range(120))
    objects = ("event", "node", "node_condition", "discovery")
    counters = AgentCounters(
        pod_resources=PodResourcesStats(3, 1, True),
        nvml=(*nvml, *NVML_CALLS),
        kube=KubeCounters(
            requests=tuple((obj, "ok", 1) for obj in objects), condition_written_at=1e9
        ),
        dra=DraCounters(devices=8),
        cri=CriStats(),
        log_links=LogLinkStats(),
        api=MappingProxyType({"resource_slices": ApiReach(up=True), "node_health": ApiReach()}),
    )
    pods = replace(snapshot.pods, refreshed_at=120.0)
    refreshed = replace(snapshot, pods=pods, dra_registration=Registration(registered=True))
    # The DRA side's state is rendered with the device part (of the snapshot alone).
    own = r.agent(refreshed, counters).decode() + render(dra_state_families(refreshed))
    for family in ("gpuagent_dra_api_up", "gpuagent_cri_errors_total",
                   "gpuagent_container_log_links_errors_total", "gpuagent_kube_backing_off",
                   "gpuagent_pod_resources_age_seconds"):  # fmt: skip
        assert f"\n{family} " in own  # every source is there
    series = [line for line in own.splitlines() if line and not line.startswith("#")]
    assert len(series) <= 30, "\n".join(series)
    detailed = renderer(detailed=True).agent(snapshot, counters).decode()
    assert len([line for line in detailed.splitlines() if not line.startswith("#")]) > 250


def test_mps_adds_two_series_per_shared_resource() -> None:
    """Whether each MPS daemon is up, and how often it was started: what an operator alerts on
    (a daemon down: its replicas are unhealthy; a daemon that keeps failing)."""
    snapshot = synthetic_snapshot(2)
    plain = renderer().devices(snapshot).text.decode()
    assert "gpuagent_mps_" not in plain
    state = MpsState().with_status("nvidia.com/gpu", MpsStatus(up=False, error="x", starts=3))
    shared = renderer().devices(replace(snapshot, mps=state, version=2)).text.decode()
    count = [line for line in shared.splitlines() if line and not line.startswith("#")]
    assert len(count) == len([ln for ln in plain.splitlines() if ln and ln[0] != "#"]) + 2
    assert 'gpuagent_mps_daemon_up{resource="nvidia.com/gpu"} 0\n' in shared
    assert 'gpuagent_mps_daemon_starts_total{resource="nvidia.com/gpu"} 3\n' in shared


def test_the_snapshots_own_families_are_rendered_once_per_version() -> None:
    """The MPS daemons' and the DRA side's state are of the snapshot alone: they are in the
    device part, cached per snapshot version, not worked out again on every scrape (finding the
    GPUs DRA has not published builds the node's DRA devices)."""
    snapshot = synthetic_snapshot(8)
    state = MpsState().with_status("nvidia.com/gpu", MpsStatus(up=True, starts=1))
    dra = replace(snapshot.plan, dra=DraPlan(gpus=DraGpus(all=True)))
    on = replace(snapshot, plan=dra, mps=state, dra_registration=Registration(registered=True))
    r = renderer()
    device = r.devices(on).text.decode()
    assert samples(device, "gpuagent_dra_unpublished_gpus") == [({}, 8)]
    assert samples(device, "gpuagent_dra_registered") == [({}, 1)]
    assert samples(device, "gpuagent_mps_daemon_up") == [({"resource": "nvidia.com/gpu"}, 1)]
    own = r.agent(on, AgentCounters(dra=DraCounters())).decode()
    assert "gpuagent_dra_api_up " in own
    assert "gpuagent_dra_unpublished_gpus" not in own
    assert "gpuagent_mps_" not in own
    published = frozenset(d.name for d in dra.dra.devices(on))
    later = r.devices(replace(on, dra_published=published, version=on.version + 1)).text
    assert samples(later.decode(), "gpuagent_dra_unpublished_gpus") == [({}, 0)]


def full_render(*, detailed: bool = False) -> str:
    snapshot = synthetic_snapshot(2, replicas=2)
    gpu = replace(
        snapshot.gpus[0],
        health=GpuHealth((Condition("xid", "79"), Condition("lost"))),
        xid_counts=MappingProxyType({79: 1}),
        last_xid=79,
        telemetry=full_telemetry(),
    )
    snapshot = replace(snapshot, gpus=(gpu, *snapshot.gpus[1:]))
    r = renderer(detailed=detailed)
    r.scrapes.observe(0.001)
    counters = AgentCounters(
        registrations=1,
        allocations=3,
        pod_resources=PodResourcesStats(3, 1, True),
        nvml=NVML_CALLS,
    )
    return r.render(snapshot, counters)


@pytest.mark.parametrize("detailed", [False, True])
def test_own_families_pass_promtool(detailed: bool) -> None:
    text = full_render(detailed=detailed)
    own = "".join(line + "\n" for line in text.splitlines() if "gpuagent_" in line)
    for family in ("gpuagent_device_allocated", "gpuagent_scrape_duration_seconds",
                   "gpuagent_nvml_call_duration_seconds", "gpuagent_pod_resources_age_seconds",
                   "gpuagent_gpu_condition", "gpuagent_build_info",
                   "gpuagent_nvml_calls_total"):  # fmt: skip
        assert f"# TYPE {family} " in own
    result = check_metrics(own)
    assert result.returncode == 0, result.stderr + result.stdout
    assert result.stderr.strip() == ""
    # The whole exposition parses for promtool too; only dcgm-exporter's own names are linted
    # (upper-case _TOTAL-less counters and the camelCase modelName label: reference §8.5).
    whole = check_metrics(text)
    assert whole.returncode in (0, 3), whole.stderr
    for line in whole.stderr.splitlines():
        assert line.startswith("DCGM_"), line


@pytest.mark.parametrize("detailed", [False, True])
def test_whole_exposition_parses_and_has_unique_series(detailed: bool) -> None:
    text = full_render(detailed=detailed)
    assert_unique_series(text)
    names = [f.name for f in text_string_to_metric_families(text)]
    assert len(names) == len(set(names))
