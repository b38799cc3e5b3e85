"""docs/metrics.md cannot drift from what /metrics emits, the options, or the HTTP limits."""

from __future__ import annotations

import re
from dataclasses import replace
from types import MappingProxyType

from support.metricsdoc import DOC, label_drift, table_rows
from support.synthetic import synthetic_snapshot

from gpuagent.config import OPTIONS
from gpuagent.domain.devices import (
    Allocated,
    Condition,
    GpuHealth,
    Registration,
    claimed_resource,
)
from gpuagent.domain.dra import DraPlan
from gpuagent.domain.drashare import ClaimShare, DraSharing, Share
from gpuagent.domain.mps import MpsState, MpsStatus
from gpuagent.domain.usage import ContainerUsage, ProcessReading, Usage
from gpuagent.state.counters import (
    AgentCounters,
    CriStats,
    DraCounters,
    KubeCounters,
    LogLinkStats,
    NvmlCallStats,
    PodResourcesStats,
)
from gpuagent.web.dcgm import DCGM_METRICS
from gpuagent.web.metrics import MetricsRenderer
from gpuagent.web.server import MAX_BODY, HttpLimits

NOT_EXPORTED = {"DCGM_FI_DRIVER_VERSION", "DCGM_FI_DEV_VGPU_LICENSE_STATUS"}


def families() -> set[str]:
    return set(re.findall(r"^# TYPE (\S+) ", rendered(), re.MULTILINE))


def rendered() -> str:
    """/metrics as the renderer writes it for snapshots that hold every family and label (the
    agent's own families in full: --detailed-agent-metrics)."""
    snapshot = synthetic_snapshot(2, replicas=1)
    gpu = replace(
        snapshot.gpus[0],
        health=GpuHealth((Condition("lost"),)),
        xid_counts=MappingProxyType({79: 1}),
        last_xid=79,
        processes=ProcessReading(samples=()),
    )
    used = ContainerUsage(0, None, "ns", "pod", "c", 1, 2**30, 0.5, 0.1, 0, 0, 12.5, True)
    mps = MpsState().with_status("nvidia.com/gpu", MpsStatus(up=True, error="", starts=1))
    # A claim with a share of GPU 0 (--dra-sharing mps), held by the container using it.
    share = ClaimShare("gpu.nvidia.com", "ns", "claim", "u", "gpu-0", gpu.uuid, Share(1024, 25))
    holder = Allocated("ns", "pod", "c", claimed_resource(share.driver), ("gpu-0",), "ns/claim")
    pods = replace(snapshot.pods, allocated=(*snapshot.pods.allocated, holder))
    snapshot = replace(
        snapshot,
        gpus=(gpu, snapshot.gpus[1]),
        usage=Usage(containers=(used,), judged=True),
        mps=mps,
        shares=(share,),
        pods=pods,
        plan=replace(snapshot.plan, dra=DraPlan(sharing=DraSharing.MPS)),
        dra_registration=Registration(),  # DRA is on
    )
    counters = AgentCounters(
        pod_resources=PodResourcesStats(1, 0, True),
        nvml=(NvmlCallStats("x", 1, 0.1, 0),),
        dra=DraCounters(),
        cri=CriStats(1, 0, 1),
        log_links=LogLinkStats(1, 0, 1),
        kube=KubeCounters(requests=(("node_condition", "ok", 1),), condition_written_at=1e9),
    )
    text = MetricsRenderer("n", "1", detailed=True).render(snapshot, counters)
    mig = synthetic_snapshot(1, mig=True)
    (mig_gpu,) = mig.gpus
    first, *rest = mig_gpu.mig_devices
    sick = replace(first, health=GpuHealth((Condition("xid", "13"),)))  # a MIG device's own
    on_instance = replace(used, gpu_instance=first.gpu_instance_id)
    mig = replace(
        mig,
        gpus=(replace(mig_gpu, mig_devices=(sick, *rest), processes=ProcessReading(samples=())),),
        usage=Usage(containers=(on_instance,), judged=True),
    )
    return text + MetricsRenderer("n", "1", detailed=True).render(mig, counters)


def test_every_family_is_documented_and_every_documented_family_exists() -> None:
    emitted = families()
    documented = set(table_rows())
    assert emitted - documented == set(), "undocumented"
    assert documented - emitted == set(), "documented but not emitted"
    named = set(re.findall(r"\b((?:DCGM_FI|gpuagent)_[A-Za-z0-9_]*[A-Za-z0-9])", DOC.read_text()))
    assert named - emitted - NOT_EXPORTED == set()


def test_every_familys_labels_are_documented_and_every_documented_label_is_emitted() -> None:
    assert label_drift(rendered(), complete=True) == []


def test_dcgm_rows_match_the_renderer() -> None:
    rows = table_rows()
    for metric in DCGM_METRICS:
        name, kind, _unit, _field, scope, help_text = rows[metric.name]
        assert kind == metric.kind, name
        assert help_text == metric.help, name
        assert scope == ("instance" if metric.scope == "instance" else "GPU"), name


def test_options_table_names_real_options() -> None:
    text = DOC.read_text(encoding="utf-8")
    section = text.split("## Options", 1)[1].split("\n## ", 1)[0]
    flags = {f"--{o.name}": o for o in OPTIONS}
    for flag, env, key in re.findall(r"^\| `(--[a-z-]+)[^`]*` \| `(\w+)` \| `([a-z-]+)` \|",
                                     section, re.MULTILINE):  # fmt: skip
        option = flags[flag]
        assert env in option.env_names
        assert key == option.name
        assert option.in_file


def test_limits_table_matches_the_server() -> None:
    text = DOC.read_text(encoding="utf-8")
    limits = HttpLimits()
    for expected in (
        f"| connections | {limits.max_connections} |",
        f"| concurrent `/metrics` responses | {limits.max_concurrent_scrapes} |",
        f"| request line / header field | {limits.max_line_size} bytes |",
        f"| header fields | {limits.max_headers} |",
        f"| request body | {MAX_BODY // 1024} KiB |",
        f"unfinished request headers | {limits.keepalive_timeout:g} s |",
        f"| TLS handshake | {limits.tls_handshake_timeout:g} s |",
        f"| writing one `/metrics` response | {limits.write_timeout:g} s |",
    ):
        assert expected in text, expected
