"""DRA shares of a GPU end to end (``--dra-sharing mps``): the agent in-process on 4 simulated
GPUs (2 and 3 given to DRA, shared) with the stand-in ``nvidia-cuda-mps-control`` under its
driver root, the API server's stand-in (every slice checked against the 1.34 and 1.37 schemas
and the API server's request-policy rules; claims allocated with ``consumedCapacity`` as a
scheduler with consumable capacity allocates them), the kubelet's plugin watcher, pod-resources
and CRI stand-ins, and processes started over /sim/processes as CUDA in a claim's container
would start them (from the claim's CDI spec)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import pytest
from e2e.agentrun import RunningAgent, running_agent
from e2e.test_container_accounting import samples
from support.cgroups import Layout, cgroup_file, write_proc
from support.fake_apiserver import FakeApiServer, claim
from support.fake_cri import FakeCri, RuntimeContainer
from support.fake_plugin_watcher import FakePluginWatcher, Registration
from support.fake_podresources import Claimed, FakePodResources
from support.grpcstubs import CriStubs, DraStubs
from support.mpsdaemon import cdi_client, installed_control
from support.waiting import eventually

from dra.test_dra_flow import DRIVER, FAST_DRA, NODE, Dirs, cdi_validator, registered
from gpuagent.domain.drashare import ClaimShare, Share
from gpuagent.gpu.sim.mpscontrol import PID_FILE
from gpuagent.kube.slices import Coalescing

T = 10.0
MIB = 1 << 20
DAEMON = f"{DRIVER}/gpu-2"
PIDS = {4101: "main", 4102: "main", 4103: "side"}
POD_UID = "5eed0000-0000-4000-8000-000000004101"
SMALL = {"memory": "4Gi", "compute": "25"}
BIG = {"memory": "16Gi", "compute": "50"}


@pytest.fixture
def runtime(short_tmp_path: Path, cri_stubs: CriStubs) -> Iterator[FakeCri]:
    with FakeCri(short_tmp_path / "cri" / "containerd.sock", cri_stubs) as fake:
        fake.set(
            RuntimeContainer(f"{pid:064x}", "ml", "trainer", name, pod_uid=POD_UID)
            for pid, name in PIDS.items()
        )
        yield fake


SharedAgent = Callable[..., AbstractAsyncContextManager[RunningAgent]]


@pytest.fixture
def shared_agent(
    dirs: Dirs,
    device_plugin_dir: Path,
    apiserver: FakeApiServer,
    pod_resources: FakePodResources,
    runtime: FakeCri,
    tmp_path: Path,
) -> SharedAgent:
    """An agent sharing GPUs 2 and 3 through DRA, with what accounting and events need."""
    installed_control(tmp_path / "driver")
    layout = Layout("containerd", "systemd", 2, "guaranteed")
    proc = write_proc(
        tmp_path / "proc", {pid: cgroup_file(layout, POD_UID, f"{pid:064x}") for pid in PIDS}
    )
    args = dirs.args(apiserver, extra=(
        "--dra-sharing", "mps",
        "--nvidia-driver-root", str(tmp_path / "driver"),
        "--mps-root", str(dirs.root / "mps"),
        "--pod-resources-socket", str(pod_resources.socket_path),
        "--pod-resources-interval", "1",
        "--cri-socket", str(runtime.socket_path),
        "--proc-root", str(proc),
        "--container-logs-dir", str(proc / "no-log-links"),
        "--container-accounting=true",
        "--poll-interval", "0.2",
    ))  # fmt: skip
    # Every write out at once (the pacing is the writers' own tests').
    health = {"coalescing": Coalescing(window=0.0, settle=0.0), "api_timeout": 2.0}
    options = {"node_name": NODE, "dra_options": FAST_DRA, "node_health_options": health}
    return lambda: running_agent(device_plugin_dir, args, agent_options=options)


def _up(run: RunningAgent, name: str = DAEMON) -> bool:
    status = run.agent.store.snapshot.mps.status(name)
    return status is not None and status.up


async def _serving(
    run: RunningAgent, watcher: FakePluginWatcher, apiserver: FakeApiServer
) -> Registration:
    """Registered, both shared GPUs' daemons up and their devices published healthy."""
    registration = await registered(watcher)
    await eventually(lambda: _up(run) and _up(run, f"{DRIVER}/gpu-3"), what="daemons up")
    await eventually(
        lambda: (
            len(apiserver.devices()) == 2
            and not any("taints" in d for d in apiserver.devices().values())
        ),
        what="two shared devices published",
    )
    return registration


