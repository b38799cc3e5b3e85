"""The device plugin: an endpoint per resource, registered with the kubelet and kept so across
its restarts (:mod:`gpuagent.kubelet.endpoints`), when the agent serves Kubernetes.

What serves it (grpclib, h2, betterproto2, the protos) is imported on a thread while the driver
starts. The rest waits (2 s at most) for the kubelet's first answer; at shutdown the
ListAndWatch streams end with ``UNAVAILABLE`` first, so the kubelet stops allocating from a
plugin that is going away.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

from gpuagent.app.part import Context, Part, Stage, Task
from gpuagent.kubelet.endpoints import SERVING, PluginEndpoints

__all__ = ["Kubelet", "build"]


class Kubelet(Part):
    name = "kubelet"
    stage = Stage.KUBELET
    imports = SERVING

    def __init__(self, context: Context) -> None:
        self._context = context
        settings = context.settings
        self.endpoints = PluginEndpoints(
            context.store,
            context.view,
            context.stopping,
            socket_dir=settings.socket_dir,
            kubelet_socket=settings.kubelet_socket,
            timing=context.knobs.registration_timing,
        )
        self._ended = asyncio.Event()

    def tasks(self) -> Mapping[str, Task]:
        return {"kubelet-registration": self._register}

    async def settled(self) -> None:
        """Once the GPUs are discovered: until every endpoint has registered or said why not,
        or the registration task ended."""
        if not self._context.store.snapshot.discovered:
            return
        waits = {
            asyncio.create_task(self.endpoints.wait_settled(), name="registration-settled"),
            asyncio.create_task(self._ended.wait(), name="registration-ended"),
        }
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()

    async def drain(self) -> None:
        await self.endpoints.wait_drained()

    async def _register(self) -> None:
        try:
            await self.endpoints.run()
        finally:
            self._ended.set()


def build(context: Context) -> Kubelet | None:
    return Kubelet(context) if context.settings.kubernetes else None
