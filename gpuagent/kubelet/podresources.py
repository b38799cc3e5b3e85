"""Pod attribution from the kubelet's pod-resources API (``v1.PodResourcesLister/List``).

The mapping from device IDs to containers is cached in the store (``Snapshot.pods``) and refreshed
in the background — never by a scrape (dcgm-exporter #599):

* soon after each successful ``Allocate`` or DRA claim prepared (the store's news of it,
  :meth:`~gpuagent.state.store.DeviceStore.allocated`, debounced, with a few
  follow-up Lists while the kubelet has not recorded the allocation yet);
* on a slow backstop timer (``--pod-resources-interval``, default 30 s) otherwise.

The socket may be absent (pod-resources not mounted) or vanish and come back (kubelet restart):
the last known mapping is kept with its age, the failure is logged once per change of state, and
the client tries again on its timer. A recreated socket (new inode or ctime) gets a new
connection. grpclib has no receive-size limit (unlike grpc-go's 4 MiB default, dcgm-exporter #509);
responses are bounded here at :data:`MAX_RESPONSE_BYTES`.
"""

from __future__ import annotations

import contextlib
import os
import stat
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import structlog
from grpclib.client import Channel
from grpclib.config import Configuration
from grpclib.encoding.proto import ProtoCodec

from gpuagent._proto import v1 as pb
from gpuagent.domain.devices import Allocated, Attribution
from gpuagent.domain.drapods import claimed_resource
from gpuagent.domain.snapshot import Snapshot
from gpuagent.logs import ProblemLog
from gpuagent.state.clock import Clock, LoopClock
from gpuagent.state.store import DeviceStore

__all__ = ["MAX_RESPONSE_BYTES", "Clock", "LoopClock", "PodResourcesClient"]

log = structlog.get_logger("gpuagent.podresources")

# 64 times grpc-go's default; a node would need ~100,000 containers with devices to reach it.
MAX_RESPONSE_BYTES = 256 * 1024 * 1024
# HTTP/2 flow-control windows: large responses arrive in few round trips.
_WINDOW = 16 * 1024 * 1024


class ResponseTooLarge(ValueError):
    pass


class _BoundedCodec(ProtoCodec):
    """grpclib's protobuf codec, refusing to decode a response above :data:`MAX_RESPONSE_BYTES`."""

    def __init__(self, limit: int) -> None:
        self._limit = limit

    def decode(self, data: bytes, message_type: Any) -> Any:
        if len(data) > self._limit:
            raise ResponseTooLarge(f"response of {len(data)} bytes exceeds {self._limit}")
        return super().decode(data, message_type)


