"""The /metrics renderer's GPU families and labels, checked with prometheus_client's parser as
the oracle: dcgm-exporter's families, names and label order, shared and MIG GPUs, hostile label
values and the values' text.
"""

from __future__ import annotations

import math
import re
from dataclasses import replace
from types import MappingProxyType

import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.metricstext import (
    DCGM_LABELS,
    MIG_LABELS,
    assert_unique_series,
    families,
    label_order,
    renderer,
    samples,
)
from support.synthetic import gpu_uuid, mig_uuid, pods_by_device, synthetic_snapshot

from gpuagent.domain.devices import (
    Condition,
    GpuHealth,
    PodRef,
    Telemetry,
)
from gpuagent.state.counters import (
    AgentCounters,
    NvmlCallStats,
)
from gpuagent.web.dcgm import DCGM_FAMILIES, DCGM_METRICS, xid_message
from gpuagent.web.exposition import escape_label, format_value
from gpuagent.web.metrics import MetricsRenderer


def test_every_dcgm_family_with_its_type_help_and_value() -> None:
    snapshot = synthetic_snapshot(2)
    text = renderer(detailed=True).render(snapshot, AgentCounters())
    parsed = families(text)
    telemetry = snapshot.gpus[1].telemetry
    for metric in DCGM_METRICS:
        family = parsed[metric.name]
        assert family.type == metric.kind  # type: ignore[attr-defined]
        assert family.documentation == metric.help  # type: ignore[attr-defined]
        by_gpu = {s.labels["gpu"]: s.value for s in family.samples}  # type: ignore[attr-defined]
        assert by_gpu["1"] == metric.read(telemetry)
    assert_unique_series(text)


def test_by_default_only_the_dcgm_families_a_shipped_list_or_rule_uses() -> None:
    """DCGM_FI_PROF_SM_ACTIVE and _SM_OCCUPANCY (off in dcgm-exporter's default and DCP lists,
    read by no shipped dashboard or rule) only with --detailed-agent-metrics: 16 series fewer on
    a plain 8-GPU page."""
    snapshot = synthetic_snapshot(2)
    default = set(families(renderer().render(snapshot, AgentCounters())))
    detailed = set(families(renderer(detailed=True).render(snapshot, AgentCounters())))
    extras = {"DCGM_FI_PROF_SM_ACTIVE", "DCGM_FI_PROF_SM_OCCUPANCY"}
    assert {f for f in detailed - default if f.startswith("DCGM_")} == extras
    assert {m.name for m in DCGM_METRICS if m.detailed} == extras
    assert {m.name for m in renderer().dcgm_families} == {m.name for m in DCGM_FAMILIES} - extras


def test_the_dcgm_families_come_in_the_tables_order() -> None:
    """DCGM_FAMILIES is the device part's order, the XID family (read from the GPU, not its
    telemetry) included: right after the decoder's, where dcgm-exporter's default list has it."""
    names = [f.name for f in DCGM_FAMILIES]
    assert names.index("DCGM_FI_DEV_XID_ERRORS") == names.index("DCGM_FI_DEV_DEC_UTIL") + 1
    text = renderer(detailed=True).render(synthetic_snapshot(2), AgentCounters())
    written = re.findall(r"^# TYPE (DCGM_\w+) ", text, re.MULTILINE)
    assert written == names


def test_dcgm_names_help_and_types_match_dcgm_exporter() -> None:
    expected = {
        "DCGM_FI_DEV_SM_CLOCK": ("gauge", "SM clock frequency (in MHz)."),
        "DCGM_FI_DEV_GPU_TEMP": ("gauge", "GPU temperature (in C)."),
        "DCGM_FI_DEV_POWER_USAGE": ("gauge", "Power draw (in W)."),
        "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": (
            "counter", "Total energy consumption since boot (in mJ)."),
        "DCGM_FI_DEV_PCIE_REPLAY_COUNTER": ("counter", "Total number of PCIe retries."),
        "DCGM_FI_DEV_GPU_UTIL": ("gauge", "GPU utilization (in %)."),
        "DCGM_FI_DEV_FB_USED": ("gauge", "Framebuffer memory used (in MiB)."),
        "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL": (
            "counter", "Total number of NVLink bandwidth counters for all lanes."),
        "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS": (
            "counter", "Number of remapped rows for uncorrectable errors"),
        "DCGM_FI_DEV_ROW_REMAP_FAILURE": ("gauge", "Whether remapping of rows has failed"),
        "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE": (
            "gauge", "Ratio of cycles the tensor (HMMA) pipe is active."),
        "DCGM_FI_PROF_DRAM_ACTIVE": ("gauge", "Ratio of cycles the device memory interface is "
                                              "active sending or receiving data."),
    }  # fmt: skip
    text = renderer().render(synthetic_snapshot(1), AgentCounters())
    for name, (kind, help_text) in expected.items():
        assert f"# HELP {name} {help_text}\n# TYPE {name} {kind}\n" in text


