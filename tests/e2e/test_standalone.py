"""``--kubernetes=false``: metrics, health and node labels on a host without a kubelet."""

from __future__ import annotations

from pathlib import Path

from support.waiting import eventually

from e2e.agentrun import running_agent
from e2e.test_metrics_pods import value
from gpuagent.app.parts.kubelet import Kubelet
from gpuagent.app.parts.podresources import PodResources


def sockets(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.sock")) if directory.exists() else []


async def test_without_kubernetes_ready_once_discovered(
    device_plugin_dir: Path, short_tmp_path: Path
) -> None:
    labels = short_tmp_path / "features.d" / "gpuagent"
    args = ("--simulate", "2", "--kubernetes=false", "--node-labels-file", str(labels))
    # No kubelet stand-in: nothing to register with, and nothing is waited for.
    async with running_agent(device_plugin_dir, args) as run:
        assert run.agent.parts.find(Kubelet) is None
        assert run.agent.parts.find(PodResources) is None
        status, body = await run.get("/readyz")
        assert (status, body) == (200, "ready\n")
        _, text = await run.get("/metrics")
        assert value(text, "gpuagent_gpus") == 2
        # No kubelet, so no registration state (an alert on "not registered" must not fire).
        assert "gpuagent_kubelet_registered" not in text
        assert "gpuagent_pod_resources_up" not in text
        # Readings come with the first poll, which follows discovery (ready) by one probe.
        await eventually(lambda: run.agent.store.snapshot.gpus[0].telemetry.temperature_c,
                         what="the first poll's readings")  # fmt: skip
        _, text = await run.get("/metrics")
        assert "DCGM_FI_DEV_GPU_TEMP" in text
        await eventually(labels.exists, what="the node-label file")
        assert "nvidia.com/gpu.count=2\n" in labels.read_text()
        assert sockets(device_plugin_dir) == []  # no plugin socket was ever created


async def test_host_label_is_the_node_name(device_plugin_dir: Path) -> None:
    args = ("--simulate", "1", "--kubernetes=false")
    async with running_agent(device_plugin_dir, args, env={"NODE_NAME": "gpu-node-9"}) as run:
        _, text = await run.get("/metrics")
        assert 'Hostname="gpu-node-9"' in text
        assert run.agent.settings.node_name == "gpu-node-9"
