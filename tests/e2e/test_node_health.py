"""GPU faults Kubernetes sees, end to end: the agent on simulated GPUs, the kubelet and its
pod-resources stand-ins, and the API-server stand-in (every write validated against the
Kubernetes schemas). The node-health writer is timed by a clock the test moves, so "within 2 s"
and "one window later" are exact, and no test waits on wall time for them."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs
from support.cgroups import Layout, cgroup_file, write_proc
from support.clock import ManualClock
from support.fake_apiserver import KUBELET_CONDITIONS, FakeApiServer
from support.fake_cri import FakeCri, RuntimeContainer
from support.fake_kubelet import FakeKubelet
from support.fake_podresources import FakePodResources, Held
from support.grpcstubs import CriStubs
from support.kubehealth import settle
from support.waiting import eventually

from e2e.agentrun import RunningAgent, running_agent
from gpuagent.app.agent import Agent
from gpuagent.app.parts.nodehealth import NodeHealth
from gpuagent.config import ConfigError, load_settings

NODE = "test-node"
WALL0 = 1_767_225_600.0  # 2026-01-01T00:00:00Z at the writer's clock 0
T = 10.0


class Health:
    """The running agent, its writer's clock, and the API server it writes to."""

    def __init__(self, run: RunningAgent, clock: ManualClock, server: FakeApiServer) -> None:
        self.run, self.clock, self.server = run, clock, server

    async def settle(self, seconds: float = 0.0) -> None:
        writer = self.run.agent.part(NodeHealth).writer
        assert writer is not None
        await settle(self.clock, writer, self.run.agent.store, seconds)

    def gpu(self, index: int) -> Any:
        gpu = self.run.agent.store.snapshot.gpu(index)
        assert gpu is not None
        return gpu

    def condition(self) -> dict[str, Any]:
        condition = self.server.condition()
        assert condition is not None
        return condition


@contextlib.asynccontextmanager
async def health_agent(
    device_plugin_dir: Path,
    pod_resources: FakePodResources,
    server: FakeApiServer,
    root: Path,
    *extra: str,
) -> AsyncIterator[Health]:
    """The agent on four simulated GPUs (and ``extra`` options), registered with the kubelet
    stand-in, writing to the API-server stand-in by a clock the test moves."""
    clock = ManualClock()
    draws = itertools.cycle([0.5, 0.2, 0.8])
    args = ("--simulate", "4", "--kubeconfig", str(server.kubeconfig(root / "kubeconfig")),
            "--pod-resources-socket", str(pod_resources.socket_path),
            "--pod-resources-interval", "1", *extra)  # fmt: skip
    options = {"clock": clock, "wall": lambda: WALL0 + clock.now(), "draw": lambda: next(draws),
               "api_timeout": 2.0}  # fmt: skip
    async with running_agent(
        device_plugin_dir, args, agent_options={"node_name": NODE, "node_health_options": options}
    ) as run:
        health = Health(run, clock, server)
        await health.settle(0.2)  # the first batch: the condition, True
        yield health


@pytest.fixture
async def health(
    fake_kubelet: FakeKubelet,
    device_plugin_dir: Path,
    pod_resources: FakePodResources,
    apiserver: FakeApiServer,
    short_tmp_path: Path,
) -> AsyncIterator[Health]:
    async with health_agent(device_plugin_dir, pod_resources, apiserver, short_tmp_path) as h:
        yield h


async def holding_gpu_3(health: Health, pod_resources: FakePodResources) -> str:
    """A pod holds GPU 3 (as the kubelet's pod-resources lists it); returns GPU 3's UUID."""
    uuid = health.gpu(3).uuid
    pod_resources.set([Held("ml", "train-3", "worker", "nvidia.com/gpu", (uuid,))])
    await eventually(lambda: health.run.agent.store.snapshot.pods.allocated, what="pods listed")
    return str(uuid)


