"""Allocate's answers: the wire form assembled from pieces is the bytes betterproto2 writes for the
whole message, for any allocation, with pieces kept from earlier answers."""

from __future__ import annotations

from types import MappingProxyType

from hypothesis import given
from hypothesis import strategies as st
from support.nodes import gpu, gpu_uuid, node

from gpuagent._proto import v1beta1 as pb
from gpuagent.domain.allocation import ContainerAllocation, DeviceSpec, MountSpec
from gpuagent.domain.containers import ContainerSettings, DeviceListStrategy, allocate
from gpuagent.domain.resources import Resource
from gpuagent.domain.serving import ResourceView
from gpuagent.kubelet.answers import (
    MAX_CACHED_PIECES,
    Answers,
    ResponseCodec,
    _Pieces,
    container_response,
)

_text = st.text(min_size=0, max_size=40)
_mounts = st.builds(MountSpec, _text, _text, st.booleans())
_devices = st.builds(DeviceSpec, _text, _text, _text)
_maps = st.dictionaries(_text, _text, max_size=4).map(MappingProxyType)
_allocations = st.builds(
    ContainerAllocation,
    envs=_maps,
    mounts=st.lists(_mounts, max_size=4).map(tuple),
    devices=st.lists(_devices, max_size=4).map(tuple),
    annotations=_maps,
    cdi_devices=st.lists(_text, max_size=4).map(tuple),
)
# One set of pieces for every example: what was encoded for one answer is reused by the next.
_SHARED = _Pieces()


def _whole(allocations: list[ContainerAllocation]) -> bytes:
    return bytes(
        pb.AllocateResponse(container_responses=[container_response(a) for a in allocations])
    )


@given(st.lists(_allocations, max_size=3))
def test_the_assembled_wire_form_is_betterproto2s(allocations: list[ContainerAllocation]) -> None:
    assert _SHARED.response(allocations) == _whole(allocations)
    assert pb.AllocateResponse.FromString(_SHARED.response(allocations)) == pb.AllocateResponse(
        container_responses=[container_response(a) for a in allocations]
    )


def test_a_container_response_longer_than_a_varint_byte_and_than_two() -> None:
    for count in (5, 500):  # 180 bytes, 18 KB: their lengths take two and three varint bytes
        mounts = tuple(MountSpec(f"/var/run/devices/{i:04}", "/dev/null") for i in range(count))
        allocation = ContainerAllocation(mounts=mounts)
        assert _Pieces().response([allocation, ContainerAllocation()]) == _whole(
            [allocation, ContainerAllocation()]
        )


def test_the_pieces_kept_are_bounded() -> None:
    pieces = _Pieces()
    for i in range(MAX_CACHED_PIECES + 10):
        allocation = ContainerAllocation(cdi_devices=(f"k8s.device-plugin.nvidia.com/gpu={i}",))
        assert pieces.response([allocation]) == _whole([allocation])
    assert len(pieces._encoded) <= MAX_CACHED_PIECES


def _resource(count: int) -> Resource:
    snapshot = node(*(gpu(i) for i in range(count)))
    found = ResourceView().resources(snapshot, snapshot.plan.serving).get("nvidia.com/gpu")
    assert found is not None
    return found


def test_every_strategy_answers_the_bytes_of_the_message() -> None:
    """Each device-list strategy, with device specs or without, over 8 GPUs: the response sent is
    the response answered, encoded by betterproto2."""
    resource = _resource(8)
    strategies: list[tuple[DeviceListStrategy, ...]] = [(s,) for s in DeviceListStrategy]
    strategies.append((DeviceListStrategy.VOLUME_MOUNTS, DeviceListStrategy.CDI_ANNOTATIONS))
    for chosen in strategies:
        for specs in (False, True):
            containers = ContainerSettings(strategies=chosen, pass_device_specs=specs)
            answers = Answers()
            codec = ResponseCodec(answers.encoded)
            for size in (1, 2, 8):
                requested = (tuple(gpu_uuid(i) for i in range(size)), (gpu_uuid(7),))
                assert answers.get(resource, containers, requested) is None
                allocations = [allocate(resource, ids, containers) for ids in requested]
                response = answers.put(resource, containers, requested, allocations)
                assert answers.get(resource, containers, requested) is response
                assert codec.encode(response, pb.AllocateResponse) == bytes(response)


def test_an_answer_for_other_devices_is_not_kept() -> None:
    """An answer made for a resource or settings other than the last asked about is returned, not
    kept (a snapshot changed between the two)."""
    answers = Answers()
    containers = ContainerSettings()
    old, new = _resource(2), _resource(3)
    requested = ((gpu_uuid(0),),)
    answers.get(new, containers, requested)
    response = answers.put(old, containers, requested, [allocate(old, requested[0], containers)])
    assert answers.encoded(response) is None
    assert answers.get(new, containers, requested) is None
