"""``Allocate``'s answers, kept per device set, and their wire form assembled from encoded pieces.

An answer is a function of the resource (its devices' IDs, health and placement), the plan's
container settings and the request. :class:`Answers` keeps, for the current resource and container
settings (compared on every call: by identity, then by value when a new snapshot or plan brought
new objects), the response to each request it has answered, and its wire form; both go when either
changes (a device turns unhealthy, a reload).

The wire form costs more than the rest of an answer (betterproto2 encodes a response with a GPU's
device nodes in ~0.2 ms), so it is assembled instead: protobuf encodes a repeated field (and a map)
as its elements one after another, so a container's response is the concatenation of its parts,
each encoded alone — an environment variable, a mount, a device node, an annotation, a CDI name —
and each part is encoded once per device set and kept (:class:`_Pieces`). The bytes are the ones
betterproto2 writes for the whole message (the tests compare them).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

from grpclib.encoding.proto import ProtoCodec

from gpuagent._proto import v1beta1 as pb
from gpuagent.domain.allocation import ContainerAllocation, DeviceSpec, MountSpec
from gpuagent.domain.containers import ContainerSettings
from gpuagent.domain.resources import Resource

__all__ = [
    "MAX_CACHED_PIECES",
    "MAX_CACHED_RESPONSES",
    "Answers",
    "ResponseCodec",
    "container_response",
]

MAX_CACHED_RESPONSES = 256
MAX_CACHED_PIECES = 4096
Requested = tuple[tuple[str, ...], ...]
_CONTAINER_RESPONSES = 1  # AllocateResponse.container_responses: field 1, length-delimited


class Answers:
    """Allocate responses per requested device IDs, and their wire form, for one device set.

    At most :data:`MAX_CACHED_RESPONSES` requests are kept.
    """

    def __init__(self) -> None:
        self._resource: Resource | None = None
        self._containers: ContainerSettings | None = None
        self._responses: dict[Requested, pb.AllocateResponse] = {}
        self._encoded: dict[int, bytes] = {}  # id of a response held above -> its wire form
        self._pieces = _Pieces()

    def get(
        self, resource: Resource | None, containers: ContainerSettings, requested: Requested
    ) -> pb.AllocateResponse | None:
        """The response kept for ``requested`` under ``resource`` and ``containers``, if any."""
        if resource is not self._resource or containers is not self._containers:
            if resource != self._resource or containers != self._containers:
                self._responses.clear()
                self._encoded.clear()
                self._pieces.clear()
            self._resource, self._containers = resource, containers
        return self._responses.get(requested)

    def put(
        self,
        resource: Resource | None,
        containers: ContainerSettings,
        requested: Requested,
        allocations: Sequence[ContainerAllocation],
    ) -> pb.AllocateResponse:
        """The response giving each container its allocation, kept with its wire form (unless
        ``resource`` or ``containers`` are not those of the last :meth:`get`)."""
        response = pb.AllocateResponse(
            container_responses=[container_response(a) for a in allocations]
        )
        if resource is not self._resource or containers is not self._containers:
            return response  # (get() for these was not the last call)
        if len(self._responses) >= MAX_CACHED_RESPONSES:
            self._responses.clear()
            self._encoded.clear()
        self._responses[requested] = response
        self._encoded[id(response)] = self._pieces.response(allocations)
        return response

    def encoded(self, message: object) -> bytes | None:
        """The wire form of ``message`` if it is a kept response."""
        return self._encoded.get(id(message))


class _Pieces:
    """Each part of a container's response, encoded once (at most :data:`MAX_CACHED_PIECES`)."""

    def __init__(self) -> None:
        self._encoded: dict[Hashable, bytes] = {}

    def clear(self) -> None:
        self._encoded.clear()

    def response(self, allocations: Sequence[ContainerAllocation]) -> bytes:
        """The wire form of an ``AllocateResponse`` with one response per allocation."""
        return b"".join(
            _length_delimited(_CONTAINER_RESPONSES, self._container(a)) for a in allocations
        )

    def _container(self, allocation: ContainerAllocation) -> bytes:
        """A ``ContainerAllocateResponse``'s wire form: its fields in their numbers' order, each
        element in its order, as betterproto2 writes the whole message."""
        piece = self._piece
        parts = [piece(("env", k, v), _env) for k, v in allocation.envs.items()]
        parts += [piece(m, _mount) for m in allocation.mounts]
        parts += [piece(d, _device) for d in allocation.devices]
        parts += [piece(("note", k, v), _annotation) for k, v in allocation.annotations.items()]
        parts += [piece(("cdi", name), _cdi_device) for name in allocation.cdi_devices]
        return b"".join(parts)

    def _piece(self, key: Any, build: Callable[[Any], pb.ContainerAllocateResponse]) -> bytes:
        data = self._encoded.get(key)
        if data is None:
            if len(self._encoded) >= MAX_CACHED_PIECES:
                self._encoded.clear()
            data = self._encoded[key] = bytes(build(key))
        return data


def _env(key: tuple[str, str, str]) -> pb.ContainerAllocateResponse:
    return pb.ContainerAllocateResponse(envs={key[1]: key[2]})


def _mount(m: MountSpec) -> pb.ContainerAllocateResponse:
    return pb.ContainerAllocateResponse(mounts=[_pb_mount(m)])


def _device(d: DeviceSpec) -> pb.ContainerAllocateResponse:
    return pb.ContainerAllocateResponse(devices=[_pb_device(d)])


def _annotation(key: tuple[str, str, str]) -> pb.ContainerAllocateResponse:
    return pb.ContainerAllocateResponse(annotations={key[1]: key[2]})


def _cdi_device(key: tuple[str, str]) -> pb.ContainerAllocateResponse:
    return pb.ContainerAllocateResponse(cdi_devices=[pb.CdiDevice(name=key[1])])


def _length_delimited(field: int, payload: bytes) -> bytes:
    """A length-delimited field: its key, the payload's length as a varint, the payload."""
    size, length = len(payload), bytearray()
    while size > 0x7F:
        length.append(size & 0x7F | 0x80)
        size >>= 7
    length.append(size)
    return bytes((field << 3 | 2,)) + length + payload


def _pb_mount(m: MountSpec) -> pb.Mount:
    return pb.Mount(container_path=m.container_path, host_path=m.host_path, read_only=m.read_only)


def _pb_device(d: DeviceSpec) -> pb.DeviceSpec:
    return pb.DeviceSpec(
        container_path=d.container_path, host_path=d.host_path, permissions=d.permissions
    )


def container_response(allocation: ContainerAllocation) -> pb.ContainerAllocateResponse:
    """What one container receives, as the kubelet's message."""
    return pb.ContainerAllocateResponse(
        envs=dict(allocation.envs),
        mounts=[_pb_mount(m) for m in allocation.mounts],
        devices=[_pb_device(d) for d in allocation.devices],
        annotations=dict(allocation.annotations),
        cdi_devices=[pb.CdiDevice(name=name) for name in allocation.cdi_devices],
    )


class ResponseCodec(ProtoCodec):
    """grpclib's protobuf codec, sending a kept response's wire form as it was assembled."""

    def __init__(self, encoded: Callable[[object], bytes | None]) -> None:
        self._encoded = encoded

    def encode(self, message: Any, message_type: Any) -> bytes:
        data = self._encoded(message)
        return data if data is not None else super().encode(message, message_type)
