"""Per-container GPU accounting, when ``--container-accounting`` is on: each process's cgroup,
its container's names (the kubelet's log links, then the CRI), joined by
:mod:`gpuagent.runtime.accountant`."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

import structlog

from gpuagent.app.part import Context, Part, Task

if TYPE_CHECKING:  # imported off the loop before the part starts
    from gpuagent.runtime.accountant import Accountant

__all__ = ["Accounting", "build"]

log = structlog.get_logger("gpuagent")


class Accounting(Part):
    name = "accounting"
    imports = (
        "gpuagent.runtime.accountant",
        "gpuagent.runtime.cri",
        "gpuagent.runtime.loglinks",
        "gpuagent.runtime.procfs",
    )

    def __init__(self, context: Context) -> None:
        self._context = context
        self.accountant: Accountant | None = None

    async def start(self) -> None:
        from gpuagent.runtime.accountant import Accountant  # noqa: PLC0415
        from gpuagent.runtime.cri import CriClient  # noqa: PLC0415
        from gpuagent.runtime.loglinks import LogLinks  # noqa: PLC0415
        from gpuagent.runtime.procfs import ProcReader  # noqa: PLC0415

        settings = self._context.settings
        links = LogLinks(settings.container_logs_dir) if settings.kubernetes else None
        self.accountant = Accountant(
            self._context.store,
            ProcReader(settings.proc_root),
            CriClient(settings.cri_socket),
            links,
        )
        warn_of_a_pid_namespace()

    def tasks(self) -> Mapping[str, Task]:
        assert self.accountant is not None
        return {"gpu-accounting": self.accountant.run}


def warn_of_a_pid_namespace() -> None:
    """Say so when the agent is PID 1 of its own PID namespace, where NVML lists no other
    container's processes."""
    if os.getpid() == 1:
        log.warning(
            "container accounting is on, but the agent is PID 1 of its own PID "
            "namespace: NVML lists no other container's processes (run it in the host's "
            "PID namespace, or set container-accounting: false)"
        )


def build(context: Context) -> Accounting | None:
    return Accounting(context) if context.settings.container_accounting else None
