"""The pod-resources client, when the agent serves Kubernetes: which pods hold which devices,
listed every ``--pod-resources-interval`` and soon after an allocation
(:mod:`gpuagent.kubelet.podresources`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from gpuagent.app.part import Context, Part, Task

if TYPE_CHECKING:  # imported off the loop before the part starts
    from gpuagent.kubelet.podresources import PodResourcesClient

__all__ = ["PodResources", "build"]


class PodResources(Part):
    name = "pod-resources"
    imports = ("gpuagent.kubelet.podresources",)

    def __init__(self, context: Context) -> None:
        self._context = context
        self.client: PodResourcesClient | None = None

    async def start(self) -> None:
        from gpuagent.kubelet.podresources import PodResourcesClient  # noqa: PLC0415

        settings = self._context.settings
        self.client = PodResourcesClient(
            self._context.store,
            settings.pod_resources_socket,
            interval=settings.pod_resources_interval,
        )

    def tasks(self) -> Mapping[str, Task]:
        assert self.client is not None
        return {"pod-resources": self.client.run}


def build(context: Context) -> PodResources | None:
    return PodResources(context) if context.settings.kubernetes else None
