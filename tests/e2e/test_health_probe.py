"""``GET /health`` as dcgm-exporter answers it (its Helm chart probes it): ``OK`` while readings
are current, ``KO`` (503) once collection stalls — no poll completed within three poll intervals
and the NVML call limit (0.35 s here: polls every 0.05 s, a 0.2 s call limit)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from support.waiting import eventually

from e2e.agentrun import RunningAgent, running_agent
from gpuagent.config import load_settings
from gpuagent.config.planning import load_simulator
from gpuagent.gpu.monitor import GpuMonitor

CALL_LIMIT = 0.2


async def health_until(run: RunningAgent, status: int, within: float = 10.0) -> str:
    """/health's body once it answers ``status`` (``within`` is a deadline for a broken build)."""
    deadline = time.monotonic() + within
    while (answer := await run.get("/health"))[0] != status:
        if time.monotonic() > deadline:
            raise AssertionError(f"/health never answered {status}: {answer}")
        await asyncio.sleep(0.02)
    return answer[1]


async def test_health_turns_503_while_no_poll_completes_and_200_once_one_does(
    device_plugin_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A poll that does not complete (here: held at its start) stalls collection; /health says
    so, and is OK again with the next poll that completes. /healthz is not /health: the tasks
    still run."""
    release = asyncio.Event()
    poll_once = GpuMonitor.poll_once

    async def held(monitor: GpuMonitor) -> None:
        await release.wait()
        await poll_once(monitor)

    monkeypatch.setattr(GpuMonitor, "poll_once", held)
    args = ("--simulate", "2")
    async with running_agent(device_plugin_dir, args, nvml_call_timeout=CALL_LIMIT) as run:
        assert run.agent.store.counters.polled_at is not None  # discovery was progress
        await eventually(lambda: run.agent.probes.freshness() is not None, what="the limit")
        status, body = await run.get("/health")
        assert status == 503
        assert body.startswith("KO: collection stalled: no poll completed for ")
        assert body.endswith("s (limit 0.35s)\n")
        assert await run.get("/healthz") == (200, "ok\n")
        release.set()
        assert await health_until(run, 200) == "OK"


async def test_without_a_driver_health_says_there_are_no_readings(device_plugin_dir: Path) -> None:
    args = ["--simulate", "1", "--fail-on-init-error=false"]
    simulator = load_simulator(load_settings(args, {}))
    assert simulator is not None
    simulator.fail("nvmlInitWithFlags", 12)  # NVML_ERROR_LIBRARY_NOT_FOUND
    async with running_agent(
        device_plugin_dir, args, nvml_call_timeout=CALL_LIMIT, simulator=simulator
    ) as run:
        await eventually(lambda: run.agent.probes.freshness() is not None, what="the limit")
        status, body = await run.get("/health")
        assert (status, body) == (
            503,
            "KO: no readings: driver unavailable: NVML Shared Library Not Found (NVML 12)\n",
        )
