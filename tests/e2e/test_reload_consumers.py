"""A reload reaches every consumer of the configuration, or none of them.

Each test starts a real agent (simulated driver, kubelet and pod-resources stand-ins) with a
config file, rewrites the file, and watches what the agent derives from it: the resources the
kubelet is offered, the node-label file, the CDI spec, the pods on /metrics, and /metrics' own
account of the reload.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families
from support.fake_kubelet import FakeKubelet
from support.fake_podresources import FakePodResources, Held
from support.files import replace_atomically
from support.waiting import eventually

from e2e.agentrun import registered_agent, running_agent
from e2e.test_metrics_pods import pods_on, value
from gpuagent.app.parts.podresources import PodResources
from gpuagent.nodefiles.cdi import SPEC_FILE_NAME

T = 10.0
SHARED_4 = """\
version: v1
sharing:
  timeSlicing:
    resources: [{name: nvidia.com/gpu, replicas: 4}]
"""


def read(path: Path) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:
        return ""


def reloads(text: str, result: str) -> float:
    """``gpuagent_config_reloads_total{result=...}``, 0 when absent."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "gpuagent_config_reloads_total" and sample.labels == {
                "result": result
            }:
                return float(sample.value)
    return 0.0


async def test_time_slicing_by_reload_reaches_resources_and_node_labels(
    fake_kubelet: FakeKubelet, device_plugin_dir: Path, short_tmp_path: Path
) -> None:
    config = short_tmp_path / "gpuagent.yaml"
    config.write_text("version: v1\n")
    labels = short_tmp_path / "features.d" / "gpuagent"
    args = ("--simulate", "2", "--config", str(config), "--node-labels-file", str(labels))
    async with running_agent(device_plugin_dir, args):
        (reg,) = await asyncio.to_thread(fake_kubelet.wait_for_registrations, 1, T)
        assert len((await asyncio.to_thread(reg.next_update, T)).devices) == 2
        await eventually(lambda: "nvidia.com/gpu.replicas=1\n" in read(labels), what="labels")
        assert "nvidia.com/gpu.sharing-strategy=none\n" in read(labels)

        replace_atomically(config, SHARED_4)
        await asyncio.to_thread(reg.wait_until, lambda u: len(u.devices) == 8, T)
        await eventually(lambda: "nvidia.com/gpu.replicas=4\n" in read(labels), what="labels")
        assert "nvidia.com/gpu.sharing-strategy=time-slicing\n" in read(labels)
        assert len(fake_kubelet.registrations) == 1  # same resource name: no re-registration


async def test_cdi_strategy_by_reload_writes_the_spec(
    fake_kubelet: FakeKubelet, device_plugin_dir: Path, short_tmp_path: Path
) -> None:
    config = short_tmp_path / "gpuagent.yaml"
    config.write_text("version: v1\n")
    cdi_dir = short_tmp_path / "cdi"
    args = ("--simulate", "2", "--config", str(config), "--cdi-spec-dir", str(cdi_dir))
    async with registered_agent(fake_kubelet, device_plugin_dir, args) as run:
        reg = fake_kubelet.latest()
        ids = [d.ID for d in (await asyncio.to_thread(reg.next_update, T)).devices]
        assert not (cdi_dir / SPEC_FILE_NAME).exists()
        generation = run.agent.store.plan.generation

        replace_atomically(config, "version: v1\ndevice-list-strategy: cdi-cri\n")
        spec_file = cdi_dir / SPEC_FILE_NAME
        # The spec is written before the reloaded plan is served: wait for the plan too.
        await eventually(
            lambda: run.agent.store.plan.generation > generation, what="the reloaded plan"
        )
        assert spec_file.exists()
        names = {d["name"] for d in json.loads(spec_file.read_text())["devices"]}
        assert set(ids) <= names
        response = await asyncio.to_thread(fake_kubelet.allocate, [ids[0]])
        (container,) = response.container_responses
        assert [d.name for d in container.cdi_devices] == [
            f"k8s.device-plugin.nvidia.com/gpu={ids[0]}"
        ]


