"""The agent driven as the kubelet drives it: grpcio client, real Unix sockets, simulated GPUs."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
from structlog.testing import capture_logs
from support.fake_kubelet import FakeKubelet
from support.waiting import eventually

from e2e.agentrun import RunningAgent, first_stream, registered_agent, running_agent
from gpuagent.app.agent import Agent
from gpuagent.app.parts.http import Http
from gpuagent.app.parts.kubelet import Kubelet
from gpuagent.config import load_settings
from gpuagent.config.planning import load_simulator
from gpuagent.domain.containers import DeviceListStrategy

T = 10.0  # generous bound for anything that should take milliseconds


def devices(update: Any) -> list[tuple[str, str, list[int]]]:
    return [(d.ID, d.health, [n.ID for n in d.topology.nodes]) for d in update.devices]


def xid_counts(run: RunningAgent, index: int) -> dict[int, int]:
    """The XIDs counted on GPU ``index`` in the agent's store (none while it is not there)."""
    gpu = run.agent.store.snapshot.gpu(index)
    return {} if gpu is None else dict(gpu.xid_counts)


def last_xid(run: RunningAgent, index: int) -> int | None:
    gpu = run.agent.store.snapshot.gpu(index)
    return None if gpu is None else gpu.last_xid


def health_of(update: Any) -> dict[str, str]:
    return {d.ID: d.health for d in update.devices}


async def test_registers_with_the_kubelets_fields(
    fake_kubelet: FakeKubelet, device_plugin_dir: Path
) -> None:
    async with running_agent(device_plugin_dir):
        (reg,) = await asyncio.to_thread(fake_kubelet.wait_for_registrations, 1, T)
        assert reg.version == "v1beta1"
        assert reg.endpoint == "nvidia-gpu.sock"
        assert reg.resource_name == "nvidia.com/gpu"
        assert reg.options.get_preferred_allocation_available is True
        assert reg.plugin_options.get_preferred_allocation_available is True
        assert reg.plugin_options.pre_start_required is False
        assert (device_plugin_dir / "nvidia-gpu.sock").is_socket()


async def test_first_list_is_every_gpu_healthy_with_numa(
    fake_kubelet: FakeKubelet, device_plugin_dir: Path
) -> None:
    async with registered_agent(fake_kubelet, device_plugin_dir) as run:
        reg = fake_kubelet.latest()
        first = await asyncio.to_thread(reg.next_update, T)
        uuids = run.uuids
        assert devices(first) == [
            (uuids[0], "Healthy", [0]),
            (uuids[1], "Healthy", [0]),
            (uuids[2], "Healthy", [1]),
            (uuids[3], "Healthy", [1]),
        ]
        assert all(u.startswith("GPU-") for u in uuids)


async def test_allocate_returns_visible_devices(
    fake_kubelet: FakeKubelet, device_plugin_dir: Path
) -> None:
    async with registered_agent(fake_kubelet, device_plugin_dir) as run:
        uuids = run.uuids
        response = await asyncio.to_thread(fake_kubelet.allocate, [uuids[2], uuids[0]])
        (container,) = response.container_responses
        assert dict(container.envs) == {"NVIDIA_VISIBLE_DEVICES": f"{uuids[2]},{uuids[0]}"}
        assert run.agent.store.counters.read().allocations == 1


async def test_index_strategy_lists_uuids_and_hands_out_indexes(
    fake_kubelet: FakeKubelet, device_plugin_dir: Path
) -> None:
    """As NVIDIA's plugin: the kubelet always sees UUIDs (stable across renumbering, which its
    checkpoint relies on); --device-id-strategy index changes what the container receives."""
    args = ("--simulate", "2", "--device-id-strategy", "index")
    async with registered_agent(fake_kubelet, device_plugin_dir, args) as run:
        reg = fake_kubelet.latest()
        first = await asyncio.to_thread(reg.next_update, T)
        uuids = run.uuids
        assert [d.ID for d in first.devices] == uuids
        response = await asyncio.to_thread(fake_kubelet.allocate, [uuids[1]])
        assert dict(response.container_responses[0].envs) == {"NVIDIA_VISIBLE_DEVICES": "1"}


