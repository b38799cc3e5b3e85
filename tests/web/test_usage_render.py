"""The per-container families on /metrics, rendered from a snapshot's usage."""

from __future__ import annotations

from dataclasses import replace

from prometheus_client.parser import text_string_to_metric_families
from support.promtool import check_metrics, prometheus_tool
from support.synthetic import full_telemetry, gpu_uuid, pods_by_device, synthetic_snapshot

from gpuagent.domain.devices import PodRef
from gpuagent.domain.snapshot import Snapshot
from gpuagent.domain.usage import ContainerUsage, ProcessReading, Usage
from gpuagent.state.counters import AgentCounters, CriStats
from gpuagent.web.metrics import MetricsRenderer

GIB = 2**30
A = PodRef("ml", "trainer", "main")
B = PodRef("ds", 'note"book', "jupyter")
FAMILIES = (
    "gpuagent_container_gpu_memory_used_bytes",
    "gpuagent_container_gpu_sm_utilization_ratio",
    "gpuagent_container_gpu_energy_joules_total",
    "gpuagent_container_gpu_processes",
    "gpuagent_gpu_unallocated_use",
)


def use(ref: PodRef, **kw: object) -> ContainerUsage:
    values: dict[str, object] = {
        "gpu": 0,
        "gpu_instance": None,
        "namespace": ref.namespace,
        "pod": ref.pod,
        "container": ref.container,
        "processes": 1,
        "memory_bytes": GIB,
        "sm_ratio": 0.25,
        "mem_ratio": 0.1,
        "enc_ratio": 0.0,
        "dec_ratio": 0.0,
        "energy_joules": 10.0,
        "allocated": True,
    } | kw
    return ContainerUsage(**values)  # type: ignore[arg-type]


def node(*usages: ContainerUsage, judged: bool = True, mig: bool = False) -> Snapshot:
    snap = synthetic_snapshot(2, mig=mig)
    held = {f"{gpu_uuid(0)}::0": (A,), f"{gpu_uuid(0)}::1": (B,)}
    gpus = tuple(
        replace(g, processes=ProcessReading(samples=()), telemetry=full_telemetry(g.index))
        for g in snap.gpus
    )
    return replace(
        snap,
        gpus=gpus,
        pods=pods_by_device(held if not mig else {}),
        usage=Usage(containers=usages, judged=judged),
    )


def samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    return [
        (dict(s.labels), float(s.value))
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == name
    ]


def render(snapshot: Snapshot, **kw: object) -> str:
    return MetricsRenderer("node-1", "1.0", **kw).render(snapshot, AgentCounters())  # type: ignore[arg-type]


def test_families_and_labels() -> None:
    text = render(node(use(A), use(B, memory_bytes=3 * GIB, sm_ratio=0.5, processes=2)))
    memory = samples(text, "gpuagent_container_gpu_memory_used_bytes")
    assert [(lbl["pod"], v) for lbl, v in memory] == [("trainer", GIB), ('note"book', 3 * GIB)]
    # The GPU by its index alone: its identity is on gpuagent_gpu_info, once.
    labels = memory[0][0]
    assert list(labels) == ["gpu", "container", "namespace", "pod"]
    assert labels["gpu"] == "0"
    assert 'pod="note\\"book"' in text
    sm = {lbl["pod"]: v for lbl, v in samples(text, "gpuagent_container_gpu_sm_utilization_ratio")}
    assert sm == {"trainer": 0.25, 'note"book': 0.5}
    energy = samples(text, "gpuagent_container_gpu_energy_joules_total")
    assert {v for _, v in energy} == {10.0}
    procs = samples(text, "gpuagent_container_gpu_processes")
    assert [v for _, v in procs] == [1, 2]
    # Both GPUs were read and nobody runs unallocated: one 0 per GPU with empty pod labels.
    unallocated = samples(text, "gpuagent_gpu_unallocated_use")
    assert [(lbl["gpu"], lbl["pod"], v) for lbl, v in unallocated] == [("0", "", 0), ("1", "", 0)]


def test_absent_readings_leave_series_out() -> None:
    text = render(node(use(A, sm_ratio=None, energy_joules=None, memory_bytes=None)))
    assert samples(text, "gpuagent_container_gpu_sm_utilization_ratio") == []
    assert samples(text, "gpuagent_container_gpu_energy_joules_total") == []
    assert samples(text, "gpuagent_container_gpu_memory_used_bytes") == []
    assert len(samples(text, "gpuagent_container_gpu_processes")) == 1


