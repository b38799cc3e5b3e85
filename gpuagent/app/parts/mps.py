"""The MPS control daemons the device plugin's resources and the GPUs shared through DRA need
(:mod:`gpuagent.mps.manager`), kept for the agent's life from the registration on: a shared
device is unhealthy until its daemon is up.

Nothing of MPS is imported until the plan first shares a resource or a DRA GPU through it (at
start, or at a reload): most nodes never do, and the start before the registration stays lean.
The GPUs' compute modes are set through the driver unless left as they are; the daemons are told
to quit and the compute modes set back when the task is cancelled.
"""

from __future__ import annotations

from collections.abc import Mapping

from gpuagent.app.part import Context, Part, Stage, Task
from gpuagent.app.parts.driver import Driver
from gpuagent.config.planning import driver_root_as_read
from gpuagent.domain.drashare import DraSharing
from gpuagent.domain.mps import ComputeModeChoice, MpsDirs
from gpuagent.domain.snapshot import Snapshot

__all__ = ["Mps", "build"]


class Mps(Part):
    name = "mps"
    stage = Stage.KUBELET

    def __init__(self, context: Context) -> None:
        self._context = context

    def tasks(self) -> Mapping[str, Task]:
        return {"mps-daemons": self._keep}

    async def _keep(self) -> None:
        store = self._context.store
        async for shared in store.watch(_shares_through_mps):
            if shared:
                break
        from gpuagent.gpu.computemode import ComputeModes  # noqa: PLC0415
        from gpuagent.mps.manager import MpsDaemons  # noqa: PLC0415

        settings, nvml = self._context.settings, self._context.parts.get(Driver).nvml
        assert nvml is not None
        modes = None
        if settings.mps_compute_mode is ComputeModeChoice.EXCLUSIVE_PROCESS:
            modes = ComputeModes(nvml)
        daemons = MpsDaemons(
            store,
            self._context.view,
            dirs=MpsDirs(str(settings.mps_root)),
            driver_root=driver_root_as_read(settings),
            compute_modes=modes,
        )
        await daemons.run()


def _shares_through_mps(snapshot: Snapshot) -> bool:
    plan = snapshot.plan
    return plan.serving.resources.mps.enabled or plan.dra.sharing is DraSharing.MPS


def build(context: Context) -> Mps:
    return Mps(context)