async def test_unknown_ids_are_invalid_argument_naming_them(
    fake_kubelet: FakeKubelet, device_plugin_dir: Path
) -> None:
    async with registered_agent(fake_kubelet, device_plugin_dir) as run:
        good = run.uuids[0]
        code, details = await asyncio.to_thread(
            fake_kubelet.allocate_error, [good, "GPU-nope", "also-bad"]
        )
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert "GPU-nope" in details
        assert "also-bad" in details
        assert str(good) not in details


async def test_unhealthy_ids_are_failed_precondition(
    fake_kubelet: FakeKubelet, device_plugin_dir: Path
) -> None:
    async with registered_agent(fake_kubelet, device_plugin_dir) as run:
        reg = fake_kubelet.latest()
        uuid = run.uuids[1]
        status, _ = await run.fault({"gpu": 1, "fault": "xid", "xid": 79})
        assert status == 200
        await asyncio.to_thread(reg.wait_until, lambda u: health_of(u)[uuid] == "Unhealthy", T)
        code, details = await asyncio.to_thread(fake_kubelet.allocate_error, [uuid])
        assert code == grpc.StatusCode.FAILED_PRECONDITION
        assert uuid in details
        assert "xid 79" in details


@pytest.mark.parametrize(
    ("fault", "reason"),
    [
        pytest.param({"fault": "xid", "xid": 79}, "xid 79", id="xid-79"),
        pytest.param({"fault": "ecc_dbe"}, "ecc_dbe", id="double-bit-ecc"),
        pytest.param({"fault": "lost"}, "lost", id="lost"),
    ],
)
async def test_fault_turns_only_that_gpu_unhealthy_then_recovers(
    fake_kubelet: FakeKubelet, device_plugin_dir: Path, fault: dict[str, object], reason: str
) -> None:
    async with registered_agent(fake_kubelet, device_plugin_dir) as run:
        reg = fake_kubelet.latest()
        uuids = run.uuids
        await asyncio.to_thread(reg.next_update, T)

        status, _ = await run.fault({"gpu": 2, **fault})
        assert status == 200
        update = await asyncio.to_thread(
            reg.wait_until, lambda u: health_of(u)[uuids[2]] == "Unhealthy", T
        )
        assert health_of(update) == {
            uuids[0]: "Healthy", uuids[1]: "Healthy", uuids[2]: "Unhealthy", uuids[3]: "Healthy"
        }  # fmt: skip

        def reason2() -> str:
            gpu = run.agent.store.snapshot.gpu(2)
            assert gpu is not None
            return gpu.health.reason

        # The probe that sees a lost GPU follows the XID 79 event.
        await eventually(lambda: reason in reason2(), what=f"{reason!r} in GPU 2's reason")

        status, _ = await run.fault({"gpu": 2, "fault": "recover"})
        assert status == 200
        update = await asyncio.to_thread(
            reg.wait_until, lambda u: health_of(u)[uuids[2]] == "Healthy", T
        )
        assert set(health_of(update).values()) == {"Healthy"}


async def test_application_xid_keeps_gpu_healthy(
    fake_kubelet: FakeKubelet, device_plugin_dir: Path
) -> None:
    async with registered_agent(fake_kubelet, device_plugin_dir) as run:
        reg = await first_stream(fake_kubelet)
        status, _ = await run.fault({"gpu": 0, "fault": "xid", "xid": 13})
        assert status == 200
        # The XID is seen (and counted) but the GPU stays healthy.
        await eventually(lambda: xid_counts(run, 0).get(13), what="XID 13 counted")
        gpu = run.agent.store.snapshot.gpu(0)
        assert gpu is not None
        assert dict(gpu.xid_counts) == {13: 1}
        assert gpu.health.healthy
        assert all(d.health == "Healthy" for d in reg.last_update.devices)


async def test_disabled_healthchecks_keep_gpus_healthy(
    fake_kubelet: FakeKubelet, device_plugin_dir: Path
) -> None:
    args = ("--simulate", "2", "--disable-healthchecks", "all")
    async with registered_agent(fake_kubelet, device_plugin_dir, args) as run:
        reg = await first_stream(fake_kubelet)
        await run.fault({"gpu": 0, "fault": "xid", "xid": 79})
        await eventually(lambda: last_xid(run, 0) == 79, what="XID 79 seen")
        assert all(d.health == "Healthy" for d in reg.last_update.devices)


