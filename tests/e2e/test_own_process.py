"""The command line's agent owns its process: the collector and GIL slices at start-up."""

from __future__ import annotations

import asyncio
import gc
import sys
from pathlib import Path

import pytest
from support.fake_kubelet import FakeKubelet

from gpuagent.app import tuning
from gpuagent.app.agent import Agent
from gpuagent.config import load_settings
from gpuagent.config.planning import load_simulator

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
    def failing_import(modules: tuple[str, ...]) -> None:
        raise ImportError("the rest cannot be imported")

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
