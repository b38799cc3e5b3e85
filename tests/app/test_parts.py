"""The agent as an ordered list of parts: each part's modules imported before it starts, the
parts of a stage started in order and their tasks spawned once all have started, the rest's wait
bounded, and the shutdown — drained, tasks cancelled, closed in reverse order within the budget,
the driver's share kept whatever the parts before it take."""

from __future__ import annotations

import asyncio
import importlib
import pkgutil
from collections.abc import Coroutine, Mapping
from typing import Any

import pytest

from gpuagent.app import agent, parts
from gpuagent.app import tuning as tuning_module
from gpuagent.app.part import Part, Parts, Stage, Task
from gpuagent.app.supervisor import (
    SHUTDOWN_SECONDS,
    SHUTDOWN_TASKS_SECONDS,
    ShutdownBudget,
    Supervisor,
)


class Recorded(Part):
    """A part that says what is done to it, in one list shared by the parts of a test."""

    def __init__(
        self,
        name: str,
        said: list[str],
        *,
        stage: Stage = Stage.REST,
        imports: tuple[str, ...] = (),
        reserved: float = 0.0,
        cap: float = 1.0,
    ) -> None:
        self.name, self.stage, self.imports = name, stage, imports
        self.reserved_seconds, self.close_seconds = reserved, cap
        self._said = said
        self.given: float | None = None  # the seconds its close was given

    async def start(self) -> None:
        self._said.append(f"start {self.name}")

    def tasks(self) -> Mapping[str, Task]:
        return {f"{self.name}-task": self._run}

    async def _run(self) -> None:
        self._said.append(f"run {self.name}")
        try:
            await asyncio.Event().wait()
        finally:
            self._said.append(f"cancelled {self.name}")

    async def drain(self) -> None:
        self._said.append(f"drain {self.name}")

    async def close(self, seconds: float) -> None:
        self.given = seconds
        self._said.append(f"close {self.name}")


def parts_of(*members: Part) -> Parts:
    out = Parts(own_process=False)
    for member in members:
        out.add(member)
    return out


async def test_a_stage_starts_in_order_once_each_parts_modules_are_imported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    said: list[str] = []
    monkeypatch.setattr(tuning_module, "import_modules", lambda m: said.append(f"import {m[0]}"))
    kubelet = Recorded("kubelet", said, stage=Stage.KUBELET, imports=("grpc",))
    http = Recorded("http", said, imports=("aiohttp",))
    driver = Recorded("driver", said, stage=Stage.KUBELET)
    spawned: list[str] = []

    def spawn(name: str, coro: Coroutine[Any, Any, None]) -> None:
        spawned.append(name)
        coro.close()

    listed = parts_of(driver, kubelet, http)
    await listed.start(Stage.KUBELET, spawn)
    assert said == ["start driver", "import grpc", "start kubelet"]
    assert spawned == ["driver-task", "kubelet-task"]  # once every part of the stage started
    await listed.start(Stage.REST, spawn)
    assert said[3:] == ["import aiohttp", "start http"]
    assert spawned[2:] == ["http-task"]


class Waiting(Recorded):
    """A part whose settling never comes, and which then says it cannot go on."""

    async def settled(self) -> None:
        await asyncio.Event().wait()

    def check(self) -> None:
        raise RuntimeError(f"{self.name} cannot go on")


async def test_the_wait_for_the_kubelet_is_bounded_then_each_part_says_if_it_can_go_on() -> None:
    said: list[str] = []
    listed = parts_of(Waiting("driver", said, stage=Stage.KUBELET))
    with pytest.raises(RuntimeError, match="driver cannot go on"):
        await listed.settle(Stage.KUBELET, 0.0)


async def test_shutdown_drains_cancels_then_closes_in_reverse_within_the_budget() -> None:
    said: list[str] = []
    driver = Recorded("driver", said, stage=Stage.KUBELET, reserved=1.0, cap=SHUTDOWN_SECONDS)
    others = [Recorded(name, said) for name in ("kubelet", "dra", "http")]
    listed = [driver, *others]
    supervisor = Supervisor()
    stopping = asyncio.Event()
    for part in listed:
        for name, task in part.tasks().items():
            supervisor.spawn(name, task())
    await asyncio.sleep(0)  # the tasks run
    del said[:]
    await supervisor.shut_down(listed, stopping)
    assert stopping.is_set()
    assert said[:4] == ["drain http", "drain dra", "drain kubelet", "drain driver"]
    assert sorted(said[4:8]) == sorted(f"cancelled {p.name}" for p in listed)
    assert said[8:] == ["close http", "close dra", "close kubelet", "close driver"]
    # Each close is given at most its cap, and the driver's share is kept for it.
    assert all(p.given is not None and 0.0 < p.given <= 1.0 for p in others)
    assert driver.given is not None
    assert SHUTDOWN_SECONDS - SHUTDOWN_TASKS_SECONDS <= driver.given <= SHUTDOWN_SECONDS


def test_a_step_never_has_more_than_whats_left_for_it() -> None:
    """Whatever the steps before it took, each gets what is left once the shares of the parts
    still to close are kept aside (nothing, when that is spent); the part that reserved its share
    gets it then."""
    now = [100.0]
    said: list[str] = []
    driver = Recorded("driver", said, reserved=1.0, cap=SHUTDOWN_SECONDS)
    http = Recorded("http", said)
    budget = ShutdownBudget([driver, http], lambda: now[0])
    assert budget.left(0.5) == 0.5  # the streams' step: its cap
    now[0] += 1.2  # the tasks took long
    budget.closing(http)
    assert budget.left(http.close_seconds) == pytest.approx(0.3)  # 2.5 - 1.2 - the driver's 1.0
    now[0] += 0.5  # and the HTTP server's close longer than its share
    assert budget.left(http.close_seconds) == 0.0
    budget.closing(driver)
    assert budget.left(driver.close_seconds) == pytest.approx(0.8)  # its share, less the overrun


async def test_a_part_that_fails_to_close_leaves_the_others_closing() -> None:
    said: list[str] = []

    class Broken(Recorded):
        async def close(self, seconds: float) -> None:
            raise RuntimeError("a bug")

    driver = Recorded("driver", said, reserved=1.0, cap=SHUTDOWN_SECONDS)
    await Supervisor().shut_down([driver, Broken("http", said)], asyncio.Event())
    assert said == ["drain http", "drain driver", "close driver"]


def test_every_part_module_has_its_entry_in_the_list() -> None:
    """A part's module in app/parts/ and its entry in PARTS go together (adding a part is both)."""
    listed = {build.__module__ for build in agent.PARTS}
    modules = {f"{parts.__name__}.{info.name}" for info in pkgutil.iter_modules(parts.__path__)}
    assert modules == listed
    for name in modules:
        module = importlib.import_module(name)
        assert any(issubclass(v, Part) for v in vars(module).values() if isinstance(v, type))
