"""The DRA device-health services the kubelet calls on ``dra.sock`` (``NodeWatchResources``,
KEP-4680, v1 and v1alpha1): every DRA device's health as a full list, on every change and again
every ``resend_s`` so the kubelet's health timeout never fires."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from types import ModuleType
from typing import Any

from gpuagent._proto import v1 as health_v1
from gpuagent._proto import v1alpha1 as health_v1alpha1
from gpuagent.domain.snapshot import Snapshot
from gpuagent.dra.service import DeviceSource, DraConfig
from gpuagent.state.clock import Clock, LoopClock
from gpuagent.state.store import DeviceStore

__all__ = ["DeviceHealthStreams", "HealthList", "HealthV1", "HealthV1Alpha1"]

MAX_HEALTH_MESSAGE = 1024

HealthList = tuple[tuple[str, bool, str], ...]


class DeviceHealthStreams:
    """What both health services send: every DRA device's health, as a full list, now and
    whenever it changes, and again every ``resend_s`` so the kubelet's timeout never fires."""

    def __init__(
        self,
        store: DeviceStore,
        devices: DeviceSource,
        config: DraConfig,
        stopping: asyncio.Event,
        *,
        resend_s: float = 20.0,
        clock: Callable[[], float] = time.time,
        waits: Clock | None = None,
    ) -> None:
        self._store = store
        self._devices = devices
        self._config = config
        self._stopping = stopping
        self._resend_s = resend_s
        self._clock = clock  # the wall time each message is stamped with
        self._waits = waits or LoopClock()  # what the resends are timed by
        self.open_streams = 0

    def current(self, snapshot: Snapshot) -> HealthList:
        return tuple((d.name, d.healthy, d.reason) for d in self._devices(snapshot))

    async def updates(self) -> AsyncIterator[HealthList]:
        """The health list now, then on every change (or resend); ends when the agent stops."""
        self.open_streams += 1
        try:
            watch = self._store.watch(self.current, until=self._stopping, clock=self._waits)
            devices = await anext(watch)
            while True:
                resend_at = self._waits.now() + self._resend_s
                yield devices
                try:
                    devices = await watch.next(resend_at)
                except StopAsyncIteration:
                    return
        finally:
            self.open_streams -= 1

    async def responses(self, api: ModuleType) -> AsyncIterator[Any]:
        """The health API ``api``'s ``NodeWatchResourcesResponse`` for each of :meth:`updates`
        (``v1`` and ``v1alpha1`` have the same messages, each in its own package)."""
        async for devices in self.updates():
            now = self.now()
            yield api.NodeWatchResourcesResponse(
                devices=[
                    api.DeviceHealth(
                        device=api.DeviceIdentifier(pool_name=self.pool, device_name=name),
                        health=api.HealthStatus.HEALTHY if healthy else api.HealthStatus.UNHEALTHY,
                        last_updated_time=now,
                        health_check_timeout_seconds=self.timeout_s,
                        message=reason[:MAX_HEALTH_MESSAGE],
                    )
                    for name, healthy, reason in devices
                ]
            )

    def now(self) -> int:
        return int(self._clock())

    @property
    def pool(self) -> str:
        return self._config.pool

    @property
    def timeout_s(self) -> int:
        return self._config.health_timeout_s


class HealthV1(health_v1.DraResourceHealthBase):
    """``v1.DRAResourceHealth``."""

    def __init__(self, streams: DeviceHealthStreams) -> None:
        self._streams = streams

    async def node_watch_resources(
        self, message: health_v1.NodeWatchResourcesRequest
    ) -> AsyncIterator[health_v1.NodeWatchResourcesResponse]:
        async for response in self._streams.responses(health_v1):
            yield response


class HealthV1Alpha1(health_v1alpha1.DraResourceHealthBase):
    """``v1alpha1.DRAResourceHealth`` (kubelets before the v1 health API)."""

    def __init__(self, streams: DeviceHealthStreams) -> None:
        self._streams = streams

    async def node_watch_resources(
        self, message: health_v1alpha1.NodeWatchResourcesRequest
    ) -> AsyncIterator[health_v1alpha1.NodeWatchResourcesResponse]:
        async for response in self._streams.responses(health_v1alpha1):
            yield response
