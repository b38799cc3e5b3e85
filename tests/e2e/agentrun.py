"""Running a real agent in-process on a simulated driver, with fast registration timings."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from support.fake_kubelet import FakeKubelet, Registration

from gpuagent.app.agent import Agent
from gpuagent.app.parts.dra import Dra
from gpuagent.app.parts.http import Http
from gpuagent.config import Settings
from gpuagent.config.load import load_as
from gpuagent.config.planning import load_simulator
from gpuagent.dra.side import DraSide
from gpuagent.gpu.sim import SimDriver
from gpuagent.kubelet.timing import Timing

FAST = Timing(
    watch_interval=0.02,
    register_timeout=5.0,
    backoff_initial=0.01,
    backoff_max=0.05,
    register_retry_max=0.2,
    close_timeout=1.0,
)


@dataclass
class RunningAgent:
    agent: Agent
    stop: asyncio.Event
    task: asyncio.Task[None]
    http: aiohttp.ClientSession
    base_url: str

    @property
    def port(self) -> int:
        """The agent's HTTP port."""
        return self.agent.part(Http).port

    @property
    def dra(self) -> DraSide:
        """The agent's DRA side (DRA is on)."""
        side = self.agent.part(Dra).side
        assert side is not None
        return side

    @property
    def sim(self) -> SimDriver:
        assert self.agent.simulator is not None
        return self.agent.simulator

    @property
    def uuids(self) -> list[str]:
        """The simulated GPUs' UUIDs, by index."""
        return [str(g["uuid"]) for g in self.sim.describe()]

    async def get(self, path: str) -> tuple[int, str]:
        async with self.http.get(self.base_url + path) as response:
            return response.status, await response.text()

    async def metrics_until(self, predicate: Callable[[str], bool], within: float = 10.0) -> str:
        """/metrics once ``predicate`` holds (``within`` is a deadline for a broken build)."""
        deadline = time.monotonic() + within
        text = ""
        while time.monotonic() < deadline:
            _, text = await self.get("/metrics")
            if predicate(text):
                return text
            await asyncio.sleep(0.02)
        raise AssertionError(f"/metrics never matched:\n{text[-4000:]}")

    async def ready(self, within: float = 10.0) -> None:
        """Wait until /readyz answers 200 (``within`` is a deadline for a broken build)."""
        deadline = time.monotonic() + within
        while (answer := await self.get("/readyz"))[0] != 200:
            if time.monotonic() > deadline:
                raise AssertionError(f"/readyz not ready after {within} s: {answer}")
            await asyncio.sleep(0.02)

    async def polls(self, n: int, within: float = 10.0) -> None:
        """Wait until the poller has probed every GPU ``n`` more times (as /metrics counts them).

        The n-th of them started after this call: it read what the test did before calling.
        """
        target = _probes((await self.get("/metrics"))[1]) + n * len(self.sim.describe())
        deadline = time.monotonic() + within
        while (seen := _probes((await self.get("/metrics"))[1])) < target:
            if time.monotonic() > deadline:
                raise AssertionError(f"{seen} probes after {within} s, waited for {target}")
            await asyncio.sleep(0.02)

    async def fault(self, body: object) -> tuple[int, object]:
        async with self.http.post(self.base_url + "/sim/faults", json=body) as response:
            return response.status, await response.json()

    async def shutdown(self) -> None:
        self.stop.set()
        await asyncio.wait_for(self.task, 5)


@asynccontextmanager
async def running_agent(
    socket_dir: Path,
    args: Sequence[str] = ("--simulate", "4"),
    *,
    sysfs_root: Path | None = None,
    nvml_call_timeout: float = 10.0,
    agent_options: Mapping[str, Any] | None = None,
    config_check_interval: float = 0.02,
    env: Mapping[str, str] | None = None,
    simulator: SimDriver | None = None,
    settings_type: type[Settings] = Settings,
) -> AsyncIterator[RunningAgent]:
    """Start an agent with ``args`` (plus test-friendly addresses) and stop it afterwards.

    ``env`` is the agent's environment (by default only ``NODE_NAME=test-node``). The agent
    re-reads the same arguments and environment (and its ``--config`` file) when it reloads.
    ``simulator``: a simulated driver the test has prepared (faults set before the start), in
    place of the one ``args`` describe. ``sysfs_root``: the host's /sys as the agent reads it;
    by default the simulated node's own host (its GPUs' NUMA nodes and PCI classes).
    ``settings_type``: :class:`Settings`, or a subclass with a test's own options (read as the
    agent's own, and again at each reload).
    """
    environ = {"NODE_NAME": "test-node", **(env or {})}
    argv = [
        "--socket-dir", str(socket_dir),
        "--metrics-address", "127.0.0.1:0",
        "--poll-interval", "0.05",
        "--log-level", "warning",
        *args,
    ]  # fmt: skip
    settings = load_as(settings_type, argv, environ)
    agent = Agent(
        settings,
        simulator=simulator or load_simulator(settings),
        sysfs_root=sysfs_root,
        registration_timing=FAST,
        nvml_call_timeout=nvml_call_timeout,
        **(agent_options or {}),
        settings_source=lambda: load_as(settings_type, argv, environ),
        config_check_interval=config_check_interval,
    )
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop), name="agent-under-test")
    started = asyncio.create_task(agent.started.wait())
    await asyncio.wait({task, started}, timeout=10, return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        started.cancel()
        task.result()  # raises the agent's error
    assert agent.started.is_set(), "agent did not start in 10 s"
    async with aiohttp.ClientSession() as http:
        port = agent.part(Http).port
        running = RunningAgent(agent, stop, task, http, f"http://127.0.0.1:{port}")
        try:
            yield running
        finally:
            if not task.done():
                await running.shutdown()


@asynccontextmanager
async def registered_agent(
    kubelet: FakeKubelet, socket_dir: Path, args: Sequence[str] = ("--simulate", "4")
) -> AsyncIterator[RunningAgent]:
    """:func:`running_agent`, once ``kubelet`` has registered its device plugin (within 10 s)."""
    async with running_agent(socket_dir, args) as run:
        await asyncio.to_thread(kubelet.wait_for_registrations, 1, 10.0)
        yield run


async def first_stream(kubelet: FakeKubelet, resource: str | None = None) -> Registration:
    """The kubelet's registration (for ``resource``) once its stream has sent a first list."""
    await asyncio.to_thread(kubelet.wait_for_registrations, 1, 10.0)
    reg = kubelet.latest(resource) if resource else kubelet.latest()
    await asyncio.to_thread(reg.next_update, 10.0)
    return reg


def _probes(text: str) -> float:
    """How many GPU probes the poller has made (the NVML call histogram's count)."""
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "gpuagent_nvml_call_duration_seconds_count" and s.labels["call"] == "probe"
    )
