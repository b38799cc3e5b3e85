"""The set of MPS daemons follows the store's plan and GPUs: started, restarted with new limits,
stopped; a keeper that fails takes the manager down (the agent's supervision sees it)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, ClassVar, cast

import pytest
from support.nodes import gpu, node
from support.tasks import awaiting, running
from support.waiting import eventually

from gpuagent.domain.mps import MpsDaemon, MpsDirs
from gpuagent.domain.plan import Plan
from gpuagent.domain.resources import ResourceSettings
from gpuagent.domain.serving import ResourceView, ServingPolicy
from gpuagent.domain.sharing import MpsSharing
from gpuagent.domain.timeslicing import ReplicaRule
from gpuagent.mps.daemon import DaemonKeeper
from gpuagent.mps.manager import MpsDaemons
from gpuagent.state.store import DeviceStore


class FakeKeeper:
    """Runs until cancelled, and says when it started and stopped."""

    log: ClassVar[list[tuple[str, str, tuple[str, ...]]]] = []
    fail: ClassVar[bool] = False

    def __init__(self, daemon: MpsDaemon, store: DeviceStore, **options: Any) -> None:
        self.daemon = daemon
        self.options = options

    async def run(self) -> None:
        FakeKeeper.log.append(("start", self.daemon.name, self.daemon.commands()))
        try:
            if FakeKeeper.fail:
                raise RuntimeError("a bug")
            await asyncio.Event().wait()
        finally:
            FakeKeeper.log.append(("stop", self.daemon.name, ()))


def plan(*rules: ReplicaRule) -> Plan:
    sharing = MpsSharing(resources=rules)
    return Plan(serving=ServingPolicy(resources=ResourceSettings(mps=sharing)))


@pytest.fixture(autouse=True)
def fresh_log() -> None:
    FakeKeeper.log = []
    FakeKeeper.fail = False


def manager(store: DeviceStore, tmp_path: Path) -> MpsDaemons:
    return MpsDaemons(
        store,
        ResourceView(),
        dirs=MpsDirs(str(tmp_path)),
        driver_root=tmp_path,
        compute_modes=None,
        keeper=cast("Callable[..., DaemonKeeper]", FakeKeeper),
    )


async def test_daemons_follow_the_plan(tmp_path: Path) -> None:
    store = DeviceStore(node(gpu(0, memory_mib=1000)), plan=plan(ReplicaRule("gpu", 2)))
    daemons = manager(store, tmp_path)
    async with running(daemons.run()):
        await eventually(lambda: FakeKeeper.log)
        assert FakeKeeper.log == [
            ("start", "nvidia.com/gpu", ("set_default_device_pinned_mem_limit 0 500M",
                                         "set_default_active_thread_percentage 50")),
        ]  # fmt: skip
        keeper = daemons.keepers["nvidia.com/gpu"]
        assert keeper.options["dirs"] == MpsDirs(str(tmp_path))  # type: ignore[attr-defined]
        # Telemetry and health move on: the daemon does not.
        store.update(lambda s: replace(s, version=s.version))
        store.publish(plan(ReplicaRule("gpu", 4)))  # a reload: new limits, the daemon restarts
        await eventually(lambda: len(FakeKeeper.log) == 3)
        assert FakeKeeper.log[1:] == [
            ("stop", "nvidia.com/gpu", ()),
            ("start", "nvidia.com/gpu", ("set_default_device_pinned_mem_limit 0 250M",
                                         "set_default_active_thread_percentage 25")),
        ]  # fmt: skip
        store.publish(Plan())  # no MPS any more
        await eventually(lambda: len(FakeKeeper.log) == 4)
        assert FakeKeeper.log[-1] == ("stop", "nvidia.com/gpu", ())
        assert daemons.keepers == {}
        store.publish(plan(ReplicaRule("gpu", 2, rename="gpu.mps")))
        await eventually(lambda: len(FakeKeeper.log) == 5)
    assert FakeKeeper.log[-2:] == [
        ("start", "nvidia.com/gpu.mps", FakeKeeper.log[0][2]),
        ("stop", "nvidia.com/gpu.mps", ()),
    ]


async def test_no_daemon_before_the_gpus_are_known(tmp_path: Path) -> None:
    store = DeviceStore(plan=plan(ReplicaRule("gpu", 2)))
    async with running(manager(store, tmp_path).run()) as task:
        await eventually(lambda: awaiting(task))  # waiting for the store to change
        assert FakeKeeper.log == []
        store.update(lambda s: replace(s, gpus=(gpu(0),), discovered=True))
        await eventually(lambda: FakeKeeper.log)
    assert [entry[0] for entry in FakeKeeper.log] == ["start", "stop"]


async def test_a_keeper_that_fails_takes_the_manager_down(tmp_path: Path) -> None:
    FakeKeeper.fail = True
    store = DeviceStore(node(gpu(0)), plan=plan(ReplicaRule("gpu", 2)))
    with pytest.raises(ExceptionGroup) as info:
        await asyncio.wait_for(manager(store, tmp_path).run(), 10)
    assert info.group_contains(RuntimeError, match="a bug")