def test_unallocated_use_names_the_container() -> None:
    miner = PodRef("sneaky", "miner", "main")
    text = render(node(use(A), use(miner, gpu=1, allocated=False)))
    unallocated = {
        (lbl["gpu"], lbl["pod"]): v for lbl, v in samples(text, "gpuagent_gpu_unallocated_use")
    }
    assert unallocated == {("0", ""): 0, ("1", "miner"): 1}


def test_no_unallocated_family_before_allocations_are_known() -> None:
    text = render(node(use(A, allocated=False), judged=False))
    assert "gpuagent_gpu_unallocated_use" not in text


def test_mig_series_carry_the_gpu_instance() -> None:
    snap = node(mig=True)
    gi = snap.gpus[0].mig_devices[2].gpu_instance_id
    text = render(replace(snap, usage=Usage((use(A, gpu_instance=gi, sm_ratio=None),), True)))
    ((labels, value),) = samples(text, "gpuagent_container_gpu_memory_used_bytes")
    assert (labels["GPU_I_ID"], value) == (str(gi), GIB)
    assert list(labels) == ["gpu", "GPU_I_ID", "container", "namespace", "pod"]
    assert len(samples(text, "gpuagent_gpu_unallocated_use")) == 2 * 7


def test_dcgm_series_carry_each_containers_share_only_when_asked() -> None:
    snap = node(use(A, sm_ratio=0.2, memory_bytes=2 * GIB), use(B, sm_ratio=None))
    gpu_util = full_telemetry(0).gpu_util_pct
    whole = render(snap)
    util = {lbl["pod"]: v for lbl, v in samples(whole, "DCGM_FI_DEV_GPU_UTIL") if lbl["gpu"] == "0"}
    assert util == {"": gpu_util}  # shared: one series, the GPU's
    copies = samples(render(snap, series_per_container=True), "DCGM_FI_DEV_GPU_UTIL")
    util = {lbl["pod"]: v for lbl, v in copies if lbl["gpu"] == "0"}
    assert util == {"trainer": gpu_util, 'note"book': gpu_util}
    split = render(snap, container_shares=True)
    util = {lbl["pod"]: v for lbl, v in samples(split, "DCGM_FI_DEV_GPU_UTIL") if lbl["gpu"] == "0"}
    # B has no share reading: it keeps the GPU's value.
    assert util == {"trainer": 20, 'note"book': gpu_util}
    fb = {lbl["pod"]: v for lbl, v in samples(split, "DCGM_FI_DEV_FB_USED") if lbl["gpu"] == "0"}
    assert fb["trainer"] == 2048
    temp = {v for lbl, v in samples(split, "DCGM_FI_DEV_GPU_TEMP") if lbl["gpu"] == "0"}
    assert temp == {full_telemetry(0).temperature_c}
    # The unattributed GPU 1 is unchanged.
    assert [v for lbl, v in samples(split, "DCGM_FI_DEV_GPU_UTIL") if lbl["gpu"] == "1"] == [
        full_telemetry(1).gpu_util_pct
    ]


def test_cri_counters() -> None:
    counters = AgentCounters(cri=CriStats(3, 1, 42))
    text = MetricsRenderer("n", "1", detailed=True).render(node(), counters)
    assert samples(text, "gpuagent_cri_requests_total") == [({}, 3)]
    assert samples(text, "gpuagent_cri_errors_total") == [({}, 1)]
    assert samples(text, "gpuagent_cri_containers") == [({}, 42)]
    # By default the failures alone.
    text = MetricsRenderer("n", "1").render(node(), counters)
    assert [f.name for f in text_string_to_metric_families(text) if "cri" in f.name] == [
        "gpuagent_cri_errors"
    ]


def test_container_families_pass_promtool() -> None:
    prometheus_tool("promtool")
    miner = PodRef("sneaky", "miner", "main")
    text = MetricsRenderer("n", "1", detailed=True).render(
        node(use(A), use(miner, gpu=1, allocated=False)), AgentCounters(cri=CriStats(1, 0, 1))
    )
    own = "".join(
        line + "\n"
        for line in text.splitlines()
        if "gpuagent_container_" in line
        or "gpuagent_gpu_unallocated" in line
        or "gpuagent_cri_" in line
    )
    for family in FAMILIES:
        assert f"# TYPE {family} " in own
    result = check_metrics(own)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (result.stdout + result.stderr).strip() == ""
