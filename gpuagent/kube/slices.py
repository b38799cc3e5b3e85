"""Keeping this node's ResourceSlices equal to its DRA devices, through outages of the API server.

On every store change the devices are derived again; when they differ from what was published,
the node's slices are listed, written (create or replace, with the pool's generation one above
the highest seen) and any left over deleted. An unreachable or refusing API server is retried
with exponential backoff; meanwhile :attr:`SlicePublisher.error` says why (``/readyz``, metrics)
and the device plugin side goes on untouched.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import structlog

from gpuagent.domain.dra import DraDevice
from gpuagent.domain.slices import slice_manifests
from gpuagent.domain.snapshot import Snapshot
from gpuagent.kube.client import ApiError, ApiUnreachable, KubeApi
from gpuagent.state.store import DeviceStore

log = structlog.get_logger("gpuagent.dra.slices")


@dataclass(frozen=True, slots=True)
class Backoff:
    """Retry delays: doubling from ``initial`` up to ``maximum`` seconds."""

    initial: float = 0.5
    maximum: float = 30.0


class SlicePublisher:
    """Publishes the node's DRA devices as ResourceSlices; runs until cancelled."""

    def __init__(
        self,
        store: DeviceStore,
        devices: Callable[[Snapshot], tuple[DraDevice, ...]],
        api: KubeApi,
        *,
        node: str,
        driver: str,
        backoff: Backoff = Backoff(),
    ) -> None:
        self._store = store
        self._devices = devices
        self._api = api
        self._node = node
        self._driver = driver
        self._backoff = backoff
        self._node_uid: str | None = None
        self.published: tuple[DraDevice, ...] | None = None
        self.generation = 0
        self.error = "not published yet"
        self.up = False
        self.writes = 0
        self.failures = 0
        # Seconds from a store change to its slices written, per publication.
        self.publish_seconds: list[float] = []

    async def run(self) -> None:
        delay = self._backoff.initial
        wanted = self._store.watch(self._wanted)
        devices = await anext(wanted)
        while True:
            if devices is None:  # not discovered yet
                devices = await anext(wanted)
                continue
            started = time.perf_counter()
            try:
                wrote = await self._publish(devices)
            except (ApiUnreachable, ApiError) as exc:
                self.up = False
                self.failures += 1
                error = f"API server: {exc}"
                # Once per error, not on every retry (they back off up to the maximum).
                (log.warning if error != self.error else log.debug)(
                    "resource slices not published; retrying", error=error, delay=delay
                )
                self.error = error
                await asyncio.sleep(delay)
                delay = min(delay * 2, self._backoff.maximum)
                devices = wanted.now()  # retried with the devices as they are by then
                continue
            delay = self._backoff.initial
            if not self.up:
                log.info("resource slices published", generation=self.generation)
            self.up = True
            self.error = ""
            if wrote and len(self.publish_seconds) < 100_000:
                self.publish_seconds.append(time.perf_counter() - started)
            devices = await anext(wanted)

    def _wanted(self, snapshot: Snapshot) -> tuple[DraDevice, ...] | None:
        """The devices to publish; ``None`` until the GPUs are discovered."""
        return self._devices(snapshot) if snapshot.discovered else None

    async def _publish(self, devices: tuple[DraDevice, ...]) -> bool:
        if devices == self.published:
            return False
        if self._node_uid is None:
            self._node_uid = await self._api.node_uid(self._node)
        existing = {
            s["metadata"]["name"]: s for s in await self._api.slices(self._node, self._driver)
        }
        seen = max((_generation(s) for s in existing.values()), default=0)
        current = slice_manifests(
            devices, node=self._node, node_uid=self._node_uid, driver=self._driver, generation=seen
        )
        if seen and _same(current, existing):
            # Already there (an agent restart): adopt it without a write.
            self.generation, self.published = seen, devices
            return False
        wanted = slice_manifests(
            devices,
            node=self._node,
            node_uid=self._node_uid,
            driver=self._driver,
            generation=seen + 1,
        )
        for manifest in wanted:
            old = existing.pop(manifest["metadata"]["name"], None)
            if old is None:
                await self._api.create_slice(manifest)
            else:
                manifest["metadata"]["resourceVersion"] = old["metadata"]["resourceVersion"]
                await self._api.replace_slice(manifest)
            self.writes += 1
        for name in existing:
            await self._api.delete_slice(name)
        self.generation, self.published = seen + 1, devices
        log.info("resource slices written", generation=self.generation, devices=len(devices))
        return True


def _generation(obj: Mapping[str, Any]) -> int:
    pool = obj.get("spec", {}).get("pool", {})
    value = pool.get("generation", 0)
    return value if isinstance(value, int) else 0


def _comparable(obj: Mapping[str, Any]) -> Any:
    spec = dict(obj.get("spec", {}))
    devices = []
    for device in spec.get("devices") or []:
        copy = dict(device)
        if "taints" in copy:  # the API server stamps timeAdded
            copy["taints"] = [
                {k: v for k, v in t.items() if k != "timeAdded"} for t in copy["taints"]
            ]
        devices.append(copy)
    spec["devices"] = devices
    return spec


def _same(wanted: list[dict[str, Any]], existing: Mapping[str, Mapping[str, Any]]) -> bool:
    if {m["metadata"]["name"] for m in wanted} != set(existing):
        return False
    return all(_comparable(m) == _comparable(existing[m["metadata"]["name"]]) for m in wanted)
