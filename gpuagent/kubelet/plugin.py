"""The DevicePlugin v1beta1 service, answering the kubelet from the device store."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import structlog
from grpclib import GRPCError
from grpclib.const import Status

from gpuagent._proto import v1beta1 as pb
from gpuagent.domain.allocation import (
    AllocationError,
    ContainerAllocation,
    EmptyRequestError,
    UnhealthyDevicesError,
)
from gpuagent.domain.containers import ContainerSettings, allocate
from gpuagent.domain.preferred import preferred_allocation
from gpuagent.domain.resources import Resource
from gpuagent.domain.serving import ResourceView
from gpuagent.domain.snapshot import Snapshot
from gpuagent.kubelet.answers import Answers, Requested
from gpuagent.overrides.grpc import ClosingServerStreams
from gpuagent.state.store import DeviceStore

log = structlog.get_logger("gpuagent.plugin")

DeviceList = tuple[tuple[str, str, int | None], ...]


class DevicePluginService(ClosingServerStreams, pb.DevicePluginBase):
    """Serves one resource's devices. Handlers never raise anything but :class:`GRPCError`.

    A ListAndWatch stream is closed as its handler ends (:class:`ClosingServerStreams`): its
    ``finally`` — the open-stream count, the waiter's cancellation — runs then, not at some later
    garbage collection.
    """

    def __init__(
        self,
        store: DeviceStore,
        view: ResourceView,
        resource_name: str,
        stopping: asyncio.Event,
    ) -> None:
        self._store = store
        self._view = view
        self.resource_name = resource_name
        self._stopping = stopping
        self._answers = Answers()
        self._streams = 0
        self._no_streams = asyncio.Event()
        self._no_streams.set()

    @property
    def open_streams(self) -> int:
        return self._streams

    async def wait_drained(self) -> None:
        """Return once no ListAndWatch stream is open."""
        await self._no_streams.wait()

    async def get_device_plugin_options(self, message: pb.Empty) -> pb.DevicePluginOptions:
        return pb.DevicePluginOptions(
            pre_start_required=False, get_preferred_allocation_available=True
        )

    async def list_and_watch(self, message: pb.Empty) -> AsyncIterator[pb.ListAndWatchResponse]:
        """The full device list now, then again whenever a device's ID, health or NUMA node changes.

        Ends with ``UNAVAILABLE`` when the agent shuts down, so the kubelet stops allocating from a
        plugin that is going away.
        """
        self._streams += 1
        self._no_streams.clear()
        try:
            lists = self._store.watch(self._device_list, until=self._stopping)
            sent = await anext(lists)
            log.info("list-and-watch stream opened", devices=len(sent))
            yield _response(sent)
            async for sent in lists:
                yield _response(sent)
            raise GRPCError(Status.UNAVAILABLE, "gpuagent is shutting down")
        finally:
            # The client left, or the agent stops: the watch waits on nothing between two of
            # its values, and cancelling one cancels its wait. Nothing here awaits, so a second
            # cancellation cannot cut it short.
            self._streams -= 1
            if self._streams == 0:
                self._no_streams.set()
            log.info("list-and-watch stream closed")

    async def allocate(self, message: pb.AllocateRequest) -> pb.AllocateResponse:
        if not message.container_requests:
            raise GRPCError(Status.INVALID_ARGUMENT, "the request has no container requests")
        snapshot = self._store.snapshot
        serving = snapshot.plan.serving
        resource = self._view.resources(snapshot, serving).get(self.resource_name)
        containers = serving.containers
        requested = tuple(tuple(r.devices_ids) for r in message.container_requests)
        response = self._answers.get(resource, containers, requested)
        if response is None:
            allocations = self._allocate(resource, containers, requested)
            response = self._answers.put(resource, containers, requested, allocations)
        for ids in requested:
            log.info("allocated", resource=self.resource_name, devices=list(ids))
        self._store.counters.allocated()
        self._store.allocated()
        return response

    def _allocate(
        self, resource: Resource | None, containers: ContainerSettings, requested: Requested
    ) -> list[ContainerAllocation]:
        """What each container receives; a :class:`GRPCError` for a request that is refused."""
        allocations = []
        for ids in requested:
            try:
                if resource is None:
                    raise EmptyRequestError(f"{self.resource_name} has no devices on this node")
                allocation = allocate(resource, ids, containers)
            except UnhealthyDevicesError as exc:
                reason = _bounded(str(exc))
                log.warning("allocate refused", reason=reason)
                raise GRPCError(Status.FAILED_PRECONDITION, reason) from exc
            except AllocationError as exc:
                reason = _bounded(str(exc))
                log.warning("allocate refused", reason=reason)
                raise GRPCError(Status.INVALID_ARGUMENT, reason) from exc
            allocations.append(allocation)
        return allocations

    def encoded(self, message: object) -> bytes | None:
        """The wire form of ``message`` if it is a kept answer (see
        :class:`~gpuagent.kubelet.answers.ResponseCodec`)."""
        return self._answers.encoded(message)

    async def get_preferred_allocation(
        self, message: pb.PreferredAllocationRequest
    ) -> pb.PreferredAllocationResponse:
        snapshot = self._store.snapshot
        serving = snapshot.plan.serving
        resource = self._view.resources(snapshot, serving).get(self.resource_name)
        scores = self._view.scores(snapshot)
        responses = []
        for request in message.container_requests:
            chosen: list[str] = []
            if resource is not None:
                chosen = preferred_allocation(
                    resource,
                    scores,
                    request.available_deviceIDs,
                    request.must_include_deviceIDs,
                    request.allocation_size,
                    policy=serving.shared_allocation,
                )
            responses.append(pb.ContainerPreferredAllocationResponse(device_i_ds=chosen))
        return pb.PreferredAllocationResponse(container_responses=responses)

    async def pre_start_container(
        self, message: pb.PreStartContainerRequest
    ) -> pb.PreStartContainerResponse:
        return pb.PreStartContainerResponse()

    def _device_list(self, snapshot: Snapshot) -> DeviceList:
        resource = self._view.resources(snapshot, snapshot.plan.serving).get(self.resource_name)
        return () if resource is None else resource.kubelet_devices()


MAX_MESSAGE = 1024


def _bounded(message: str) -> str:
    """An error message short enough for a gRPC trailer, however many IDs a request named."""
    if len(message) <= MAX_MESSAGE:
        return message
    return f"{message[:MAX_MESSAGE]}… (truncated; {len(message)} characters)"


def _response(devices: DeviceList) -> pb.ListAndWatchResponse:
    return pb.ListAndWatchResponse(
        devices=[
            pb.Device(
                id=device_id,
                health=health,
                topology=None if numa is None else pb.TopologyInfo(nodes=[pb.NumaNode(id=numa)]),
            )
            for device_id, health, numa in devices
        ]
    )