def test_labels_in_dcgm_exporter_order_with_empty_pod_labels() -> None:
    text = renderer().render(synthetic_snapshot(2), AgentCounters())
    assert label_order(text, "DCGM_FI_DEV_GPU_TEMP") == [DCGM_LABELS, DCGM_LABELS]
    labels, _ = samples(text, "DCGM_FI_DEV_GPU_TEMP")[0]
    assert labels == {
        "gpu": "0", "UUID": gpu_uuid(0), "pci_bus_id": "00000000:18:00.0", "device": "nvidia0",
        "modelName": "NVIDIA H100 80GB HBM3", "Hostname": "node-1",
        "DCGM_FI_DRIVER_VERSION": "580.95.05", "container": "", "namespace": "", "pod": "",
    }  # fmt: skip


def test_gpu_info_device_joins_the_dcgm_series_when_minor_and_index_differ() -> None:
    snapshot = synthetic_snapshot(2)
    snapshot = replace(snapshot, gpus=tuple(replace(g, minor=7 - g.index) for g in snapshot.gpus))
    text = renderer().render(snapshot, AgentCounters())
    dcgm = {labels["UUID"]: labels["device"] for labels, _ in samples(text, "DCGM_FI_DEV_GPU_TEMP")}
    info = {labels["uuid"]: labels for labels, _ in samples(text, "gpuagent_gpu_info")}
    assert {uuid: labels["device"] for uuid, labels in info.items()} == dcgm
    assert info[gpu_uuid(0)]["device_node"] == "/dev/nvidia7"
    assert info[gpu_uuid(1)]["device_node"] == "/dev/nvidia6"


@pytest.mark.parametrize(
    ("label", "expected"),
    [
        pytest.param("Hostname", "Hostname", id="before-4.5"),
        pytest.param("hostname", "hostname", id="after-4.5"),
        pytest.param(None, None, id="no-hostname"),
    ],
)
def test_hostname_label_spelling(label: str | None, expected: str | None) -> None:
    text = renderer(hostname_label=label).render(synthetic_snapshot(1), AgentCounters())
    (order,) = label_order(text, "DCGM_FI_DEV_GPU_TEMP")
    want = [x for x in DCGM_LABELS if x != "Hostname"]
    if expected is not None:
        want.insert(5, expected)
    assert order == want


def test_absent_readings_are_absent_not_zero() -> None:
    snapshot = synthetic_snapshot(2)
    gpu0 = replace(snapshot.gpus[0], telemetry=Telemetry(temperature_c=40.0))
    snapshot = replace(snapshot, gpus=(gpu0, snapshot.gpus[1]))
    text = renderer().render(snapshot, AgentCounters())
    assert {s[0]["gpu"] for s in samples(text, "DCGM_FI_DEV_GPU_TEMP")} == {"0", "1"}
    assert {s[0]["gpu"] for s in samples(text, "DCGM_FI_DEV_POWER_USAGE")} == {"1"}


def test_no_family_without_samples() -> None:
    snapshot = replace(
        synthetic_snapshot(0), driver=replace(synthetic_snapshot(0).driver, up=False)
    )
    text = renderer().render(snapshot, AgentCounters())
    assert "DCGM_" not in text
    assert "gpuagent_gpus 0\n" in text


def test_xid_last_value_with_code_and_message() -> None:
    snapshot = synthetic_snapshot(2)
    gpu1 = replace(snapshot.gpus[1], last_xid=79, xid_counts=MappingProxyType({13: 2, 79: 1}))
    snapshot = replace(snapshot, gpus=(snapshot.gpus[0], gpu1))
    text = renderer().render(snapshot, AgentCounters())
    last = {s[0]["gpu"]: s for s in samples(text, "DCGM_FI_DEV_XID_ERRORS")}
    assert last["0"][1] == 0
    assert (last["0"][0]["err_code"], last["0"][0]["err_msg"]) == ("0", "No Error")
    assert last["1"][1] == 79
    assert (last["1"][0]["err_code"], last["1"][0]["err_msg"]) == (
        "79", "GPU has fallen off the bus")  # fmt: skip
    assert label_order(text, "DCGM_FI_DEV_XID_ERRORS")[1][-2:] == ["err_code", "err_msg"]
    counts = {(s[0]["gpu"], s[0]["xid"]): s[1] for s in samples(text, "gpuagent_xid_errors_total")}
    assert counts == {("1", "13"): 2, ("1", "79"): 1}
    assert xid_message(99999) == "Unknown Error"