async def test_renamed_resource_gets_pod_attribution_after_reload(
    fake_kubelet: FakeKubelet,
    device_plugin_dir: Path,
    short_tmp_path: Path,
    pod_resources: FakePodResources,
) -> None:
    config = short_tmp_path / "gpuagent.yaml"
    config.write_text("version: v1\n")
    args = ("--simulate", "2", "--config", str(config),
            "--pod-resources-socket", str(pod_resources.socket_path),
            "--pod-resources-interval", "3600")  # fmt: skip
    async with registered_agent(fake_kubelet, device_plugin_dir, args) as run:
        reg = fake_kubelet.latest()
        uuid = (await asyncio.to_thread(reg.next_update, T)).devices[0].ID
        # A container holds a replica of GPU 0 under a name this agent does not serve (yet).
        pod_resources.set([Held("ml", "train-0", "worker", "example.com/shared-gpu",
                                (f"{uuid}::0",))])  # fmt: skip
        client = run.agent.part(PodResources).client
        assert client is not None
        await client.refresh()
        # Pod-resources answered, and the first probe's series are out (they may come later).
        text = await run.metrics_until(
            lambda t: value(t, "gpuagent_pod_resources_up") == 1 and bool(pods_on(t, "0"))
        )
        assert pods_on(text, "0") == {""}

        replace_atomically(
            config,
            "version: v1\nsharing:\n  timeSlicing:\n    resources:\n"
            "      - {name: nvidia.com/gpu, replicas: 2, rename: example.com/shared-gpu}\n",
        )
        await asyncio.to_thread(fake_kubelet.wait_for_registrations, 2, T)
        await run.metrics_until(lambda t: pods_on(t, "0") == {"train-0"})


async def test_reload_to_an_invalid_file_keeps_the_running_plan(
    fake_kubelet: FakeKubelet, device_plugin_dir: Path, short_tmp_path: Path
) -> None:
    config = short_tmp_path / "gpuagent.yaml"
    config.write_text(SHARED_4)
    labels = short_tmp_path / "features.d" / "gpuagent"
    args = ("--simulate", "2", "--config", str(config), "--node-labels-file", str(labels),
            "--detailed-agent-metrics")  # fmt: skip
    async with registered_agent(fake_kubelet, device_plugin_dir, args) as run:
        reg = fake_kubelet.latest()
        assert len((await asyncio.to_thread(reg.next_update, T)).devices) == 8
        await eventually(lambda: "nvidia.com/gpu.replicas=4\n" in read(labels), what="labels")

        # One replica is not time-slicing: the whole file is refused, nothing changes.
        replace_atomically(config, SHARED_4.replace("replicas: 4", "replicas: 1"))
        text = await run.metrics_until(lambda t: reloads(t, "invalid") == 1)
        assert value(text, "gpuagent_config_last_reload_successful") == 0
        assert value(text, "gpuagent_config_generation") == 0
        assert "nvidia.com/gpu.replicas=4\n" in read(labels)
        assert len(reg.last_update.devices) == 8

        # The next valid file applies.
        replace_atomically(config, SHARED_4.replace("replicas: 4", "replicas: 2"))
        await asyncio.to_thread(reg.wait_until, lambda u: len(u.devices) == 4, T)
        text = await run.metrics_until(lambda t: reloads(t, "changed") == 1)
        assert value(text, "gpuagent_config_last_reload_successful") == 1
        assert value(text, "gpuagent_config_generation") == 1
        await eventually(lambda: "nvidia.com/gpu.replicas=2\n" in read(labels), what="labels")


async def test_reload_that_changes_nothing_changes_nothing(
    fake_kubelet: FakeKubelet, device_plugin_dir: Path, short_tmp_path: Path
) -> None:
    config = short_tmp_path / "gpuagent.yaml"
    config.write_text(SHARED_4)
    async with running_agent(
        device_plugin_dir, ("--simulate", "2", "--config", str(config), "--detailed-agent-metrics")
    ) as run:
        (reg,) = await asyncio.to_thread(fake_kubelet.wait_for_registrations, 1, T)
        await asyncio.to_thread(reg.next_update, T)
        version = run.agent.store.snapshot.version
        updates = len(reg.history)

        replace_atomically(config, "# the same settings, spelled differently\n" + SHARED_4)
        text = await run.metrics_until(lambda t: reloads(t, "unchanged") == 1)
        assert value(text, "gpuagent_config_generation") == 0
        assert len(reg.history) == updates
        assert len(fake_kubelet.registrations) == 1
        # The store moved only for telemetry, never for the plan.
        assert run.agent.store.plan.generation == 0
        assert run.agent.store.snapshot.version >= version
