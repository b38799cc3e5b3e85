"""The /metrics renderer, checked with prometheus_client's parser as the oracle."""

from __future__ import annotations

import asyncio
import gzip
import math
import re
from collections.abc import Generator
from dataclasses import replace
from types import MappingProxyType
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.promtool import check_metrics
from support.synthetic import full_telemetry, gpu_uuid, mig_uuid, pods_by_device, synthetic_snapshot

from gpuagent.domain.devices import (
    Attribution,
    Condition,
    GpuHealth,
    PodRef,
    Telemetry,
)
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
    ReloadStats,
)
from gpuagent.web import layout, metrics
from gpuagent.web.dcgm import DCGM_FAMILIES, DCGM_METRICS, xid_message
from gpuagent.web.devicepart import hand_back
from gpuagent.web.exposition import escape_label, format_value
from gpuagent.web.metrics import MetricsRenderer

DCGM_LABELS = ["gpu", "UUID", "pci_bus_id", "device", "modelName", "Hostname",
               "DCGM_FI_DRIVER_VERSION", "container", "namespace", "pod"]  # fmt: skip
MIG_LABELS = [*DCGM_LABELS[:5], "GPU_I_PROFILE", "GPU_I_ID", *DCGM_LABELS[5:]]


def renderer(**kwargs: object) -> MetricsRenderer:
    return MetricsRenderer("node-1", "1.2.3", monotonic=lambda: 130.0, wall=lambda: 1e9, **kwargs)  # type: ignore[arg-type]


def families(text: str) -> dict[str, object]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    out = []
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name:
                out.append((dict(s.labels), s.value))
    return out


def label_order(text: str, name: str) -> list[list[str]]:
    """Label names of each sample of ``name`` in the order written (the parser loses it)."""
    orders = []
    for line in text.splitlines():
        if line.startswith(name + "{"):
            orders.append(re.findall(r'(?:^|,)([A-Za-z_][A-Za-z0-9_]*)="', line[len(name) + 1 :]))
    return orders


def assert_unique_series(text: str) -> None:
    seen = set()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = (s.name, tuple(sorted(s.labels.items())))
            assert key not in seen, f"duplicate series {key}"
            seen.add(key)


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


def test_device_part_cached_per_snapshot_version() -> None:
    r = renderer()
    snapshot = synthetic_snapshot(2, version=5)
    first = r.devices(snapshot)
    assert r.devices(snapshot) is first
    assert r.devices(replace(snapshot)) is first  # same version: same part
    assert r.device_renders == 1
    newer = r.devices(replace(snapshot, version=6))
    assert newer is not first
    assert r.device_renders == 2


def test_agent_part_is_fresh_on_every_scrape() -> None:
    r = renderer()
    snapshot = synthetic_snapshot(1)
    for ok in (False, True, False):
        counters = AgentCounters(reloads=ReloadStats(last_successful=ok))
        expected = b"gpuagent_config_last_reload_successful %d\n" % ok
        assert expected in r.agent(snapshot, counters)


@pytest.mark.parametrize("tail", [b"", b"x\n", b"gpuagent_gpus 8\n" * 500])
def test_gzip_prefix_plus_tail_is_one_valid_stream(tail: bytes) -> None:
    part = renderer().devices(synthetic_snapshot(8, replicas=2))
    for _ in range(2):  # the cached segments are reused, not consumed
        assert gzip.decompress(b"".join(part.gzip(tail))) == part.text + tail


@pytest.mark.parametrize("replicas", [0, 128])
def test_gzip_prefix_is_compressed_once_per_version(replicas: int) -> None:
    r = renderer()
    base = synthetic_snapshot(8, replicas=replicas)
    part = r.devices(base)
    first = part.gzip(b"a\n")
    again = part.gzip(b"tail\n")
    assert again[1] is first[1]  # the device part's deflate stream, shared by every scrape
    assert gzip.decompress(b"".join(again)) == part.text + b"tail\n"
    assert r.devices(replace(base, version=base.version)) is part
    newer = r.devices(replace(base, version=base.version + 1))
    assert newer is not part
    assert gzip.decompress(b"".join(newer.gzip(b""))) == newer.text


class Ticker:
    """Counts the turns the event loop gives other tasks while a render or compression runs."""

    def __init__(self) -> None:
        self.turns = 0
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            self.turns += 1
            await asyncio.sleep(0)

    def stop(self) -> int:
        self._task.cancel()
        return self.turns


