"""Reloads (:mod:`gpuagent.app.reload`): SIGHUP, or a change of the config file or the web
config's files, checked every ``config_check_interval``; the agent's running settings are the
reloads' (:attr:`ConfigReload.reloads`). Started last: a reload checks the configuration against
the started node (the driver's GPU count) and writes the CDI spec before it publishes the plan."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from gpuagent.app.part import Context, Part, Parts, Task
from gpuagent.app.parts.cdi import Cdi
from gpuagent.app.parts.driver import Driver
from gpuagent.app.reload import Reloads

if TYPE_CHECKING:
    from gpuagent.nodefiles.cdikeeper import CdiSpecKeeper

__all__ = ["ConfigReload", "StartedNode", "build"]


class ConfigReload(Part):
    name = "config-reload"

    def __init__(self, context: Context) -> None:
        knobs = context.knobs
        self.reloads = Reloads(
            context.store,
            context.settings,
            source=knobs.settings_source,
            check_interval=knobs.config_check_interval,
            web_config=context.web_config,
        )
        self.node = StartedNode(context.parts)

    async def start(self) -> None:
        if self.reloads.enabled:
            await self.reloads.look()

    def tasks(self) -> Mapping[str, Task]:
        return {"config-reload": self._run} if self.reloads.enabled else {}

    async def _run(self) -> None:
        await self.reloads.run(self.node)


class StartedNode:
    """What a reload checks the configuration against and updates first (the reloads'
    :class:`~gpuagent.app.reload.Node`), from the started agent's parts."""

    def __init__(self, parts: Parts) -> None:
        self._parts = parts

    @property
    def gpu_count(self) -> int:
        return self._parts.get(Driver).gpu_count

    @property
    def cdi(self) -> CdiSpecKeeper | None:
        part = self._parts.find(Cdi)
        return part.keeper if part is not None else None


def build(context: Context) -> ConfigReload:
    return ConfigReload(context)
