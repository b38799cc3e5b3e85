"""Pod attribution: kubelet device IDs → GPUs and MIG devices, for every ID spelling."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st
from support.synthetic import gpu_uuid, mig_uuid, pods_by_device, synthetic_snapshot

from gpuagent.domain.attribution import (
    Allocated,
    DeviceIndex,
    Target,
    attributable,
    attributions,
    base_id,
    by_device,
)
from gpuagent.domain.devices import PodRef

SERVED = ("nvidia.com/gpu",)


@pytest.mark.parametrize(
    ("device_id", "expected"),
    [
        pytest.param("GPU-abc", "GPU-abc", id="uuid"),
        pytest.param("GPU-abc::3", "GPU-abc", id="replica"),
        pytest.param("GPU-abc::12", "GPU-abc", id="replica-two-digits"),
        pytest.param("MIG-abc::1", "MIG-abc", id="eks-mig"),
        pytest.param("0::4", "0", id="index-replica"),
        pytest.param("0:1", "0:1", id="mig-index"),
        pytest.param("0:1::2", "0:1", id="mig-index-replica"),
        pytest.param("nvidia0/vgpu3", "nvidia0", id="gke-shared"),
        pytest.param("nvidia0/gi2/vgpu1", "nvidia0/gi2", id="gke-mig-shared"),
        pytest.param("GPU-abc::", "GPU-abc::", id="empty-replica-kept"),
        pytest.param("GPU-abc::x", "GPU-abc::x", id="non-numeric-replica-kept"),
    ],
)
def test_base_id(device_id: str, expected: str) -> None:
    assert base_id(device_id) == expected


@pytest.mark.parametrize(
    ("resource", "expected"),
    [
        ("nvidia.com/gpu", True),
        ("nvidia.com/mig-1g.10gb", True),
        ("nvidia.com/gpu.shared", False),
        ("example.com/fpga", False),
        ("nvidia.com/mig", False),
    ],
)
def test_attributable(resource: str, expected: bool) -> None:
    assert attributable(resource, SERVED) is expected


def test_by_device_filters_dedups_and_sorts() -> None:
    mapping = by_device(
        [
            Allocated("ns", "b", "c", "nvidia.com/gpu", ("GPU-1", "GPU-2::0")),
            Allocated("ns", "a", "c", "nvidia.com/gpu", ("GPU-1",)),
            Allocated("ns", "a", "c", "nvidia.com/gpu", ("GPU-1",)),
            Allocated("ns", "x", "c", "example.com/fpga", ("GPU-1", "fpga-0")),
            Allocated("ns", "m", "c", "nvidia.com/mig-1g.10gb", ("MIG-9",)),
            Allocated("ns", "e", "c", "nvidia.com/gpu", ("",)),
        ],
        SERVED,
    )
    assert dict(mapping) == {
        "GPU-1": (PodRef("ns", "a", "c"), PodRef("ns", "b", "c")),
        "GPU-2::0": (PodRef("ns", "b", "c"),),
        "MIG-9": (PodRef("ns", "m", "c"),),
    }
    assert list(mapping) == sorted(mapping)


def test_mig_resources_of_a_served_domain() -> None:
    assert attributable("example.com/mig-1g.10gb", ("example.com/gpu",))
    assert not attributable("example.com/mig-1g.10gb", SERVED)
    assert not attributable("example.com/gpu.shared", ("example.com/gpu",))


def test_by_device_serves_configured_resource_names() -> None:
    held = [Allocated("ns", "p", "c", "example.com/a100", ("GPU-1",))]
    assert by_device(held, SERVED) == {}
    assert dict(by_device(held, ("example.com/a100",))) == {"GPU-1": (PodRef("ns", "p", "c"),)}


@pytest.fixture
def index() -> DeviceIndex:
    snapshot = synthetic_snapshot(2)
    mig = synthetic_snapshot(2, mig=True)
    # GPU 0 whole, GPU 1 MIG-enabled with seven 1g instances (GI ids 7..13).
    return DeviceIndex((snapshot.gpus[0], replace(mig.gpus[1], minor=5)))


@pytest.mark.parametrize(
    ("device_id", "expected"),
    [
        pytest.param(gpu_uuid(0), Target(0), id="gpu-uuid"),
        pytest.param(gpu_uuid(0) + "::7", Target(0), id="gpu-uuid-replica"),
        pytest.param("0", Target(0), id="index"),
        pytest.param("0::3", Target(0), id="index-replica"),
        pytest.param("nvidia0", Target(0), id="device-name"),
        pytest.param("nvidia0/vgpu2", Target(0), id="gke-shared"),
        pytest.param(gpu_uuid(1), Target(1), id="mig-parent-uuid"),
        pytest.param(mig_uuid(1, 9), Target(1, 9), id="mig-uuid"),
        pytest.param(mig_uuid(1, 9) + "::1", Target(1, 9), id="mig-uuid-eks-suffix"),
        pytest.param(mig_uuid(1, 9)[len("MIG-") :], Target(1, 9), id="mig-uuid-without-prefix"),
        pytest.param("1:0", Target(1, 7), id="mig-index-first"),
        pytest.param("1:6", Target(1, 13), id="mig-index-last"),
        pytest.param("1:2::4", Target(1, 9), id="mig-index-replica"),
        pytest.param("nvidia5/gi11", Target(1, 11), id="gke-mig"),
        pytest.param("nvidia5/gi11/vgpu0", Target(1, 11), id="gke-mig-shared"),
    ],
)
def test_index_resolves_every_spelling(
    index: DeviceIndex, device_id: str, expected: Target
) -> None:
    assert index.resolve(device_id) == expected


@pytest.mark.parametrize(
    "device_id", ["GPU-unknown", "7", "1:7", "0:0", "nvidia9", "MIG-unknown::1", "", "::"]
)
def test_index_ignores_foreign_ids(index: DeviceIndex, device_id: str) -> None:
    assert index.resolve(device_id) is None


def test_attributions_one_entry_per_pod_on_shared_gpu() -> None:
    snapshot = synthetic_snapshot(2, replicas=3)
    found = attributions(snapshot, by_device(snapshot.pods.allocated, SERVED))
    assert set(found) == {Target(0), Target(1)}
    assert [r.pod for r in found[Target(0)]] == [f"pod-0-{gpu_uuid(0)[-4:]}-{r}" for r in range(3)]


def test_attributions_merge_spellings_and_dedup() -> None:
    snapshot = synthetic_snapshot(1)
    a, b = PodRef("ns", "a", "c"), PodRef("ns", "b", "c")
    snapshot = replace(
        snapshot,
        pods=pods_by_device(
            {gpu_uuid(0): (b,), "0::1": (a,), f"{gpu_uuid(0)}::2": (a, b), "GPU-gone": (a,)}
        ),
    )
    assert attributions(snapshot, by_device(snapshot.pods.allocated, SERVED)) == {Target(0): (a, b)}


def test_attributions_mig() -> None:
    snapshot = synthetic_snapshot(1, mig=True, replicas=1)
    found = attributions(snapshot, by_device(snapshot.pods.allocated, SERVED))
    assert set(found) == {Target(0, gi) for gi in range(7, 14)}


def test_attributions_empty_without_mapping() -> None:
    snapshot = synthetic_snapshot(2)
    assert attributions(snapshot, by_device(snapshot.pods.allocated, SERVED)) == {}


@given(st.text(max_size=60))
def test_resolve_never_raises(device_id: str) -> None:
    index = DeviceIndex(synthetic_snapshot(2, mig=True).gpus)
    result = index.resolve(device_id)
    assert result is None or isinstance(result, Target)
    assert isinstance(base_id(device_id), str)
