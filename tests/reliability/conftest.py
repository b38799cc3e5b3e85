"""A shared in-process agent for property tests (hypothesis runs many examples per test)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e.agentrun import RunningAgent, running_agent
from support.fake_kubelet import FakeKubelet
from support.grpcstubs import StubModules


@pytest.fixture
def shared_agent(
    device_plugin_dir: Path, grpc_stubs: StubModules
) -> Iterator[tuple[RunningAgent, FakeKubelet, asyncio.AbstractEventLoop]]:
    """An agent on its own event-loop thread, registered with a kubelet stand-in."""
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    holder: dict[str, RunningAgent] = {}
    stop = asyncio.Event()

    async def main() -> None:
        async with running_agent(device_plugin_dir) as run:
            holder["run"] = run
            ready.set()
            await stop.wait()

    thread = threading.Thread(target=lambda: loop.run_until_complete(main()), daemon=True)
    with FakeKubelet(device_plugin_dir, grpc_stubs) as kubelet:
        thread.start()
        assert ready.wait(10), "agent did not start"
        kubelet.wait_for_registrations(1, 10)
        try:
            yield holder["run"], kubelet, loop
        finally:
            loop.call_soon_threadsafe(stop.set)
            thread.join(10)
            loop.close()