async def test_xid_79_on_gpu_3_is_a_false_condition_a_node_event_and_a_pod_event(
    health: Health, pod_resources: FakePodResources, apiserver: FakeApiServer
) -> None:
    assert health.condition()["status"] == "True"
    assert health.condition()["message"] == "All 4 GPUs are healthy"
    uuid = await holding_gpu_3(health, pod_resources)
    await health.clock.advance(100.0)
    await health.settle()
    start = len(apiserver.requests)

    await health.run.fault({"gpu": 3, "fault": "xid", "xid": 79})
    await eventually(lambda: not health.gpu(3).health.healthy, what="GPU 3 unhealthy")
    await health.settle()
    assert apiserver.requests[start:] == []  # nothing before the writer's time moves
    await health.settle(2.0)  # within 2 s of the XID
    condition = health.condition()
    assert (condition["status"], condition["reason"]) == ("False", "XidError")
    assert condition["message"].startswith(
        f"1 of 4 GPUs unhealthy. GPU 3 ({uuid}): XID 79, GPU has fallen off the bus "
        "(recommended action: restart the node); the driver's recovery action: reset the GPU;"
    )
    (node_event,) = apiserver.node_events()
    assert node_event["reason"] == "GPUUnhealthy"
    assert node_event["reportingController"] == "gpuagent"
    assert node_event["reportingInstance"] == NODE
    assert f"GPU 3 ({uuid}) is unhealthy: XID 79" in node_event["note"]
    (pod_event,) = apiserver.pod_events("ml", "train-3")
    assert pod_event["note"].startswith(
        f"GPU 3 ({uuid}) allocated to this pod (container worker) failed: XID 79, GPU has "
        "fallen off the bus"
    )
    assert len(apiserver.events) == 2

    # Recovery (the driver's recovery action reads none again): True, one event.
    await health.run.fault({"gpu": 3, "fault": "recovery_action", "action": "none"})
    await eventually(lambda: health.gpu(3).health.healthy, what="GPU 3 healthy")
    await health.settle(30.0)
    condition = health.condition()
    assert (condition["status"], condition["reason"]) == ("True", "AllGPUsHealthy")
    assert apiserver.node_events()[-1]["reason"] == "GPURecovered"
    assert len(apiserver.events) == 3
    assert apiserver.kubelet_conditions() == [dict(c) for c in KUBELET_CONDITIONS]
    assert apiserver.invalid == []


async def test_a_fault_5_s_after_a_write_is_on_the_node_and_its_pod_within_a_second(
    health: Health, pod_resources: FakePodResources, apiserver: FakeApiServer
) -> None:
    """The condition written at start, 5 s of the writer's time later XID 79 on GPU 3: the
    condition, the Node's event and the pod's are written within a second, not with the window
    30 s after the first write."""
    uuid = await holding_gpu_3(health, pod_resources)
    await health.settle(5.0)
    await health.run.fault({"gpu": 3, "fault": "xid", "xid": 79})
    await eventually(lambda: not health.gpu(3).health.healthy, what="GPU 3 unhealthy")
    await health.settle(1.0)
    condition = health.condition()
    assert (condition["status"], condition["reason"]) == ("False", "XidError")
    assert f"GPU 3 ({uuid}): XID 79" in condition["message"]
    (node_event,) = apiserver.node_events()
    assert f"GPU 3 ({uuid}) is unhealthy: XID 79" in node_event["note"]
    (pod_event,) = apiserver.pod_events("ml", "train-3")
    assert pod_event["note"].startswith(f"GPU 3 ({uuid}) allocated to this pod")
    assert apiserver.invalid == []


async def test_an_api_outage_shows_in_metrics_and_readyz_at_the_first_failed_write(
    health: Health, apiserver: FakeApiServer
) -> None:
    """The API server gone 5 s after a write: the next fault's batch fails 0.2 s after it, and
    gpuagent_kube_backing_off and /readyz say so then. The agent stays ready: its GPUs are
    served, only what Kubernetes is told of their health waits."""
    _, text = await health.run.get("/metrics")
    assert "gpuagent_kube_backing_off 0" in text
    await health.settle(5.0)
    await apiserver.stop()
    await health.run.fault({"gpu": 1, "fault": "xid", "xid": 79})
    await eventually(lambda: not health.gpu(1).health.healthy, what="GPU 1 unhealthy")
    await health.settle(1.0)
    _, text = await health.run.get("/metrics")
    assert "gpuagent_kube_backing_off 1" in text
    status, body = await health.run.get("/readyz")
    assert status == 200
    assert body.startswith("ready\nnode health not written: API server unreachable: ")
    await apiserver.start()
    await health.settle(1.0)  # the next try (full jitter, at most 0.5 s)
    assert health.condition()["status"] == "False"
    _, text = await health.run.get("/metrics")
    assert "gpuagent_kube_backing_off 0" in text
    assert await health.run.get("/readyz") == (200, "ready\n")


