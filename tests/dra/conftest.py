"""The DRA tests' fixtures: the agent's directories, an agent on them, the plugin watcher."""

from __future__ import annotations

from pathlib import Path

import pytest
from e2e.agentrun import running_agent
from support.fake_apiserver import FakeApiServer
from support.fake_plugin_watcher import FakePluginWatcher
from support.grpcstubs import DraStubs

from dra.test_dra_flow import FAST_DRA, NODE, Dirs, DraAgent


@pytest.fixture
def dirs(short_tmp_path: Path) -> Dirs:
    return Dirs(short_tmp_path)


@pytest.fixture
def dra_agent(dirs: Dirs, device_plugin_dir: Path, apiserver: FakeApiServer) -> DraAgent:
    """``dra_agent(**kw)``: an agent on ``dirs`` and ``apiserver`` (``kw``: :meth:`Dirs.args`)."""
    return lambda **kw: running_agent(
        device_plugin_dir,
        dirs.args(apiserver, **kw),
        agent_options={"node_name": NODE, "dra_options": FAST_DRA},
    )


@pytest.fixture
def watcher(dirs: Dirs, dra_stubs: DraStubs) -> FakePluginWatcher:
    """The kubelet's plugin watcher, on the agent's registry directory."""
    return FakePluginWatcher(dirs.registry, dra_stubs)
