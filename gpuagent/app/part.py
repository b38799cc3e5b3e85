"""One shape for every long-lived part of the agent, what a part is built from, and an agent's
parts in their order.

A part (:class:`Part`) is built when the agent is made, from the :class:`Context` — the
settings, the store, the node — and decides then, so a setting it cannot work with is a
configuration error before anything starts (exit 2). It starts in its :class:`Stage`: what
serves the kubelet at once, the rest once the kubelet has its device plugin (or 2 s). Before it
starts, the modules it names are imported on a thread (the loop keeps answering the kubelet).
Its root tasks are supervised (one that ends stops the agent); at shutdown every part built is
drained, its tasks cancelled, and closed in the reverse of the order it was listed in, within
its share of the shutdown's budget. :class:`Parts` holds one agent's parts in their order.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Mapping
from enum import Enum
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import structlog

from gpuagent.app.tuning import import_off_loop
from gpuagent.config import Settings
from gpuagent.domain.serving import ResourceView
from gpuagent.kubelet.timing import Timing
from gpuagent.state.store import DeviceStore
from gpuagent.web.listener import Listener

if TYPE_CHECKING:
    from gpuagent.app.probes import AgentProbes
    from gpuagent.gpu import sim
    from gpuagent.web.webconfig import WebConfigFile

__all__ = ["Context", "Knobs", "Part", "Parts", "Stage", "Task", "bounded"]

log = structlog.get_logger("gpuagent")

P = TypeVar("P", bound="Part")
#: A root task: a coroutine function the supervisor runs, by name, until the agent stops.
Task = Callable[[], Coroutine[Any, Any, None]]

#: The most a part's close may take, unless it says otherwise (:attr:`Part.close_seconds`).
CLOSE_SECONDS = 1.0


class Stage(Enum):
    """When a part starts."""

    #: What serves the kubelet: at once, its modules imported while the driver starts.
    KUBELET = "kubelet"
    #: The rest: once the kubelet has its device plugin, or 2 s (a slow driver, a kubelet that
    #: holds Register open, must not keep /metrics and the probes down).
    REST = "rest"


class Part:
    """A long-lived part of the agent. A part overrides what it needs of this shape.

    ``name`` says which part a log line is about. ``stage``: when it starts. ``imports``:
    modules imported off the loop before :meth:`start` (what is heavy to import). A part's close
    takes at most ``close_seconds`` (less when the shutdown's budget runs short);
    ``reserved_seconds`` of the budget are kept for it whatever the parts closed before it take
    (the driver's release).
    """

    name: str = ""
    stage: Stage = Stage.REST
    imports: tuple[str, ...] = ()
    close_seconds: float = CLOSE_SECONDS
    reserved_seconds: float = 0.0

    async def start(self) -> None:
        """Build what needs the imported modules, and begin (nothing long: that is a task)."""

    def tasks(self) -> Mapping[str, Task]:
        """The root tasks, by name, once started (each runs until the agent stops)."""
        return MappingProxyType({})

    async def settled(self) -> None:
        """Until what the rest waits for has come (the driver's first start, the kubelet's first
        answer); the wait is bounded by the caller."""

    def check(self) -> None:
        """After that wait: raise when what this part started cannot go on."""

    async def drain(self) -> None:
        """At shutdown, before the root tasks are cancelled (the kubelet's streams end);
        bounded by the caller."""

    async def close(self, seconds: float) -> None:
        """Release what the part holds within ``seconds`` (started or not)."""


class Knobs(NamedTuple):
    """What tests shorten or stand in for: the registration's intervals, the NVML call limit,
    how often the config files are checked for a change, what re-reads the settings (``None``:
    no reloads), and the DRA side's and the node-health writer's own options. (This and
    :class:`Context` are named tuples: cheaper to define than dataclasses on the start's path.)"""

    registration_timing: Timing = Timing()
    nvml_call_timeout: float = 10.0
    config_check_interval: float = 2.0
    settings_source: Callable[[], Settings] | None = None
    dra_options: Mapping[str, Any] = MappingProxyType({})
    node_health_options: Mapping[str, Any] = MappingProxyType({})


class Context(NamedTuple):
    """What every part is built from: the settings the agent starts with and the store, the
    node's name, the signal that the agent is stopping, the resources as the kubelet is offered
    them, the simulated driver (if any) and the node's ``/sys`` and ``/proc``, the web config,
    the metrics address (bound first), the probes, whether the process is the agent's alone,
    the :class:`Knobs`, and the parts built so far (every part, once the agent is made)."""

    settings: Settings
    store: DeviceStore
    node_name: str
    stopping: asyncio.Event
    view: ResourceView
    simulator: sim.SimDriver | None
    sysfs_root: Path
    proc_root: Path
    web_config: WebConfigFile | None
    listener: Listener
    probes: AgentProbes
    own_process: bool
    knobs: Knobs
    parts: Parts


class Parts:
    """One agent's parts in their order: started by stage in this order, closed in reverse."""

    def __init__(self, *, own_process: bool) -> None:
        self._parts: list[Part] = []
        self._own_process = own_process

    def __iter__(self) -> Iterator[Part]:
        return iter(self._parts)

    def add(self, part: Part) -> None:
        self._parts.append(part)

    def find(self, kind: type[P]) -> P | None:
        """The part of this kind (``None``: none on this node). A part finds the parts listed
        before it when it is built, and any part once the agent runs."""
        return next((p for p in self._parts if isinstance(p, kind)), None)

    def get(self, kind: type[P]) -> P:
        """The part of this kind, which every agent has."""
        part = self.find(kind)
        if part is None:
            raise LookupError(f"the agent has no {kind.__name__}")
        return part

    def in_stage(self, stage: Stage) -> list[Part]:
        return [part for part in self._parts if part.stage is stage]

    async def start(
        self, stage: Stage, spawn: Callable[[str, Coroutine[Any, Any, None]], None]
    ) -> None:
        """Start the parts of ``stage`` in order, each once its modules are imported (off the
        loop), then spawn their root tasks."""
        parts = self.in_stage(stage)
        for part in parts:
            if part.imports:
                await import_off_loop(part.imports, own_process=self._own_process)
            await part.start()
        for part in parts:
            for name, task in part.tasks().items():
                spawn(name, task())

    async def settle(self, stage: Stage, seconds: float) -> None:
        """Until every part of ``stage`` has settled, for ``seconds`` at most; then each says
        whether it can go on (:meth:`Part.check`)."""
        parts = self.in_stage(stage)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                for part in parts:
                    await part.settled()
        for part in parts:
            part.check()


async def bounded(seconds: float, what: Awaitable[None], *, late: str | None = None) -> None:
    """``what``, given up after ``seconds`` (``late``: the warning said then)."""
    try:
        async with asyncio.timeout(seconds):
            await what
    except TimeoutError:
        if late is not None:
            log.warning(late)
