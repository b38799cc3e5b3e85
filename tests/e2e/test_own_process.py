"""The command line's agent owns its process: the collector and GIL slices at start-up."""

from __future__ import annotations

import asyncio
import gc
import sys
import threading
from pathlib import Path

import pytest
from support.fake_kubelet import FakeKubelet
from support.waiting import eventually

from gpuagent.app import tuning
from gpuagent.app.agent import Agent
from gpuagent.config import load_settings
from gpuagent.config.planning import load_simulator
from gpuagent.kubelet.endpoints import SERVING

T = 10.0  # generous bound for anything that should take milliseconds


def _agent(device_plugin_dir: Path, *, own_process: bool) -> Agent:
    argv = ["--simulate", "2", "--socket-dir", str(device_plugin_dir),
            "--metrics-address", "127.0.0.1:0", "--log-level", "warning"]  # fmt: skip
    settings = load_settings(argv, {"NODE_NAME": "test-node"})
    return Agent(settings, simulator=load_simulator(settings), own_process=own_process)


async def _start_and_stop(agent: Agent) -> None:
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop))
    try:
        await asyncio.wait_for(agent.started.wait(), T)
    finally:
        stop.set()
        await asyncio.wait_for(task, T)


@pytest.mark.usefixtures("fake_kubelet")
@pytest.mark.parametrize("own_process", [True, False])
async def test_the_rest_is_imported_without_collections_and_with_short_gil_slices(
    device_plugin_dir: Path, monkeypatch: pytest.MonkeyPatch, *, own_process: bool
) -> None:
    """In its own process the agent imports the rest (HTTP, metrics, pod-resources) with the
    collector off and a short switch interval, then freezes what start-up built and turns the
    collector back on; an agent sharing its process (tests, embedding) changes neither."""
    seen: dict[str, object] = {}
    real_import = tuning.import_modules

    def spying_import(modules: tuple[str, ...]) -> None:
        seen["collector on"] = gc.isenabled()
        seen["switch interval"] = sys.getswitchinterval()
        real_import(modules)

    monkeypatch.setattr(tuning, "import_modules", spying_import)
    switch = sys.getswitchinterval()
    frozen = gc.get_freeze_count()
    try:
        await _start_and_stop(_agent(device_plugin_dir, own_process=own_process))
        if own_process:
            assert seen == {"collector on": False, "switch interval": tuning.IMPORT_SWITCH_INTERVAL}
            assert gc.get_freeze_count() > frozen
        else:
            assert seen == {"collector on": True, "switch interval": switch}
            assert gc.get_freeze_count() == frozen
        assert gc.isenabled()
        assert sys.getswitchinterval() == switch
    finally:
        gc.unfreeze()  # the test process as it was
        gc.enable()


async def test_a_start_that_fails_turns_the_collector_back_on(
    fake_kubelet: FakeKubelet, device_plugin_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_import = tuning.import_modules

    def failing_import(modules: tuple[str, ...]) -> None:
        if modules != SERVING:
            raise ImportError("the rest cannot be imported")
        real_import(modules)

    monkeypatch.setattr(tuning, "import_modules", failing_import)
    try:
        with pytest.raises(ImportError):
            await asyncio.wait_for(
                _agent(device_plugin_dir, own_process=True).run(asyncio.Event()), T
            )
        assert gc.isenabled()
    finally:
        gc.enable()
    assert fake_kubelet.registrations  # it had registered: the failure came after


def _driver_started(agent: Agent) -> bool:
    """Whether the driver's start has begun (it says what it waits for) or is done."""
    snapshot = agent.store.snapshot
    return bool(snapshot.driver.waiting) or snapshot.discovered


async def test_what_serves_the_kubelet_is_imported_on_a_thread_while_the_driver_starts(
    fake_kubelet: FakeKubelet, device_plugin_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gRPC's modules are imported off the loop once the driver's start has begun: NVML's
    initialisation and discovery wait on the driver, not on the GIL, so the two overlap."""
    agent = _agent(device_plugin_dir, own_process=False)
    seen: dict[str, object] = {}
    real_import = tuning.import_modules

    def spying_import(modules: tuple[str, ...]) -> None:
        if modules == SERVING:
            seen["on a thread"] = threading.current_thread() is not threading.main_thread()
            # The driver's start begins while this import is held up: it does not wait for it.
            seen["driver started"] = asyncio.run(eventually(lambda: _driver_started(agent)))
            seen["registered"] = bool(fake_kubelet.registrations)
        real_import(modules)

    monkeypatch.setattr(tuning, "import_modules", spying_import)
    await _start_and_stop(agent)
    assert seen == {"on a thread": True, "driver started": True, "registered": False}
    assert fake_kubelet.registrations