def test_a_shared_gpu_has_one_series_with_empty_pod_labels() -> None:
    snapshot = synthetic_snapshot(2, replicas=3)
    held_alone = PodRef("solo", "train", "main")
    pods = snapshot.pods.allocated[:3] + pods_by_device({gpu_uuid(1): (held_alone,)}).allocated
    snapshot = replace(snapshot, pods=replace(snapshot.pods, allocated=pods))
    text = renderer(detailed=True).render(snapshot, AgentCounters())
    parsed = {f.name: f.samples for f in text_string_to_metric_families(text)}
    for metric in DCGM_METRICS:
        # GPU 0, time-sliced among three pods: once, with empty pod labels; GPU 1, held by one
        # container alone: once, with its labels (as dcgm-exporter's dashboards expect).
        found = [s.labels for s in parsed[metric.name]]
        series = [(s["gpu"], s["namespace"], s["pod"], s["container"]) for s in found]
        assert sorted(series) == [("0", "", "", ""), ("1", "solo", "train", "main")], metric.name
    assert len(samples(text, "DCGM_FI_DEV_XID_ERRORS")) == 2
    # Who shares GPU 0 is said once per container by gpuagent_device_allocated.
    allocated = samples(text, "gpuagent_device_allocated")
    assert sorted(s[0]["pod"] for s in allocated if s[0]["gpu"] == "0") == [
        f"pod-0-{gpu_uuid(0)[-4:]}-{r}" for r in range(3)
    ]
    assert_unique_series(text)


def test_per_container_series_copy_a_shared_gpu_per_pod() -> None:
    snapshot = synthetic_snapshot(2, replicas=3)
    text = renderer(series_per_container=True).render(snapshot, AgentCounters())
    temps = samples(text, "DCGM_FI_DEV_GPU_TEMP")
    assert len(temps) == 6
    gpu0 = sorted(s[0]["pod"] for s in temps if s[0]["gpu"] == "0")
    assert gpu0 == [f"pod-0-{gpu_uuid(0)[-4:]}-{r}" for r in range(3)]
    assert {s[1] for s in temps if s[0]["gpu"] == "0"} == {snapshot.gpus[0].telemetry.temperature_c}
    assert all(s[0]["namespace"] == "team-a" and s[0]["container"] == "main" for s in temps)
    assert len(samples(text, "DCGM_FI_DEV_XID_ERRORS")) == 6
    allocated = samples(text, "gpuagent_device_allocated")
    assert len(allocated) == 6
    assert_unique_series(text)


def test_container_shares_imply_per_container_series() -> None:
    assert renderer(container_shares=True).series_per_container
    assert not renderer().series_per_container


def test_mig_series_per_gpu_instance_with_parent_identity() -> None:
    snapshot = synthetic_snapshot(1, mig=True, replicas=1)
    text = renderer().render(snapshot, AgentCounters())
    used = samples(text, "DCGM_FI_DEV_FB_USED")
    assert len(used) == 7
    for labels, value in used:
        gi = int(labels["GPU_I_ID"])
        assert labels["GPU_I_PROFILE"] == "1g.10gb"
        assert (labels["gpu"], labels["UUID"], labels["device"]) == ("0", gpu_uuid(0), "nvidia0")
        assert value == 100.0 + gi  # the instance's own reading
        assert labels["pod"] == f"pod-0-{mig_uuid(0, gi)[-4:]}-0"
    # A whole-GPU reading is repeated on each instance's series, as dcgm-exporter does.
    temps = samples(text, "DCGM_FI_DEV_GPU_TEMP")
    assert {v for _, v in temps} == {snapshot.gpus[0].telemetry.temperature_c}
    assert label_order(text, "DCGM_FI_DEV_GPU_TEMP")[0] == MIG_LABELS
    # Instance-scoped readings the MIG device does not have are absent, not the parent's.
    assert samples(text, "DCGM_FI_DEV_GPU_UTIL") == []
    assert len(samples(text, "gpuagent_mig_device_info")) == 7
    assert_unique_series(text)