async def test_kubelet_restart_reregisters(
    fake_kubelet: FakeKubelet, device_plugin_dir: Path
) -> None:
    async with registered_agent(fake_kubelet, device_plugin_dir) as run:
        for n in (2, 3):
            await asyncio.to_thread(fake_kubelet.restart)
            regs = await asyncio.to_thread(fake_kubelet.wait_for_registrations, n, T)
            first = await asyncio.to_thread(regs[-1].next_update, T)
            assert len(first.devices) == 4
        endpoint = run.agent.part(Kubelet).endpoints.endpoints["nvidia.com/gpu"]
        # The kubelet records Register on arrival and the agent counts it when the reply arrives;
        # a restart can fall in between, and the agent then registers once more.
        await run.ready()
        assert endpoint.registrations >= 2


async def test_state_survives_kubelet_restart(
    fake_kubelet: FakeKubelet, device_plugin_dir: Path
) -> None:
    async with registered_agent(fake_kubelet, device_plugin_dir) as run:
        uuid = run.uuids[3]
        await run.fault({"gpu": 3, "fault": "xid", "xid": 48})
        await asyncio.to_thread(
            fake_kubelet.latest().wait_until, lambda u: health_of(u)[uuid] == "Unhealthy", T
        )
        await asyncio.to_thread(fake_kubelet.restart)
        regs = await asyncio.to_thread(fake_kubelet.wait_for_registrations, 2, T)
        first = await asyncio.to_thread(regs[-1].next_update, T)
        assert health_of(first)[uuid] == "Unhealthy"


async def test_waits_for_kubelet_then_registers(device_plugin_dir: Path, grpc_stubs: Any) -> None:
    async with running_agent(device_plugin_dir) as run:
        status, body = await run.get("/readyz")
        assert status == 503
        assert "not registered" in body
        with FakeKubelet(device_plugin_dir, grpc_stubs) as kubelet:
            await asyncio.to_thread(kubelet.wait_for_registrations, 1, T)
            await run.ready()


async def test_shutdown_ends_streams_with_status_and_removes_socket(
    fake_kubelet: FakeKubelet, device_plugin_dir: Path
) -> None:
    async with registered_agent(fake_kubelet, device_plugin_dir) as run:
        reg = await first_stream(fake_kubelet)
        with capture_logs() as logs:
            await run.shutdown()
        # Every step of the shutdown finished by itself: no budget ran out.
        assert [e for e in logs if e["log_level"] == "warning"] == []
        end = await asyncio.to_thread(reg.wait_ended, T)
        assert end.code == grpc.StatusCode.UNAVAILABLE
        assert "shutting down" in end.details
        assert not (device_plugin_dir / "nvidia-gpu.sock").exists()
        assert (device_plugin_dir / "kubelet.sock").exists()
        # The driver was released (its 5 s event wait ended by the simulated interrupt first),
        # never under a call still running.
        assert run.sim.calls["nvmlEventSetFree"] == 1
        assert run.sim.calls["nvmlShutdown"] == 1
        assert run.sim.misuse == []


async def test_preferred_allocation_honours_must_include_and_size(
    fake_kubelet: FakeKubelet, device_plugin_dir: Path
) -> None:
    async with registered_agent(fake_kubelet, device_plugin_dir) as run:
        uuids = run.uuids
        chosen = await asyncio.to_thread(fake_kubelet.preferred, uuids, [uuids[3]], 2)
        assert chosen == [uuids[3], uuids[2]]  # same NUMA node as the must-include GPU


async def test_pre_start_container_is_a_no_op(
    fake_kubelet: FakeKubelet, device_plugin_dir: Path
) -> None:
    async with registered_agent(fake_kubelet, device_plugin_dir) as run:
        uuid = run.uuids[0]
        response = await asyncio.to_thread(fake_kubelet.pre_start, [uuid])
        assert response.ByteSize() == 0


async def test_restart_during_register_is_survived(
    fake_kubelet: FakeKubelet, device_plugin_dir: Path
) -> None:
    """A kubelet that restarts while our Register is in flight must not take the agent down."""
    async with running_agent(device_plugin_dir) as run:
        for n in range(1, 6):
            # Restart the moment the kubelet has received Register, before the agent has its reply.
            await asyncio.to_thread(fake_kubelet.wait_for_registrations, n, T)
            await asyncio.to_thread(fake_kubelet.restart)
        regs = await asyncio.to_thread(fake_kubelet.wait_for_registrations, 6, T)
        first = await asyncio.to_thread(regs[-1].next_update, T)
        assert len(first.devices) == 4
        assert not run.task.done()
        assert run.agent.liveness() is None


