"""One plugin endpoint per resource the node advertises, kept in step with the store.

The resources follow the snapshot and its plan (:class:`~gpuagent.domain.serving.ResourceView`):
after a reload, or when devices change, an endpoint starts for each new resource and the
endpoints of resources no longer advertised are withdrawn — their streams end, their sockets go
and their registration entries leave the store — while the others keep their streams.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from gpuagent.domain.devices import Registration
from gpuagent.domain.naming import socket_name
from gpuagent.domain.serving import ResourceView, awaits_cdi_spec
from gpuagent.domain.snapshot import Snapshot
from gpuagent.kubelet.timing import Timing
from gpuagent.state.store import DeviceStore

if TYPE_CHECKING:  # the gRPC side: imported once a resource is served (see SERVING)
    from gpuagent.kubelet.plugin import DevicePluginService
    from gpuagent.kubelet.registration import PluginEndpoint

__all__ = ["SERVING", "PluginEndpoints"]

log = structlog.get_logger("gpuagent.registration")

STARTING = "starting"  # an endpoint's state until its first attempt says more
# What serves a resource (grpclib, h2, betterproto2, the protos): not imported with this module, so
# the agent can import it off the loop while the driver starts (gpuagent.app.parts.kubelet).
SERVING = ("gpuagent.kubelet.registration",)


@dataclass(slots=True)
class _Served:
    service: DevicePluginService
    endpoint: PluginEndpoint
    task: asyncio.Task[None]


class PluginEndpoints:
    """Serves and registers every advertised resource, for the agent's lifetime.

    ``stopping`` is set when the agent shuts down: every ListAndWatch stream then ends with
    ``UNAVAILABLE``, so the kubelet stops allocating from a plugin that is going away.
    """

    def __init__(
        self,
        store: DeviceStore,
        view: ResourceView,
        stopping: asyncio.Event,
        *,
        socket_dir: Path,
        kubelet_socket: Path,
        timing: Timing = Timing(),
    ) -> None:
        self._store = store
        self._view = view
        self._socket_dir = socket_dir
        self._kubelet_socket = kubelet_socket
        self._timing = timing
        self._stopping = stopping
        self._served: dict[str, _Served] = {}
        self._notes: tuple[str, ...] = ()

    @property
    def endpoints(self) -> dict[str, PluginEndpoint]:
        return {name: served.endpoint for name, served in self._served.items()}

    @property
    def services(self) -> dict[str, DevicePluginService]:
        return {name: served.service for name, served in self._served.items()}

    async def run(self) -> None:
        """Once GPUs are discovered (and, with a CDI strategy, the CDI spec naming them is
        written), serve each advertised resource until cancelled.

        An endpoint never ends by itself: one that fails takes this task (and so the agent's
        supervision) down with its error.
        """
        async for ready in self._store.watch(_ready):
            if ready:
                break
        try:
            async with asyncio.TaskGroup() as group:
                async for advertised in self._store.watch(self._advertised):
                    await self._reconcile(group, *advertised)
        finally:
            for name in list(self._served):
                await self._withdraw(name)

    async def wait_settled(self) -> None:
        """Until every advertised resource has registered or said why it has not (waiting for
        the kubelet, refused, ...): the kubelet's first answer, whatever it was."""
        async for settled in self._store.watch(lambda s: _settled(s.registrations)):
            if settled:
                return

    async def wait_drained(self) -> None:
        """Wait until every ListAndWatch stream has closed (once ``stopping`` is set, each ends
        with ``UNAVAILABLE``)."""
        await asyncio.gather(*(s.service.wait_drained() for s in self._served.values()))

    def _advertised(self, snapshot: Snapshot) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The resources to serve (a node without devices still registers its main resource,
        with no devices, so the kubelet shows capacity 0 rather than a stale value), and the
        notes on what is not advertised."""
        serving = snapshot.plan.serving
        resources = self._view.resources(snapshot, serving)
        return resources.names or (serving.resources.resource_name,), resources.notes

    async def _reconcile(
        self, group: asyncio.TaskGroup, names: tuple[str, ...], notes: tuple[str, ...]
    ) -> None:
        if notes != self._notes:
            self._notes = notes
            for note in notes:
                log.warning("resource note", note=note)
        gone = [name for name in self._served if name not in names]
        new = [name for name in names if name not in self._served]
        for name in gone:
            log.info("resource no longer advertised; stopping its endpoint", resource=name)
            await self._withdraw(name)
        from gpuagent.kubelet.plugin import DevicePluginService  # noqa: PLC0415 (SERVING)
        from gpuagent.kubelet.registration import PluginEndpoint  # noqa: PLC0415

        for name in new:
            service = DevicePluginService(self._store, self._view, name, self._stopping)
            endpoint = PluginEndpoint(
                service,
                self._store,
                socket_path=self._socket_dir / socket_name(name),
                kubelet_socket=self._kubelet_socket,
                resource_name=name,
                timing=self._timing,
            )
            # Not registered until it says so: readiness waits for the new resource too.
            self._store.set_registration(name, Registration(error=STARTING))
            task = group.create_task(endpoint.run(), name=f"kubelet-registration:{name}")
            self._served[name] = _Served(service, endpoint, task)
        if gone or new:
            log.info("serving resources", resources=list(names))

    async def _withdraw(self, name: str) -> None:
        """Stop ``name``'s endpoint and wait for it (its socket is gone when this returns)."""
        served = self._served.pop(name)
        served.task.cancel()
        await asyncio.wait({served.task})
        self._store.set_registration(name, None)


def _ready(snapshot: Snapshot) -> bool:
    """Whether GPUs are discovered and, with a CDI strategy, the CDI spec naming them written."""
    return snapshot.discovered and not awaits_cdi_spec(snapshot, snapshot.plan.serving.containers)


def _settled(registrations: Mapping[str, Registration]) -> bool:
    return bool(registrations) and all(
        r.registered or r.error != STARTING for r in registrations.values()
    )