async def test_a_pod_event_names_the_pod_uid_its_gpu_process_gave(
    fake_kubelet: FakeKubelet,
    device_plugin_dir: Path,
    pod_resources: FakePodResources,
    apiserver: FakeApiServer,
    short_tmp_path: Path,
    tmp_path: Path,
    cri_stubs: CriStubs,
) -> None:
    """With per-container accounting on, the pod's UID comes from its GPU process's cgroup, and
    the pod's event names it: ``kubectl describe pod`` lists only events that do."""
    uid, pid = "0c0ffee0-0000-4000-8000-000000000003", 3003
    container_id = f"{pid:064x}"
    layout = Layout("containerd", "systemd", 2, "guaranteed")
    proc = write_proc(tmp_path / "proc", {pid: cgroup_file(layout, uid, container_id)})
    with FakeCri(short_tmp_path / "cri" / "containerd.sock", cri_stubs) as cri:
        cri.set([RuntimeContainer(container_id, "ml", "train-3", "worker", pod_uid=uid)])
        accounting = ("--container-accounting=true", "--cri-socket", str(cri.socket_path),
                      "--proc-root", str(proc),
                      "--container-logs-dir", str(proc / "none"))  # fmt: skip
        async with health_agent(
            device_plugin_dir, pod_resources, apiserver, short_tmp_path, *accounting
        ) as health:
            await holding_gpu_3(health, pod_resources)
            run = health.run
            body = {"gpu": 3, "pid": pid, "memory_mib": 100, "sm_util": 10}
            async with run.http.post(run.base_url + "/sim/processes", json=body) as response:
                assert response.status == 200, await response.text()
            store = run.agent.store
            await eventually(
                lambda: ("ml", "train-3", uid) in store.snapshot.usage.pod_uids, what="pod UID"
            )
            await health.clock.advance(100.0)  # a quiet spell: the fault goes out at once
            await health.settle()
            await run.fault({"gpu": 3, "fault": "xid", "xid": 79})
            await eventually(lambda: not health.gpu(3).health.healthy, what="GPU 3 unhealthy")
            await health.settle(2.0)
            (pod_event,) = apiserver.pod_events("ml", "train-3")
            assert pod_event["regarding"] == {
                "apiVersion": "v1", "kind": "Pod", "name": "train-3", "namespace": "ml",
                "uid": uid,
            }  # fmt: skip
            assert apiserver.invalid == []


async def test_a_storm_of_1000_xids_makes_at_most_20_requests(
    health: Health, pod_resources: FakePodResources, apiserver: FakeApiServer
) -> None:
    await holding_gpu_3(health, pod_resources)
    await health.clock.advance(100.0)
    await health.settle()
    start = len(apiserver.requests)
    codes = itertools.cycle([79, 48, 94, 119, 13])
    for burst in range(10):  # 100 XIDs in each second of the writer's time
        for _ in range(100):
            await health.run.fault({"gpu": 3, "fault": "xid", "xid": next(codes)})
        await eventually(lambda: health.gpu(3).xid_counts, what="the XIDs seen")
        await health.settle(1.0 if burst < 9 else 0.0)
    await eventually(
        lambda: sum(health.gpu(3).xid_counts.values()) == 1000, what="every XID counted"
    )
    await health.settle(120.0)
    requests = apiserver.requests[start:]
    assert len(requests) <= 20, requests
    assert health.condition()["status"] == "False"
    assert len(apiserver.node_events()) == 1
    assert len(apiserver.pod_events("ml", "train-3")) == 1
    assert apiserver.invalid == []


async def test_a_hung_api_server_slows_neither_the_kubelet_nor_metrics(
    health: Health, fake_kubelet: FakeKubelet, apiserver: FakeApiServer
) -> None:
    (registration,) = await asyncio.to_thread(fake_kubelet.wait_for_registrations, 1, T)
    apiserver.hold()  # accepts, never answers
    try:
        await health.clock.advance(100.0)
        await health.run.fault({"gpu": 1, "fault": "xid", "xid": 79})
        await health.clock.advance(1.0)  # the writer's request now hangs
        # The kubelet hears GPU 1 Unhealthy, and /metrics answers, meanwhile.
        uuid = health.gpu(1).uuid
        while True:
            update = await asyncio.to_thread(registration.next_update, T)
            if any(uuid == d.ID and d.health == "Unhealthy" for d in update.devices):
                break
        text = await health.run.metrics_until(
            lambda t: 'gpuagent_gpu_healthy{gpu="1"' in t and "gpuagent_kube" in t
        )
        assert "gpuagent_kube_requests_total" in text
        assert health.condition()["status"] == "True"
    finally:
        apiserver.release()


async def test_without_credentials_both_are_off_quietly(device_plugin_dir: Path) -> None:
    with capture_logs() as logs:
        async with running_agent(device_plugin_dir, ("--simulate", "1")) as run:
            part = run.agent.part(NodeHealth)
            assert isinstance(part.wanted, str)  # why not: no credentials
            assert part.writer is None
            _, text = await run.get("/metrics")
            assert "gpuagent_kube_" not in text
    (line,) = [e for e in logs if e["event"].startswith("node condition and events off")]
    assert line["log_level"] == "info"
    assert "KUBERNETES_SERVICE_HOST" in line["reason"]


@pytest.mark.parametrize("flag", ["--node-condition=true", "--events", "--taint-unhealthy-node"])
def test_asked_for_without_credentials_it_does_not_start(flag: str) -> None:
    settings = load_settings(["--simulate", "1", flag], {"NODE_NAME": NODE})
    with pytest.raises(ConfigError) as info:
        Agent(settings)
    assert info.value.key == flag.partition("=")[0]  # the flag as typed
    assert "needs API server credentials" in str(info.value)