async def test_a_slow_driver_holds_neither_the_probes_nor_the_rest_up(
    fake_kubelet: FakeKubelet, device_plugin_dir: Path
) -> None:
    """Register first, but not at any price: a GPU that hangs in discovery leaves the HTTP
    server (probes, metrics) and the other tasks to start; registration follows discovery."""
    argv = ["--simulate", "2", "--socket-dir", str(device_plugin_dir),
            "--metrics-address", "127.0.0.1:0", "--log-level", "warning"]  # fmt: skip
    settings = load_settings(argv, {"NODE_NAME": "test-node"})
    simulator = load_simulator(settings)
    assert simulator is not None
    simulator.inject(1, "hang", seconds=60)  # every call on GPU 1 blocks for a minute
    agent = Agent(settings, simulator=simulator, nvml_call_timeout=120.0)
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop))
    try:
        await asyncio.wait_for(agent.started.wait(), T)
        assert not agent.store.snapshot.discovered  # still waiting for GPU 1
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{agent.part(Http).port}/healthz") as response:
                assert response.status == 200
            async with http.get(f"http://127.0.0.1:{agent.part(Http).port}/readyz") as response:
                assert response.status == 503
        assert fake_kubelet.registrations == []
    finally:
        stop.set()
        await asyncio.wait_for(task, T)


PASS_SPECS = "version: v1\npass-device-specs: true\n"


def _envs(response: Any) -> dict[str, str]:
    (container,) = response.container_responses
    return dict(container.envs)


async def test_answers_kept_for_a_device_set_follow_its_health_and_the_plan(
    fake_kubelet: FakeKubelet, device_plugin_dir: Path, short_tmp_path: Path
) -> None:
    """Allocate answers a device set once and keeps the answer: a device turning unhealthy is
    refused all the same (FAILED_PRECONDITION), an unknown one too (INVALID_ARGUMENT), the
    device recovered is given again, and a reload's strategy is what the next answer carries."""
    config = short_tmp_path / "gpuagent.yaml"
    config.write_text(PASS_SPECS)
    args = ("--simulate", "2", "--config", str(config))
    async with registered_agent(fake_kubelet, device_plugin_dir, args) as run:
        reg = fake_kubelet.latest()
        uuid = run.uuids[1]
        first = await asyncio.to_thread(fake_kubelet.allocate, [uuid])
        assert first == await asyncio.to_thread(fake_kubelet.allocate, [uuid])
        assert _envs(first) == {"NVIDIA_VISIBLE_DEVICES": uuid}
        assert "/dev/nvidia1" in [d.container_path for d in first.container_responses[0].devices]

        await run.fault({"gpu": 1, "fault": "xid", "xid": 79})
        await asyncio.to_thread(reg.wait_until, lambda u: health_of(u)[uuid] == "Unhealthy", T)
        code, details = await asyncio.to_thread(fake_kubelet.allocate_error, [uuid])
        assert (code, uuid in details) == (grpc.StatusCode.FAILED_PRECONDITION, True)
        code, details = await asyncio.to_thread(fake_kubelet.allocate_error, [uuid, "GPU-nope"])
        assert (code, "GPU-nope" in details) == (grpc.StatusCode.INVALID_ARGUMENT, True)

        await run.fault({"gpu": 1, "fault": "recover"})
        await asyncio.to_thread(reg.wait_until, lambda u: health_of(u)[uuid] == "Healthy", T)
        assert await asyncio.to_thread(fake_kubelet.allocate, [uuid]) == first

        config.write_text(
            "version: v1\npass-device-specs: true\ndevice-list-strategy: volume-mounts\n"
        )
        await eventually(
            lambda: run.agent.store.plan.serving.containers.uses(DeviceListStrategy.VOLUME_MOUNTS),
            what="the reloaded strategy",
        )
        response = await asyncio.to_thread(fake_kubelet.allocate, [uuid])
        (container,) = response.container_responses
        assert dict(container.envs) == {
            "NVIDIA_VISIBLE_DEVICES": "/var/run/nvidia-container-devices"
        }
        assert [m.container_path for m in container.mounts] == [
            f"/var/run/nvidia-container-devices/{uuid}"
        ]
        assert list(container.devices) == list(first.container_responses[0].devices)
