"""The node's CDI spec, when this agent keeps it (:mod:`gpuagent.nodefiles.cdikeeper`).

When the plan starts with CDI (a CDI device-list strategy) the spec is written before the device
plugin registers — the first device list waits for it from the start, as NVIDIA's plugin writes
it before it registers, so no device is offered that cannot be started; otherwise it starts with
the rest (a reload may turn CDI on). Simulated GPUs do not reach the host's real CDI directory by
default.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from gpuagent.app import policy
from gpuagent.app.part import Context, Part, Stage, Task
from gpuagent.config import CDI_SPEC_TOOLKIT
from gpuagent.domain.containers import CDI_SPEC_DIR
from gpuagent.domain.devices import CdiSpec

if TYPE_CHECKING:  # imported off the loop before the part starts
    from gpuagent.nodefiles.cdikeeper import CdiSpecKeeper

__all__ = ["Cdi", "build"]


class Cdi(Part):
    """The CDI spec's keeper (``keeper``, once started)."""

    name = "cdi-spec"
    imports = ("gpuagent.nodefiles.cdikeeper",)

    def __init__(self, context: Context, *, first: bool) -> None:
        self._context = context
        self.stage = Stage.KUBELET if first else Stage.REST
        self.keeper: CdiSpecKeeper | None = None

    async def start(self) -> None:
        from gpuagent.nodefiles.cdikeeper import CdiSpecKeeper  # noqa: PLC0415

        store, settings = self._context.store, self._context.settings
        if self.stage is Stage.KUBELET and settings.cdi_spec != CDI_SPEC_TOOLKIT:
            # The first device list waits for the spec from now on.
            store.update(lambda s: replace(s, cdi=s.cdi or CdiSpec()))
        self.keeper = CdiSpecKeeper(store, policy.cdi_target(settings))

    def tasks(self) -> Mapping[str, Task]:
        assert self.keeper is not None
        return {"cdi-spec": self.keeper.run}


def build(context: Context) -> Cdi | None:
    settings = context.settings
    if context.simulator is not None and settings.cdi_spec_dir == Path(CDI_SPEC_DIR):
        return None
    return Cdi(context, first=context.store.plan.writes_cdi_spec)