def test_a_mig_device_of_its_own_unhealthy_shows_on_its_gpu_and_itself() -> None:
    snapshot = synthetic_snapshot(2, mig=True, replicas=1)
    gpu0 = snapshot.gpus[0]
    sick = gpu0.mig_devices[2]
    migs = tuple(
        replace(m, health=GpuHealth((Condition("xid", "95"),))) if m is sick else m
        for m in gpu0.mig_devices
    )
    snapshot = replace(snapshot, gpus=(replace(gpu0, mig_devices=migs), *snapshot.gpus[1:]))
    text = renderer().render(snapshot, AgentCounters())
    healthy = {labels["gpu"]: v for labels, v in samples(text, "gpuagent_gpu_healthy")}
    assert healthy == {"0": 0, "1": 1}
    per_device = {
        labels["mig_uuid"]: v
        for labels, v in samples(text, "gpuagent_mig_device_healthy")
        if labels["gpu"] == "0"
    }
    assert per_device == {m.uuid: (0 if m.uuid == sick.uuid else 1) for m in migs}
    (condition,) = samples(text, "gpuagent_gpu_condition")
    assert condition == (
        {
            "gpu": "0", "uuid": gpu_uuid(0), "condition": "xid", "detail": "95",
            "gpu_instance": str(sick.gpu_instance_id),
            "compute_instance": str(sick.compute_instance_id),
        },
        1.0,
    )  # fmt: skip


def test_mig_compute_instances_of_one_gpu_instance_share_a_series() -> None:
    snapshot = synthetic_snapshot(1, mig=True)
    gpu = snapshot.gpus[0]
    twin = replace(gpu.mig_devices[0], uuid="MIG-twin", compute_instance_id=1)
    snapshot = replace(snapshot, gpus=(replace(gpu, mig_devices=(*gpu.mig_devices, twin)),))
    text = renderer().render(snapshot, AgentCounters())
    assert len(samples(text, "DCGM_FI_DEV_FB_USED")) == 7
    assert_unique_series(text)


HOSTILE = [
    'quote"d',
    "back\\slash",
    "new\nline",
    "tab\tand space",
    "ünïcødé-🚀-名前",
    '\\"\n\\n',
    "trailing\\",
    "{braces}=,",
]


@pytest.mark.parametrize("value", HOSTILE)
def test_hostile_label_values_round_trip(value: str) -> None:
    snapshot = synthetic_snapshot(1)
    gpu = replace(snapshot.gpus[0], name=value, pci_bus_id=value)
    ref = PodRef(namespace=value, pod=value, container=value)
    snapshot = replace(
        snapshot,
        gpus=(gpu,),
        driver=replace(snapshot.driver, version=value),
        pods=pods_by_device({gpu.uuid: (ref,)}),
    )
    snapshot = replace(
        snapshot,
        gpus=(replace(gpu, health=GpuHealth((Condition("xid", value),))),),
    )
    text = MetricsRenderer(value, value, hostname_label="Hostname", detailed=True).render(
        snapshot, AgentCounters(nvml=(NvmlCallStats(value, 3, 0.5, 1),))
    )
    for labels, _ in samples(text, "DCGM_FI_DEV_GPU_TEMP"):
        for key in ("modelName", "pci_bus_id", "Hostname", "DCGM_FI_DRIVER_VERSION", "pod",
                    "namespace", "container"):  # fmt: skip
            assert labels[key] == value
    (condition,) = samples(text, "gpuagent_gpu_condition")
    assert condition[0]["detail"] == value
    (build,) = samples(text, "gpuagent_build_info")
    assert build[0]["version"] == value
    (calls,) = samples(text, "gpuagent_nvml_call_errors_total")
    assert calls[0]["call"] == value
    assert text.endswith("\n")
    assert all(line.count("\n") == 0 for line in text.split("\n"))


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (0, "0"),
        (1.0, "1"),
        (-3, "-3"),
        (0.25, "0.25"),
        (1e20, "1e+20"),
        (float("nan"), "NaN"),
        (float("inf"), "+Inf"),
        (float("-inf"), "-Inf"),
        (123456789012.5, "123456789012.5"),
        (-0.0, "0"),
        (1e15, "1000000000000000.0"),
        (True, "1"),  # a flag handed over as a bool reads as Prometheus' 1, not "True"
        (False, "0"),
    ],
)
def test_format_value(value: float, text: str) -> None:
    assert format_value(value) == text
    parsed = float(text.replace("Inf", "inf"))
    assert (math.isnan(parsed) and math.isnan(value)) or parsed == value


def test_escape_label() -> None:
    assert escape_label('a\\b"c\nd') == 'a\\\\b\\"c\\nd'
    assert escape_label("plain") == "plain"