async def test_a_scrapes_render_hands_the_loop_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """A slice of no time: the render hands the loop back after every family, and the scrapes
    that ask for that version meanwhile share the one render; the text is the same as at once."""
    monkeypatch.setattr(metrics, "SLICE_S", 0.0)
    snapshot = synthetic_snapshot(4, replicas=3)
    r = renderer()
    ticker = Ticker()
    parts = await asyncio.gather(*(r.devices_async(snapshot) for _ in range(3)))
    turns = ticker.stop()
    assert parts[0] is parts[1] is parts[2]
    assert r.device_renders == 1
    assert turns >= len(parts[0].chunks) - 1
    assert parts[0].text == renderer().devices(snapshot).text
    assert await r.devices_async(snapshot) is parts[0]  # cached


async def test_a_new_layout_is_built_in_steps_handing_the_loop_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The label layout (rebuilt when pods come or go: ~6 ms at 50 containers a GPU) is built on
    the loop in steps, other tasks running between every two; a version whose pods did not
    change reuses it."""
    ticker = Ticker()
    turns_at_step: list[int] = []
    steps = layout.layout_steps

    def recording(*args: Any, **kwargs: Any) -> Generator[None, None, layout.Layout]:
        inner = steps(*args, **kwargs)
        while True:
            turns_at_step.append(ticker.turns)
            try:
                next(inner)
            except StopIteration as done:
                built: layout.Layout = done.value
                return built
            yield

    monkeypatch.setattr(metrics, "layout_steps", recording)
    snapshot = synthetic_snapshot(2, replicas=2)
    r = renderer()
    part = await r.devices_async(snapshot)
    await r.devices_async(replace(snapshot, version=snapshot.version + 1))
    ticker.stop()
    assert len(turns_at_step) == 4  # three hand-backs, one build
    assert turns_at_step == sorted(set(turns_at_step))  # the loop ran between every two steps
    assert r.layouts == 1
    assert part.text == renderer().devices(snapshot).text


async def test_a_scrape_that_goes_away_leaves_the_render_to_the_others() -> None:
    snapshot = synthetic_snapshot(2, replicas=2)
    r = renderer()
    gone = asyncio.create_task(r.devices_async(snapshot))
    staying = asyncio.create_task(r.devices_async(snapshot))
    await asyncio.sleep(0)
    gone.cancel()
    part = await staying
    assert part.text == renderer().devices(snapshot).text
    assert r.device_renders == 1


async def test_an_older_render_finishing_late_does_not_replace_a_newer_one() -> None:
    base = synthetic_snapshot(2)
    newer = replace(base, version=base.version + 1)
    r = renderer()
    late = asyncio.create_task(r.devices_async(base))
    part = r.devices(newer)
    await late
    assert r.devices(newer) is part


async def test_a_slice_hands_the_loop_back_behind_the_timers_due() -> None:
    """Between two slices of a render, what fell due during the first (a timer: the kubelet's
    gRPC deadline, a probe) runs before the second ("sleep(0)" resumed the task first)."""
    loop = asyncio.get_running_loop()
    fired: list[str] = []
    loop.call_at(loop.time(), fired.append, "due")  # fell due during the slice
    await hand_back()
    assert fired == ["due"]


async def test_gzip_is_compressed_in_pieces_once() -> None:
    """Compression hands the loop back between pieces; scrapes asking meanwhile share it, and the
    stream is the same as compressing at once."""
    part = renderer(series_per_container=True).devices(synthetic_snapshot(8, replicas=40))
    assert part.size > 4 * 64 * 1024
    ticker = Ticker()
    await asyncio.gather(part.deflate(0.0), part.deflate(0.0))
    assert ticker.stop() >= part.size // (64 * 1024)
    stream = part.gzip(b"tail\n")
    assert gzip.decompress(b"".join(stream)) == part.text + b"tail\n"
    assert part.gzip(b"")[1] is stream[1]


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
        dra=DraCounters(registered=True, devices=8),
        cri=CriStats(),
        log_links=LogLinkStats(),
        api=MappingProxyType({"resource_slices": ApiReach(up=True), "node_health": ApiReach()}),
    )
    refreshed = replace(snapshot, pods=replace(snapshot.pods, refreshed_at=120.0))
    own = r.agent(refreshed, counters).decode()
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
    plain = renderer().agent(snapshot, AgentCounters()).decode()
    assert "gpuagent_mps_" not in plain
    state = MpsState().with_status("nvidia.com/gpu", MpsStatus(up=False, error="x", starts=3))
    shared = renderer().agent(replace(snapshot, mps=state), AgentCounters()).decode()
    count = [line for line in shared.splitlines() if line and not line.startswith("#")]
    assert len(count) == len([ln for ln in plain.splitlines() if ln and ln[0] != "#"]) + 2
    assert 'gpuagent_mps_daemon_up{resource="nvidia.com/gpu"} 0\n' in shared
    assert 'gpuagent_mps_daemon_starts_total{resource="nvidia.com/gpu"} 3\n' in shared


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