class PodResourcesClient:
    """Keeps ``Snapshot.pods`` current from the kubelet's pod-resources socket."""

    def __init__(
        self,
        store: DeviceStore,
        socket_path: Path,
        *,
        interval: float = 30.0,
        debounce: float = 0.25,
        follow_ups: tuple[float, ...] = (0.5, 1.0, 2.0),
        timeout: float = 10.0,
        max_response_bytes: int = MAX_RESPONSE_BYTES,
        monotonic: Callable[[], float] = time.monotonic,
        clock: Clock | None = None,
    ) -> None:
        self._store = store
        self._socket = socket_path
        self._interval = interval
        self._debounce = debounce
        self._follow_ups = follow_ups
        self._timeout = timeout
        self._max_response = max_response_bytes
        self._monotonic = monotonic  # stamps the mapping (its age on /metrics)
        self._clock = clock or LoopClock()  # times the waits: tests move it by hand
        self._channel: Channel | None = None
        self._identity: tuple[int, int] | None = None
        self._problems = ProblemLog(log)

    async def run(self) -> None:
        """Refresh now, then after each allocation the store tells of and on the backstop timer,
        until cancelled."""
        try:
            await self.refresh()
            while True:
                if await self._wait_allocation(self._interval):
                    await self._after_allocate()
                else:
                    await self.refresh()
        finally:
            self.close()

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    async def refresh(self) -> bool:
        """One ``List``; returns whether the allocations changed. Never raises (but cancellation).

        Every device-plugin resource is kept as listed: which are this agent's is the plan's
        business, decided when the mapping is read (a reload needs no new ``List``).
        """
        before = self._store.snapshot.pods.allocated
        identity = _socket_identity(self._socket)
        if identity is None:
            self.close()
            self._identity = None
            self._failed(
                "pod-resources socket absent; no pod labels until it appears", present=False
            )
            return False
        if identity != self._identity:
            self.close()  # a new socket: the kubelet restarted
            self._identity = identity
        if self._channel is None:
            self._channel = Channel(
                path=str(self._socket),
                codec=_BoundedCodec(self._max_response),
                config=Configuration(
                    http2_connection_window_size=_WINDOW, http2_stream_window_size=_WINDOW
                ),
            )
        try:
            response = await pb.PodResourcesListerStub(self._channel).list(
                pb.ListPodResourcesRequest(), timeout=self._timeout
            )
            allocated = tuple(sorted(set(_allocations(response)), key=_order))
        except Exception as exc:  # any transport, status or decode error: keep the old mapping
            self.close()
            self._failed(f"pod-resources List failed: {type(exc).__name__}: {exc}", present=True)
            return False
        self._store.counters.pod_resources_listed(socket_present=True, ok=True)
        now = self._monotonic()
        self._store.update(
            lambda s: replace(s, pods=Attribution(allocated=allocated, refreshed_at=now))
        )
        self._problems.recovered("pod-resources List works again", containers=len(allocated))
        return allocated != before

    def _failed(self, problem: str, *, present: bool) -> None:
        self._store.counters.pod_resources_listed(socket_present=present, ok=False)
        self._problems.failed(problem, socket=str(self._socket))
        self._store.update(lambda s: _with_error(s, problem))

    async def _wait_allocation(self, seconds: float) -> bool:
        return await self._clock.wait(self._store.allocations, seconds)

    async def _after_allocate(self) -> None:
        while True:
            await self._coalesce()
            before = self._store.snapshot.pods.allocated
            if await self.refresh():
                return
            # The kubelet records an allocation after our answer reaches it: look again shortly.
            for delay in self._follow_ups:
                if await self._wait_allocation(delay):
                    break  # another Allocate meanwhile: start over
                await self.refresh()
                if self._store.snapshot.pods.allocated != before:
                    return
            else:
                return

    async def _coalesce(self) -> None:
        """Wait until Allocates pause for ``debounce`` (a pod's containers, a gang of pods)."""
        deadline = self._clock.now() + 4 * self._debounce
        while True:
            self._store.allocations.clear()
            remaining = deadline - self._clock.now()
            if remaining <= 0 or not await self._wait_allocation(min(self._debounce, remaining)):
                return


def _with_error(snapshot: Snapshot, problem: str) -> Snapshot:
    return replace(snapshot, pods=replace(snapshot.pods, error=problem))


def _socket_identity(path: Path) -> tuple[int, int] | None:
    with contextlib.suppress(OSError):
        st = os.stat(path)
        if stat.S_ISSOCK(st.st_mode):
            return st.st_ino, st.st_ctime_ns
    return None


def _order(item: Allocated) -> tuple[str, str, str, str, tuple[str, ...]]:
    return (item.namespace, item.pod, item.container, item.resource, item.device_ids)


def _allocations(response: pb.ListPodResourcesResponse) -> Iterator[Allocated]:
    """Each container's device-plugin devices by resource, and each device of its
    ResourceClaims under its driver's :func:`claimed_resource` (see domain/drapods.py)."""
    for pod in response.pod_resources:
        for container in pod.containers:
            for devices in container.devices:
                yield Allocated(
                    namespace=pod.namespace,
                    pod=pod.name,
                    container=container.name,
                    resource=devices.resource_name,
                    device_ids=tuple(devices.device_ids),
                )
            for dynamic in container.dynamic_resources:
                for claimed in dynamic.claim_resources:
                    if claimed.driver_name and claimed.device_name:
                        yield Allocated(
                            namespace=pod.namespace,
                            pod=pod.name,
                            container=container.name,
                            resource=claimed_resource(claimed.driver_name),
                            device_ids=(claimed.device_name,),
                            claim=f"{dynamic.claim_namespace}/{dynamic.claim_name}",
                        )