def _spec(dirs: Dirs, uid: str) -> dict[str, Any]:
    spec: dict[str, Any] = json.loads((dirs.cdi / f"k8s.{DRIVER}-claim_{uid}.json").read_text())
    return spec


def _env(spec: dict[str, Any]) -> dict[str, str]:
    (device,) = spec["devices"]
    return dict(item.split("=", 1) for item in device["containerEdits"]["env"])


async def _process(run: RunningAgent, body: Mapping[str, object]) -> tuple[int, dict[str, Any]]:
    async with run.http.post(run.base_url + "/sim/processes", json=body) as response:
        return response.status, await response.json()


async def _prepare(
    watcher: FakePluginWatcher, reg: Registration, *claims: tuple[str, str]
) -> dict[str, str]:
    """Prepare the claims ``(name, uid)`` of namespace ml; their errors by UID."""
    response = await watcher.aprepare(reg, [("ml", name, uid) for name, uid in claims])
    return {uid: result.error for uid, result in response.claims.items()}


def _shared_claim(name: str, uid: str, consumed: dict[str, str], device: str = "gpu-2") -> Any:
    return claim("ml", name, uid, [("gpu", DRIVER, NODE, device)], consumed=consumed)


async def test_two_claims_share_a_gpu_each_held_to_its_own_share(
    shared_agent: SharedAgent, apiserver: FakeApiServer, dirs: Dirs, watcher: FakePluginWatcher
) -> None:
    mps_root = dirs.root / "mps"
    async with shared_agent() as run:
        reg = await _serving(run, watcher, apiserver)
        published = apiserver.devices()["gpu-2"]
        assert published["allowMultipleAllocations"] is True
        assert published["capacity"]["compute"]["requestPolicy"]["default"] == "100"
        assert [g["compute_mode"] for g in run.sim.describe()][2:] == ["exclusive_process"] * 2
        apiserver.add_claim(_shared_claim("small", "u-small", SMALL))
        apiserver.add_claim(_shared_claim("big", "u-big", BIG))
        assert await _prepare(watcher, reg, ("small", "u-small"), ("big", "u-big")) == {
            "u-small": "", "u-big": ""
        }  # fmt: skip
        small, big = _spec(dirs, "u-small"), _spec(dirs, "u-big")
        pipe = f"/mps/{DAEMON}/pipe"
        assert _env(small) == {
            "CUDA_MPS_PIPE_DIRECTORY": pipe,
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=4096M",
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25",
        }
        assert _env(big)["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=16384M"
        assert _env(big)["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
        edits = small["devices"][0]["containerEdits"]
        mounts = {m["containerPath"]: m["hostPath"] for m in edits["mounts"]}
        assert mounts == {pipe: str(mps_root / DAEMON / "pipe"), "/dev/shm": str(mps_root / "shm")}
        cdi_validator().validate(small)

        # CUDA in each container, as its spec makes it: past its own share refused, within it
        # held to its thread percentage; the other claim's larger share is its own.
        past = {"gpu": 2, "pid": 4101, "memory_mib": 4097, "sm_util": 90, "mps": cdi_client(small)}
        status, refused = await _process(run, past)
        assert (status, refused["cuda_error"]) == (409, "cudaErrorMemoryAllocation")
        assert "pinned device memory limit of 4096 MiB" in refused["error"]
        for pid, spec, mib, held in ((4101, small, 4096, 25.0), (4102, big, 9000, 50.0)):
            client = cdi_client(spec)
            body = {"gpu": 2, "pid": pid, "memory_mib": mib, "sm_util": 90, "mps": client}
            status, started = await _process(run, body)
            assert status == 200, started
            assert started["sm_util"] == held

        # Unprepare releases the share: its spec and checkpoint entry go, the store forgets it.
        done = await watcher.aunprepare(reg, [("ml", "small", "u-small")])
        assert done.claims["u-small"].error == ""
        assert not (dirs.cdi / f"k8s.{DRIVER}-claim_u-small.json").exists()
        assert [s.claim for s in run.agent.store.snapshot.shares] == ["big"]
        text = await run.metrics_until(lambda t: "gpuagent_dra_shared_claims 1" in t)
        assert "gpuagent_dra_claims_over_share 0" in text
        checkpoint = dirs.checkpoint()
        assert list(checkpoint["claims"]) == ["u-big"]
    assert apiserver.invalid == []
    # Shutdown quits the daemons and sets the GPUs' compute modes back.
    assert [g["compute_mode"] for g in run.sim.describe()] == ["default"] * 4


async def test_claims_a_share_cannot_hold_are_refused_with_their_reason(
    shared_agent: SharedAgent, apiserver: FakeApiServer, dirs: Dirs, watcher: FakePluginWatcher
) -> None:
    """A whole-GPU claim (no capacity asked) takes the GPU as without sharing; a share of one
    GPU beside another device, or a share of no compute, gets its own error."""
    async with shared_agent() as run:
        reg = await _serving(run, watcher, apiserver)
        apiserver.add_claim(claim("ml", "whole", "u-whole", [("gpu", DRIVER, NODE, "gpu-3")]))
        two = [("a", DRIVER, NODE, "gpu-2"), ("b", DRIVER, NODE, "gpu-3")]
        apiserver.add_claim(claim("ml", "two", "u-two", two, consumed=SMALL))
        apiserver.add_claim(_shared_claim("none", "u-none", {"memory": "1Gi", "compute": "0"}))
        errors = await _prepare(watcher, reg, ("whole", "u-whole"), ("two", "u-two"),
                                ("none", "u-none"))  # fmt: skip
        assert errors["u-whole"] == ""
        assert "env" not in _spec(dirs, "u-whole")["devices"][0]["containerEdits"]
        assert "a claim with a share of a GPU can hold no other device" in errors["u-two"]
        assert "a share needs some of both" in errors["u-none"]
        assert run.agent.store.snapshot.shares == ()


async def test_a_restart_keeps_every_share(
    shared_agent: SharedAgent, apiserver: FakeApiServer, dirs: Dirs, watcher: FakePluginWatcher
) -> None:
    async with shared_agent() as run:
        reg = await _serving(run, watcher, apiserver)
        apiserver.add_claim(_shared_claim("small", "u-small", SMALL))
        assert await _prepare(watcher, reg, ("small", "u-small")) == {"u-small": ""}
        before = _spec(dirs, "u-small")
    reads = sum(1 for _, path in apiserver.requests if "resourceclaims" in path)
    async with shared_agent() as run:
        want = ClaimShare(DRIVER, "ml", "small", "u-small", "gpu-2", run.uuids[2], Share(4096, 25))
        await eventually(lambda: run.agent.store.snapshot.shares == (want,), what="shares")
        await run.metrics_until(lambda t: "gpuagent_dra_shared_claims 1" in t)
        reg = await _serving(run, watcher, apiserver)
        assert await _prepare(watcher, reg, ("small", "u-small")) == {"u-small": ""}
        assert _spec(dirs, "u-small") == before
    assert sum(1 for _, path in apiserver.requests if "resourceclaims" in path) == reads


async def test_a_claims_processes_over_its_share_make_an_event_on_its_pod(
    shared_agent: SharedAgent,
    apiserver: FakeApiServer,
    pod_resources: FakePodResources,
    watcher: FakePluginWatcher,
    dirs: Dirs,
) -> None:
    """Two CUDA processes, each within the claim's 4 GiB (the limit binds each process), 6 GiB
    together: the claim is over its share, on /metrics and in a Warning event on its pod."""
    async with shared_agent() as run:
        reg = await _serving(run, watcher, apiserver)
        apiserver.add_claim(_shared_claim("small", "u-small", SMALL))
        assert await _prepare(watcher, reg, ("small", "u-small")) == {"u-small": ""}
        pod_resources.set([
            Claimed("ml", "trainer", name, "small", DRIVER, NODE, "gpu-2")
            for name in ("main", "side")
        ])  # fmt: skip
        client = cdi_client(_spec(dirs, "u-small"))
        for pid in (4101, 4103):
            body = {"gpu": 2, "pid": pid, "memory_mib": 3072, "sm_util": 20, "mps": client}
            status, started = await _process(run, body)
            assert status == 200, started
        text = await run.metrics_until(lambda t: "gpuagent_dra_claims_over_share 1" in t)
        used = samples(text, "gpuagent_dra_claim_memory_used_bytes")
        assert used == []  # per claim only with --detailed-agent-metrics
        await eventually(lambda: apiserver.pod_events("ml", "trainer"), what="an event on the pod")
        (event,) = apiserver.pod_events("ml", "trainer")
        assert (event["type"], event["reason"]) == ("Warning", "GPUShareExceeded")
        assert event["regarding"]["uid"] == POD_UID
        assert "claim ml/small" in event["note"]
        assert "(containers main, side)" in event["note"]
        assert "4096 MiB, 25 % of compute" in event["note"]
    assert apiserver.invalid == []


async def test_a_shared_gpus_daemon_lost_turns_its_device_unhealthy_and_tainted(
    shared_agent: SharedAgent,
    apiserver: FakeApiServer,
    watcher: FakePluginWatcher,
    dra_stubs: DraStubs,
    dirs: Dirs,
) -> None:
    unhealthy = dra_stubs.health.UNHEALTHY
    async with shared_agent() as run:
        reg = await _serving(run, watcher, apiserver)
        stream = watcher.watch_health(reg)
        try:
            pid = int((dirs.root / "mps" / DAEMON / "pipe" / PID_FILE).read_text())
            os.kill(pid, signal.SIGKILL)

            def health_now(message: Any) -> dict[str, tuple[bool, str]]:
                return {d.device.device_name: (d.health == unhealthy, d.message)
                        for d in message.devices}  # fmt: skip

            def first_unhealthy() -> dict[str, tuple[bool, str]]:
                for message in stream:
                    health = health_now(message)
                    if health["gpu-2"][0]:
                        return health
                raise AssertionError("the health stream ended")

            health = await asyncio.to_thread(first_unhealthy)
        finally:
            stream.close()
        _, said = health["gpu-2"]
        assert said.startswith(f"MPS control daemon for {DAEMON}: was killed by signal 9")
        assert health["gpu-3"] == (False, "")
        await eventually(lambda: "taints" in apiserver.devices()["gpu-2"], what="tainted")
        taints = [
            (t["key"], t["effect"], t.get("value")) for t in apiserver.devices()["gpu-2"]["taints"]
        ]
        assert taints == [(f"{DRIVER}/mps-daemon", "NoSchedule", None)]
        assert "taints" not in apiserver.devices()["gpu-3"]
        # Started again by the agent: healthy, the taint gone.
        await eventually(lambda: _up(run), what="the daemon started again")
        await eventually(lambda: "taints" not in apiserver.devices()["gpu-2"], what="untainted")
    assert apiserver.invalid == []
