"""Reloading the configuration re-registers only the resources that changed."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from structlog.testing import capture_logs
from support.fake_kubelet import FakeKubelet
from support.files import replace_atomically

from e2e.agentprocess import free_port, reaped, spawn
from e2e.agentrun import RunningAgent, running_agent
from gpuagent.app.parts.kubelet import Kubelet

T = 10.0
NODE = """\
version: v1
gpus:
  - name: H100
    mig: [1g.10gb, 1g.10gb, 1g.10gb]
  - name: H100
"""
SHARED = """\
version: v1
mig-strategy: mixed
sharing:
  timeSlicing:
    resources:
      - name: nvidia.com/mig-1g.10gb
        replicas: 2
"""
RENAMED = SHARED + "        rename: nvidia.com/mig-1g.10gb.shared\n"


async def test_reload_changes_only_what_changed(
    fake_kubelet: FakeKubelet, device_plugin_dir: Path, short_tmp_path: Path
) -> None:
    node = short_tmp_path / "node.yaml"
    node.write_text(NODE)
    config = short_tmp_path / "gpuagent.yaml"
    config.write_text("version: v1\nmig-strategy: mixed\n")
    args = ["--sim-config", str(node), "--config", str(config)]
    # Reloads come from the test here, not from watching the file.
    async with running_agent(device_plugin_dir, args, config_check_interval=3600) as run:
        regs = await asyncio.to_thread(fake_kubelet.wait_for_registrations, 2, T)
        by_name = {r.resource_name: r for r in regs}
        assert set(by_name) == {"nvidia.com/gpu", "nvidia.com/mig-1g.10gb"}
        mig = by_name["nvidia.com/mig-1g.10gb"]
        first = await asyncio.to_thread(mig.next_update, T)
        assert len(first.devices) == 3
        await asyncio.to_thread(by_name["nvidia.com/gpu"].next_update, T)

        # Same resource name, now time-sliced: its stream resends; nobody re-registers.
        config.write_text(SHARED)
        assert await run.agent.reload() == []
        update = await asyncio.to_thread(mig.wait_until, lambda u: len(u.devices) == 6, T)
        assert all("::" in d.ID for d in update.devices)
        assert len(fake_kubelet.registrations) == 2

        # Renamed: the new name registers, the old endpoint goes, the full-GPU stream stays.
        config.write_text(RENAMED)
        assert await run.agent.reload() == []
        regs = await asyncio.to_thread(fake_kubelet.wait_for_registrations, 3, T)
        assert regs[2].resource_name == "nvidia.com/mig-1g.10gb.shared"
        assert (await asyncio.to_thread(mig.wait_ended, T)) is not None
        assert by_name["nvidia.com/gpu"].ended is None
        assert set(run.agent.part(Kubelet).endpoints.endpoints) == {
            "nvidia.com/gpu",
            "nvidia.com/mig-1g.10gb.shared",
        }
        # The withdrawn endpoint was awaited: its socket is gone, its entry left the store.
        assert not (device_plugin_dir / "nvidia-mig-1g.10gb.sock").exists()
        assert set(run.agent.store.snapshot.registrations) == set(
            run.agent.part(Kubelet).endpoints.endpoints
        )


@asynccontextmanager
async def reloadable(
    fake_kubelet: FakeKubelet, device_plugin_dir: Path, config: Path
) -> AsyncIterator[RunningAgent]:
    """An agent on 2 simulated GPUs with ``config``, registered; reloads come from the test."""
    await asyncio.to_thread(config.write_text, "version: v1\n")
    args = ("--simulate", "2", "--config", str(config))
    async with running_agent(device_plugin_dir, args, config_check_interval=3600) as run:
        await asyncio.to_thread(fake_kubelet.wait_for_registrations, 1, T)
        yield run


async def test_invalid_reload_keeps_the_running_configuration(
    fake_kubelet: FakeKubelet, device_plugin_dir: Path, short_tmp_path: Path
) -> None:
    config = short_tmp_path / "gpuagent.yaml"
    async with reloadable(fake_kubelet, device_plugin_dir, config) as run:
        before = run.agent.store.plan
        config.write_text("version: v1\nsharing: {timeSlicing: {resources: [{}]}}\n")
        with capture_logs() as logs:
            assert await run.agent.reload() is None
        assert run.agent.store.plan is before
        (entry,) = [e for e in logs if e["log_level"] == "error"]
        assert "sharing.timeSlicing.resources[0].name" in entry["error"]


@pytest.mark.parametrize(
    ("body", "named"),
    [
        pytest.param("dra-gpus: 1,7\n", ["dra-gpus", "GPU 7"], id="gpu-the-node-lacks"),
        pytest.param("dra-gpus: GPU-nope\n", ["dra-gpus", "GPU-nope"], id="uuid-the-node-lacks"),
        pytest.param("kubernetes: false\ndra-gpus: all\n", ["dra-gpus", "'kubernetes' false"],
                     id="dra-without-kubernetes"),
    ],
)  # fmt: skip
async def test_a_contradicting_reload_is_refused(
    fake_kubelet: FakeKubelet,
    device_plugin_dir: Path,
    short_tmp_path: Path,
    body: str,
    named: list[str],
) -> None:
    """A configuration that cannot hold on this node (a DRA GPU it does not have, DRA without
    Kubernetes) is refused as a whole: the running one stays, one error line says why, and
    /metrics says the last reload was refused."""
    config = short_tmp_path / "gpuagent.yaml"
    async with reloadable(fake_kubelet, device_plugin_dir, config) as run:
        before = run.agent.store.plan
        config.write_text(f"version: v1\nmig-strategy: mixed\n{body}")
        with capture_logs() as logs:
            assert await run.agent.reload() is None
        assert run.agent.store.plan is before
        (entry,) = [e for e in logs if e["log_level"] == "error"]
        assert all(word in entry["error"] for word in named), entry
        await run.metrics_until(lambda t: "\ngpuagent_config_last_reload_successful 0\n" in t)


async def test_reload_says_which_keys_need_a_restart(
    fake_kubelet: FakeKubelet, device_plugin_dir: Path, short_tmp_path: Path
) -> None:
    config = short_tmp_path / "gpuagent.yaml"
    async with reloadable(fake_kubelet, device_plugin_dir, config) as run:
        config.write_text("version: v1\npod-resources-interval: 7\nmig-strategy: mixed\n")
        assert await run.agent.reload() == ["pod-resources-interval"]
        assert run.agent.store.plan.generation == 1  # the live part applied
        assert run.agent.settings.pod_resources_interval == 30  # the rest waits for a restart


def test_sighup_reloads_the_config_file(
    fake_kubelet: FakeKubelet, device_plugin_dir: Path, short_tmp_path: Path
) -> None:
    config = short_tmp_path / "gpuagent.yaml"
    config.write_text("version: v1\n")
    args = (
        "--simulate", "2",
        "--socket-dir", str(device_plugin_dir),
        "--metrics-address", f"127.0.0.1:{free_port()}",
        "--config", str(config),
    )  # fmt: skip
    with reaped(spawn(*args)) as proc:
        (reg,) = fake_kubelet.wait_for_registrations(1, T)
        assert reg.resource_name == "nvidia.com/gpu"
        replace_atomically(
            config,
            "version: v1\nsharing:\n  timeSlicing:\n    renameByDefault: true\n"
            "    resources: [{name: nvidia.com/gpu, replicas: 2}]\n",
        )
        proc.send_signal(signal.SIGHUP)
        regs = fake_kubelet.wait_for_registrations(2, T)
        assert regs[1].resource_name == "nvidia.com/gpu.shared"
        assert len(regs[1].next_update(T).devices) == 4
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=T) == 0
