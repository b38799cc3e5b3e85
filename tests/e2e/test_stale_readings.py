"""No stale telemetry: a GPU that stops answering has its dcgm-exporter series withdrawn, as
dcgm-exporter serves nothing for a blank reading, and they come back with its first good reading.

The agent runs on simulated GPUs with a short NVML call limit; the hang fault blocks every call
on one GPU until ``recover``, so "while it hangs" is a state the test holds, not a duration.
The node-health writer is timed by a clock the test moves (see test_node_health.py).
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from structlog.testing import capture_logs
from support.clock import ManualClock
from support.fake_apiserver import FakeApiServer
from support.kubehealth import settle
from support.waiting import eventually

from e2e.agentrun import RunningAgent, running_agent
from gpuagent.app.parts.nodehealth import NodeHealth

NODE = "test-node"
CALL_LIMIT = 1.0  # seconds: the NVML call limit (readings stay current 1.15 s without a poll)


#: Not a reading: the last XID the driver's events reported, which go on while a GPU hangs.
XID_ERRORS = "DCGM_FI_DEV_XID_ERRORS"


def dcgm_gpus(text: str) -> dict[str, set[str]]:
    """The GPUs (``gpu`` label) with at least one series of each DCGM_FI_* family of readings."""
    found: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("DCGM_FI_") and sample.name != XID_ERRORS:
                found.setdefault(sample.name, set()).add(sample.labels["gpu"])
    return found


def gpu_series(text: str, name: str) -> dict[str, tuple[dict[str, str], float]]:
    return {
        s.labels["gpu"]: (dict(s.labels), s.value)
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == name
    }


def serves(gpus: set[str]) -> Callable[[str], bool]:
    """A predicate on /metrics: every DCGM_FI_* family present is served for exactly ``gpus``
    (the power reading among them)."""

    def check(text: str) -> bool:
        found = dcgm_gpus(text)
        return "DCGM_FI_DEV_POWER_USAGE" in found and all(g == gpus for g in found.values())

    return check


@pytest.fixture
async def run(
    device_plugin_dir: Path, apiserver: FakeApiServer, short_tmp_path: Path
) -> AsyncIterator[tuple[RunningAgent, ManualClock]]:
    clock = ManualClock()
    draws = itertools.cycle([0.5])
    args = ("--simulate", "2", "--kubeconfig",
            str(apiserver.kubeconfig(short_tmp_path / "kubeconfig")))  # fmt: skip
    options = {"clock": clock, "wall": lambda: 1e9 + clock.now(), "draw": lambda: next(draws),
               "api_timeout": 2.0}  # fmt: skip
    async with running_agent(
        device_plugin_dir,
        args,
        nvml_call_timeout=CALL_LIMIT,
        agent_options={"node_name": NODE, "node_health_options": options},
    ) as running:
        yield running, clock


async def test_a_hung_gpu_serves_no_readings_until_it_answers_again(
    run: tuple[RunningAgent, ManualClock], apiserver: FakeApiServer
) -> None:
    agent, clock = run
    writer = agent.agent.part(NodeHealth).writer
    assert writer is not None
    await agent.metrics_until(serves({"0", "1"}))
    await clock.advance(100.0)  # a quiet spell: the writer sends the next change at once
    await settle(clock, writer, agent.agent.store)

    await agent.fault({"gpu": 1, "fault": "hang", "seconds": 600})
    store = agent.agent.store
    await eventually(lambda: not store.snapshot.gpus[1].health.healthy, what="the verdict")
    text = await agent.metrics_until(serves({"0"}))
    assert gpu_series(text, "gpuagent_gpu_healthy")["1"][1] == 0
    labels, value = gpu_series(text, "gpuagent_gpu_condition")["1"]
    assert (labels["condition"], value) == ("unresponsive", 1)
    detail = labels["detail"]  # the third failed check, the one that made the verdict
    assert detail.startswith("an earlier nvml call has not returned (nvml")
    await settle(clock, writer, agent.agent.store, 2.0)
    condition = apiserver.condition()
    assert condition is not None
    assert (condition["status"], condition["reason"]) == ("False", "Unresponsive")
    uuid = agent.uuids[1]
    assert f"GPU 1 ({uuid}): the GPU does not answer the driver ({detail})" in condition["message"]

    await agent.polls(3)  # still hung, polled on: nothing of GPU 1 comes back meanwhile
    _, text = await agent.get("/metrics")
    assert serves({"0"})(text)

    await agent.fault({"gpu": 1, "fault": "recover"})
    text = await agent.metrics_until(serves({"0", "1"}))
    assert gpu_series(text, "gpuagent_gpu_healthy")["1"][1] == 1
    await settle(clock, writer, agent.agent.store, 30.0)
    condition = apiserver.condition()
    assert condition is not None
    assert condition["status"] == "True"


async def test_readings_too_old_are_dropped_when_liveness_is_not_judged(
    device_plugin_dir: Path,
) -> None:
    """With the liveness checks turned off a hung GPU stays healthy, but its readings are not
    served once older than the freshness limit (three polls and the call limit)."""
    args = ("--simulate", "2", "--disable-healthchecks", "all")
    async with running_agent(device_plugin_dir, args, nvml_call_timeout=CALL_LIMIT) as run:
        await run.metrics_until(serves({"0", "1"}))
        with capture_logs() as logs:
            await run.fault({"gpu": 1, "fault": "hang", "seconds": 600})
            text = await run.metrics_until(serves({"0"}))
            assert gpu_series(text, "gpuagent_gpu_healthy")["1"][1] == 1
            await run.fault({"gpu": 1, "fault": "recover"})
            await run.metrics_until(serves({"0", "1"}))
        lines = [e["event"] for e in logs if e["event"].startswith("gpu re") and e["gpu"] == 1]
        assert lines == [
            "gpu readings too old; not served until the gpu is read again",
            "gpu readings current again",
        ]
