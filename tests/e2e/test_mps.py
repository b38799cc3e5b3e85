"""MPS sharing end to end: a real agent on simulated GPUs with the stand-in control binary under
its driver root, the kubelet stand-in (grpcio), pod-resources and CRI stand-ins, and processes
started over /sim/processes as the containers given the devices would start them."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.cgroups import Layout, cgroup_file, write_proc
from support.fake_cri import FakeCri, RuntimeContainer
from support.fake_kubelet import FakeKubelet, Registration
from support.fake_podresources import FakePodResources, Held
from support.grpcstubs import CriStubs
from support.mpsdaemon import installed_control
from support.waiting import eventually

from e2e.agentrun import RunningAgent, running_agent
from gpuagent.gpu.sim.mps import SERVER_PID_BASE

T = 10.0
GPU = "nvidia.com/gpu"
MIB = 1024 * 1024
SHARING = "{mps: {resources: [{name: nvidia.com/gpu, replicas: 4}]}}"
LAYOUT = Layout("containerd", "systemd", 2)
# Two pods' processes, and the gpuagent pod's: the MPS server runs in the agent's cgroup.
PODS = {1001: ("ml", "trainer"), 1002: ("ds", "notebook"), SERVER_PID_BASE: ("gpuagent", "agent")}


def container_id(pid: int) -> str:
    return f"{pid:064x}"


@pytest.fixture
def runtime(short_tmp_path: Path, cri_stubs: CriStubs) -> Iterator[FakeCri]:
    with FakeCri(short_tmp_path / "cri" / "containerd.sock", cri_stubs) as fake:
        fake.set(
            RuntimeContainer(container_id(pid), ns, pod, "main", pod_uid=f"uid-{pid}")
            for pid, (ns, pod) in PODS.items()
        )
        yield fake


@pytest.fixture
def node_args(
    short_tmp_path: Path, tmp_path: Path, pod_resources: FakePodResources, runtime: FakeCri
) -> tuple[str, ...]:
    installed_control(tmp_path / "driver")
    proc = write_proc(
        tmp_path / "proc",
        {pid: cgroup_file(LAYOUT, f"uid-{pid}", container_id(pid)) for pid in PODS},
    )
    return (
        "--simulate", "2",
        "--sharing", SHARING,
        "--nvidia-driver-root", str(tmp_path / "driver"),
        "--mps-root", str(short_tmp_path / "mps"),
        "--pod-resources-socket", str(pod_resources.socket_path),
        "--cri-socket", str(runtime.socket_path),
        "--proc-root", str(proc),
        "--container-logs-dir", str(proc / "no-log-links"),
        "--poll-interval", "0.3",
    )  # fmt: skip


def healths(update: Any) -> set[str]:
    return {d.health for d in update.devices}


def samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {
        tuple(sorted(s.labels.items())): float(s.value)
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == name
    }


def by_pod(text: str, name: str) -> dict[str, float]:
    found = samples(text, name)
    return {dict(labels).get("pod", ""): v for labels, v in found.items()}


async def start(run: RunningAgent, body: dict[str, object]) -> tuple[int, dict[str, Any]]:
    async with run.http.post(run.base_url + "/sim/processes", json=body) as response:
        return response.status, await response.json()


def daemon_pid(mps_root: Path) -> int:
    return int((mps_root / GPU / "pipe" / "nvidia-cuda-mps-control.pid").read_text())


async def test_mps_sharing_end_to_end(
    fake_kubelet: FakeKubelet,
    device_plugin_dir: Path,
    short_tmp_path: Path,
    pod_resources: FakePodResources,
    node_args: tuple[str, ...],
) -> None:
    mps_root = short_tmp_path / "mps"
    async with running_agent(device_plugin_dir, node_args) as run:
        await asyncio.to_thread(fake_kubelet.wait_for_registrations, 1, T)
        reg: Registration = fake_kubelet.latest(GPU)
        # 4 replicas of each GPU, allocatable once the daemon is up and configured.
        up = await asyncio.to_thread(reg.wait_until, lambda u: healths(u) == {"Healthy"}, T)
        uuids = run.uuids
        assert sorted(d.ID for d in up.devices) == sorted(
            f"{u}::{n}" for u in uuids for n in range(4)
        )
        assert [g["compute_mode"] for g in run.sim.describe()] == ["exclusive_process"] * 2
        _, text = await run.get("/metrics")
        assert samples(text, "gpuagent_mps_daemon_up") == {(("resource", GPU),): 1}
        assert samples(text, "gpuagent_mps_daemon_starts_total") == {(("resource", GPU),): 1}
        await allocate_as_nvidia_does(fake_kubelet, uuids, mps_root)
        await clients_under_the_limits(run, pod_resources, uuids, mps_root / GPU / "pipe")
        # The daemon lost: its replicas unhealthy at once, healthy again once restarted.
        os.kill(daemon_pid(mps_root), signal.SIGKILL)
        down = await asyncio.to_thread(reg.wait_until, lambda u: healths(u) == {"Unhealthy"}, T)
        assert len(down.devices) == 8
        await asyncio.to_thread(reg.wait_until, lambda u: healths(u) == {"Healthy"}, T)
        text = await run.metrics_until(
            lambda t: samples(t, "gpuagent_mps_daemon_starts_total") == {(("resource", GPU),): 2}
        )
        assert samples(text, "gpuagent_mps_daemon_up") == {(("resource", GPU),): 1}
        last = daemon_pid(mps_root)
    # Shutdown quits the daemon and sets the GPUs' compute modes back.
    with pytest.raises(ProcessLookupError):
        os.kill(last, 0)
    assert [g["compute_mode"] for g in run.sim.describe()] == ["default"] * 2


async def allocate_as_nvidia_does(kubelet: FakeKubelet, uuids: list[str], mps_root: Path) -> None:
    """NVIDIA's environment and mounts; one replica per container (its default for MPS)."""
    response = await asyncio.to_thread(kubelet.allocate, [f"{uuids[0]}::2"], resource=GPU)
    container = response.container_responses[0]
    assert dict(container.envs) == {
        "NVIDIA_VISIBLE_DEVICES": uuids[0],
        "CUDA_MPS_PIPE_DIRECTORY": "/mps/nvidia.com/gpu/pipe",
    }
    mounts = {m.container_path: (m.host_path, m.read_only) for m in container.mounts}
    assert mounts == {
        "/mps/nvidia.com/gpu/pipe": (str(mps_root / GPU / "pipe"), False),
        "/dev/shm": (str(mps_root / "shm"), False),
    }
    code, details = await asyncio.to_thread(
        kubelet.allocate_error, [f"{uuids[0]}::0", f"{uuids[1]}::0"], resource=GPU
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "maximum request size for shared resources is 1" in details


async def clients_under_the_limits(
    run: RunningAgent, pod_resources: FakePodResources, uuids: list[str], pipe: Path
) -> None:
    """Two pods' clients under the daemon's limits (81559 MiB / 4 each, 25 % of the SMs), each
    accounted to its container, the server to nobody."""
    pod_resources.set(
        [
            Held("ml", "trainer", "main", GPU, (f"{uuids[0]}::2",)),
            Held("ds", "notebook", "main", GPU, (f"{uuids[0]}::3",)),
        ]
    )
    client = {"pipe_directory": str(pipe)}
    status, refused = await start(
        run, {"gpu": 0, "pid": 1001, "memory_mib": 20_390, "sm_util": 50, "mps": client}
    )
    assert status == 409
    assert refused["cuda_error"] == "cudaErrorMemoryAllocation"
    assert "pinned device memory limit of 20389 MiB" in refused["error"]
    for pid, mib in ((1001, 20_389), (1002, 4_096)):
        body = {"gpu": 0, "pid": pid, "memory_mib": mib, "sm_util": 50, "mps": client}
        status, started = await start(run, body)
        assert status == 200, started
        assert started["sm_util"] == 25.0
    # A process bypassing MPS cannot take the exclusive GPU from the server.
    status, busy = await start(run, {"gpu": 0, "pid": 1003, "memory_mib": 1, "sm_util": 1})
    assert (status, busy["cuda_error"]) == (409, "cudaErrorDevicesUnavailable")

    def clients_only(text: str) -> bool:
        return by_pod(text, "gpuagent_container_gpu_processes") == {"trainer": 1, "notebook": 1}

    text = await run.metrics_until(clients_only, within=T)
    memory = by_pod(text, "gpuagent_container_gpu_memory_used_bytes")
    assert memory == {"trainer": 20_389 * MIB, "notebook": 4_096 * MIB}
    assert "agent" not in by_pod(text, "gpuagent_gpu_unallocated_use")


async def test_reloads_start_reconfigure_and_stop_the_daemon(
    fake_kubelet: FakeKubelet,
    device_plugin_dir: Path,
    short_tmp_path: Path,
    tmp_path: Path,
    node_args: tuple[str, ...],
) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("version: v1\n")  # no sharing at first: MPS comes with a reload
    args = tuple(a for a in node_args if a not in ("--sharing", SHARING))
    pipe = short_tmp_path / "mps" / GPU / "pipe"
    async with running_agent(device_plugin_dir, (*args, "--config", str(config))) as run:
        await asyncio.to_thread(fake_kubelet.wait_for_registrations, 1, T)
        reg = fake_kubelet.latest(GPU)
        await asyncio.to_thread(reg.wait_until, lambda u: len(u.devices) == 2, T)
        assert not pipe.exists()
        config.write_text(f"version: v1\nsharing: {SHARING}\n")
        await run.agent.reload()
        await asyncio.to_thread(
            reg.wait_until, lambda u: len(u.devices) == 8 and healths(u) == {"Healthy"}, T
        )
        assert (pipe / "control").is_socket()
        config.write_text(
            "version: v1\nsharing: {mps: {resources: [{name: nvidia.com/gpu, replicas: 2}]}}\n"
        )
        await run.agent.reload()
        two = await asyncio.to_thread(
            reg.wait_until, lambda u: len(u.devices) == 4 and healths(u) == {"Healthy"}, T
        )
        assert {d.ID.rsplit("::", 1)[1] for d in two.devices} == {"0", "1"}
        status, refused = await start(
            run,
            {"gpu": 1, "pid": 1001, "memory_mib": 40_780, "sm_util": 80,
             "mps": {"pipe_directory": str(pipe)}},
        )  # fmt: skip
        assert (status, refused.get("cuda_error")) == (409, "cudaErrorMemoryAllocation")
        assert "limit of 40779 MiB" in refused["error"]
        # Without MPS any more: the daemon goes, the GPUs are whole and their modes as before.
        config.write_text("version: v1\n")
        await run.agent.reload()
        await asyncio.to_thread(
            reg.wait_until, lambda u: sorted(d.ID for d in u.devices) == sorted(run.uuids), T
        )
        await eventually(lambda: [g["compute_mode"] for g in run.sim.describe()] == ["default"] * 2)
        assert not (pipe / "control").exists()
        _, text = await run.get("/metrics")
        assert "gpuagent_mps_daemon_up" not in text
