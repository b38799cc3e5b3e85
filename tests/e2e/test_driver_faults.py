"""Driver misbehaviour injected over HTTP: a GPU that hangs or lacks a call affects only itself."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

from support.fake_kubelet import FakeKubelet
from support.waiting import eventually

from e2e.agentrun import running_agent
from e2e.test_http import samples, wait_for_metric

T = 10.0


async def test_hung_gpu_turns_unhealthy_alone_and_returns(
    fake_kubelet: FakeKubelet, device_plugin_dir: Path
) -> None:
    async with running_agent(device_plugin_dir, nvml_call_timeout=0.2) as run:
        (reg,) = await asyncio.to_thread(fake_kubelet.wait_for_registrations, 1, T)
        await asyncio.to_thread(reg.next_update, T)
        uuids = run.uuids
        status, state = await run.fault({"gpu": 1, "fault": "hang", "seconds": 1.5})
        assert status == 200
        assert isinstance(state, dict)
        assert state["hang_s"] > 0

        def gpu1(state: str) -> Callable[[Any], bool]:
            return lambda u: {d.ID: d.health for d in u.devices}[uuids[1]] == state

        update = await asyncio.to_thread(reg.wait_until, gpu1("Unhealthy"), T)
        assert [d.health for d in update.devices if uuids[1] != d.ID] == ["Healthy"] * 3
        gpu = run.agent.store.snapshot.gpu(1)
        assert gpu is not None
        assert "unresponsive" in gpu.health.reason
        # GPU 0 keeps being read while GPU 1 is stuck.
        before = run.agent.store.snapshot.gpu(0)
        assert before is not None

        def gpu0_read_again() -> bool:
            now = run.agent.store.snapshot.gpu(0)
            assert now is not None
            return now.telemetry != before.telemetry

        await eventually(gpu0_read_again, within=T, what="GPU 0 read again")
        # The hang ends by itself; the GPU answers and is healthy again.
        await asyncio.to_thread(reg.wait_until, gpu1("Healthy"), T)


async def test_recover_ends_a_hang_early(device_plugin_dir: Path) -> None:
    async with running_agent(device_plugin_dir, ("--simulate", "2")) as run:
        await run.fault({"gpu": 0, "fault": "hang", "seconds": 600})
        status, state = await run.fault({"gpu": 0, "fault": "recover"})
        assert status == 200
        assert isinstance(state, dict)
        assert state["hang_s"] == 0


async def test_not_supported_value_disappears_for_that_gpu_only(device_plugin_dir: Path) -> None:
    async with running_agent(device_plugin_dir, ("--simulate", "2")) as run:
        await wait_for_metric(run, "gpuagent_gpus", {}, 2)
        status, state = await run.fault(
            {"gpu": 0, "fault": "not_supported", "symbol": "nvmlDeviceGetTemperature"}
        )
        assert status == 200
        assert isinstance(state, dict)
        assert state["not_supported"] == ["nvmlDeviceGetTemperature"]

        def temperatures_of(text: str) -> set[str]:
            return {dict(k)["gpu"] for k in samples(text, "DCGM_FI_DEV_GPU_TEMP")}

        text = await run.metrics_until(lambda text: temperatures_of(text) == {"1"}, within=T)
        assert samples(text, "gpuagent_gpu_healthy") == {
            (("gpu", "0"), ("uuid", run.uuids[0])): 1,
            (("gpu", "1"), ("uuid", run.uuids[1])): 1,
        }


async def test_function_not_found_is_absent_not_fatal(device_plugin_dir: Path) -> None:
    async with running_agent(device_plugin_dir, ("--simulate", "2")) as run:
        await wait_for_metric(run, "gpuagent_gpus", {}, 2)
        # No DCGM family is exposed before the first poll: see power reported, then remove it.
        await run.metrics_until(lambda text: len(samples(text, "DCGM_FI_DEV_POWER_USAGE")) == 2)
        status, _ = await run.fault(
            {"gpu": 1, "fault": "function_not_found", "symbol": "nvmlDeviceGetPowerUsage"}
        )
        assert status == 200
        text = await run.metrics_until(lambda text: not samples(text, "DCGM_FI_DEV_POWER_USAGE"))
        assert samples(text, "DCGM_FI_DEV_GPU_TEMP")
        assert run.agent.liveness() is None
        assert all(g.health.healthy for g in run.agent.store.snapshot.gpus)


async def test_bad_call_fault_parameters_are_400(device_plugin_dir: Path) -> None:
    async with running_agent(device_plugin_dir, ("--simulate", "1")) as run:
        for body in (
            {"gpu": 0, "fault": "hang"},
            {"gpu": 0, "fault": "hang", "seconds": -1},
            {"gpu": 0, "fault": "hang", "seconds": "1"},
            {"gpu": 0, "fault": "not_supported"},
            {"gpu": 0, "fault": "not_supported", "symbol": "nvmlNoSuchThing"},
            {"gpu": 0, "fault": "lost", "seconds": 1},
            {"gpu": 0, "fault": "lost", "extra": 1},
        ):
            status, payload = await run.fault(body)
            assert status == 400, body
            assert isinstance(payload, dict)
            assert payload["error"]
