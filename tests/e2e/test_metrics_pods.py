"""Pod labels on /metrics, end to end: a real agent, the kubelet and pod-resources stand-ins."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.fake_kubelet import FakeKubelet
from support.fake_podresources import FakePodResources, Held

from e2e.agentrun import registered_agent, running_agent

T = 10.0
GPU = "nvidia.com/gpu"


def series(text: str, name: str) -> list[dict[str, str]]:
    return [
        dict(s.labels)
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == name
    ]


def value(text: str, name: str) -> float | None:
    for f in text_string_to_metric_families(text):
        for s in f.samples:
            if s.name == name:
                return float(s.value)
    return None


def pods_on(text: str, gpu: str) -> set[str]:
    return {s["pod"] for s in series(text, "DCGM_FI_DEV_GPU_TEMP") if s["gpu"] == gpu}


def read_gpus(text: str) -> set[str]:
    """The GPUs with DCGM series: read at least once."""
    return {s["gpu"] for s in series(text, "DCGM_FI_DEV_GPU_TEMP")}


def holders(text: str, gpu: str) -> set[str]:
    """The pods holding ``gpu`` (a time-sliced GPU's DCGM series name none of them)."""
    return {s["pod"] for s in series(text, "gpuagent_device_allocated") if s["gpu"] == gpu}


async def allocate(kubelet: FakeKubelet, ids: list[str]) -> None:
    await asyncio.to_thread(kubelet.allocate, ids)


async def test_pod_labels_follow_allocate_disappearance_and_return(
    fake_kubelet: FakeKubelet, device_plugin_dir: Path, pod_resources: FakePodResources
) -> None:
    args = ("--simulate", "2", "--pod-resources-socket", str(pod_resources.socket_path),
            "--pod-resources-interval", "3600")  # fmt: skip
    async with registered_agent(fake_kubelet, device_plugin_dir, args) as run:
        reg = fake_kubelet.latest()
        ids = [d.ID for d in (await asyncio.to_thread(reg.next_update, T)).devices]
        # Pod-resources answered, and the first probe's series are out (they may come later).
        text = await run.metrics_until(
            lambda t: value(t, "gpuagent_pod_resources_up") == 1 and bool(pods_on(t, "0"))
        )
        assert pods_on(text, "0") == {""}

        # Allocate, and only then does the kubelet record it: no 3600 s backstop wait.
        await allocate(fake_kubelet, [ids[0]])
        pod_resources.set([Held("ml", "train-0", "worker", GPU, (ids[0],))])
        text = await run.metrics_until(lambda t: pods_on(t, "0") == {"train-0"}, within=5.0)
        (labels,) = [s for s in series(text, "DCGM_FI_DEV_GPU_TEMP") if s["gpu"] == "0"]
        assert (labels["namespace"], labels["container"]) == ("ml", "worker")
        assert pods_on(text, "1") == {""}

        # The socket vanishes: labels are kept, the age grows, the failure is visible.
        pod_resources.stop()
        await allocate(fake_kubelet, [ids[1]])
        text = await run.metrics_until(lambda t: value(t, "gpuagent_pod_resources_up") == 0)
        assert pods_on(text, "0") == {"train-0"}
        age = value(text, "gpuagent_pod_resources_age_seconds")
        assert age is not None
        text = await run.metrics_until(
            lambda t: (value(t, "gpuagent_pod_resources_age_seconds") or 0) > age + 0.2
        )
        assert value(text, "gpuagent_pod_resources_socket_present") == 0
        assert (value(text, "gpuagent_pod_resources_errors_total") or 0) >= 1

        # It comes back (a restarted kubelet, new socket): labels follow the new mapping.
        pod_resources.set([Held("ml", "train-1", "worker", GPU, (ids[1],))])
        pod_resources.start()
        await allocate(fake_kubelet, [ids[1]])
        text = await run.metrics_until(lambda t: pods_on(t, "1") == {"train-1"})
        assert pods_on(text, "0") == {""}
        assert value(text, "gpuagent_pod_resources_up") == 1
        assert (value(text, "gpuagent_pod_resources_age_seconds") or 99) < 5


@pytest.mark.parametrize("per_container", [False, True], ids=["shared-once", "per-container"])
async def test_replicas_and_index_ids_are_attributed(
    fake_kubelet: FakeKubelet,
    device_plugin_dir: Path,
    pod_resources: FakePodResources,
    per_container: bool,
) -> None:
    """Replica IDs (``1::0``) and index IDs name the GPU: GPU 1, shared by two pods, is reported
    once with empty pod labels (a copy per pod with ``--dcgm-series-per-container``); GPU 0, held
    by one, carries its labels."""
    pod_resources.set([
        Held("a", "p0", "c", GPU, ("1::0",)),
        Held("b", "p1", "c", GPU, ("1::1",)),
        Held("b", "p2", "c", GPU, ("0",)),
        Held("x", "other", "c", "example.com/fpga", ("1",)),
    ])  # fmt: skip
    args = ("--simulate", "2", "--device-id-strategy", "index",
            "--pod-resources-socket", str(pod_resources.socket_path),
            f"--dcgm-series-per-container={str(per_container).lower()}")  # fmt: skip
    async with running_agent(device_plugin_dir, args) as run:
        # Both GPUs read once (their DCGM series follow their first poll) and the pods known.
        text = await run.metrics_until(
            lambda t: holders(t, "1") == {"p0", "p1"} and read_gpus(t) == {"0", "1"}
        )
        assert pods_on(text, "0") == {"p2"}
        wanted = [("a", "p0"), ("b", "p1")] if per_container else [("", "")]
        for name in ("DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_XID_ERRORS"):
            gpu1 = [s for s in series(text, name) if s["gpu"] == "1"]
            assert sorted((s["namespace"], s["pod"]) for s in gpu1) == wanted
        allocated = series(text, "gpuagent_device_allocated")
        assert sorted(s["pod"] for s in allocated) == ["p0", "p1", "p2"]


async def test_pod_resources_calls_at_rest_are_bounded(
    fake_kubelet: FakeKubelet, device_plugin_dir: Path, pod_resources: FakePodResources
) -> None:
    args = ("--simulate", "2", "--pod-resources-socket", str(pod_resources.socket_path))
    async with running_agent(device_plugin_dir, args) as run:
        await run.metrics_until(lambda t: value(t, "gpuagent_pod_resources_up") == 1)
        for _ in range(100):  # scrapes never call the kubelet
            await run.get("/metrics")
        # The default 30 s backstop (2 per minute at rest) is timed in test_podresources.py.
        assert pod_resources.calls == 1


async def test_mig_devices_get_series_and_pods_end_to_end(
    device_plugin_dir: Path, short_tmp_path: Path, pod_resources: FakePodResources
) -> None:
    layout = short_tmp_path / "mig.yaml"
    layout.write_text("version: v1\ngpus:\n  - mig: [3g.40gb, 2g.20gb, 1g.10gb]\n  - {}\n")
    args = ("--sim-config", str(layout), "--pod-resources-socket", str(pod_resources.socket_path),
            "--pod-resources-interval", "1")  # fmt: skip
    async with running_agent(device_plugin_dir, args) as run:
        text = await run.metrics_until(
            lambda t: any("GPU_I_ID" in s for s in series(t, "DCGM_FI_DEV_GPU_TEMP"))
        )
        migs = run.agent.store.snapshot.gpus[0].mig_devices
        assert len(migs) == 3
        by_gi = {m.gpu_instance_id: m for m in migs}
        temps = [s for s in series(text, "DCGM_FI_DEV_GPU_TEMP") if s["gpu"] == "0"]
        assert sorted(int(s["GPU_I_ID"]) for s in temps) == sorted(by_gi)
        for s in temps:
            assert s["GPU_I_PROFILE"] == by_gi[int(s["GPU_I_ID"])].profile
            assert s["UUID"] == run.agent.store.snapshot.gpus[0].uuid
        # One MIG device by UUID (EKS suffix), another by MIG index.
        first, second = migs[0], migs[1]
        pod_resources.set([
            Held("ml", "a", "c", "nvidia.com/mig-3g.40gb", (first.uuid + "::0",)),
            Held("ml", "b", "c", "nvidia.com/mig-2g.20gb", ("0:1",)),
        ])  # fmt: skip

        def pods_by_gi(t: str) -> dict[str, str]:
            return {
                s["GPU_I_ID"]: s["pod"]
                for s in series(t, "DCGM_FI_DEV_GPU_TEMP")
                if s["gpu"] == "0"
            }

        want = {
            str(first.gpu_instance_id): "a",
            str(second.gpu_instance_id): "b",
            str(migs[2].gpu_instance_id): "",
        }
        await run.metrics_until(lambda t: pods_by_gi(t) == want)


async def test_renamed_time_slicing_replicas_are_attributed(
    fake_kubelet: FakeKubelet, device_plugin_dir: Path, pod_resources: FakePodResources
) -> None:
    sharing = (
        '{"timeSlicing": {"renameByDefault": true,'
        ' "resources": [{"name": "nvidia.com/gpu", "replicas": 2}]}}'
    )
    args = ("--simulate", "2", "--sharing", sharing, "--pod-resources-interval", "3600",
            "--pod-resources-socket", str(pod_resources.socket_path))  # fmt: skip
    async with registered_agent(fake_kubelet, device_plugin_dir, args) as run:
        reg = fake_kubelet.latest()
        assert reg.resource_name == "nvidia.com/gpu.shared"
        ids = sorted(d.ID for d in (await asyncio.to_thread(reg.next_update, T)).devices)
        uuid0 = run.uuids[0]
        replicas = [i for i in ids if i.startswith(uuid0)]
        await asyncio.to_thread(
            fake_kubelet.allocate, replicas[:1], resource="nvidia.com/gpu.shared"
        )
        pod_resources.set([
            Held("ml", "one", "c", "nvidia.com/gpu.shared", (replicas[0],)),
            Held("ml", "two", "c", "nvidia.com/gpu.shared", (replicas[1],)),
        ])  # fmt: skip
        text = await run.metrics_until(
            lambda t: holders(t, "0") == {"one", "two"} and read_gpus(t) == {"0", "1"}
        )
        assert pods_on(text, "0") == {""}  # shared: once, no one pod's
        assert pods_on(text, "1") == {""}
