"""The original single-resource policy (kept until the service uses resources and containers)."""

from __future__ import annotations

import re

import pytest

from gpuagent.domain.allocation import (
    AllocationPolicy,
    DuplicateDevicesError,
    EmptyRequestError,
    UnhealthyDevicesError,
    UnknownDevicesError,
)
from gpuagent.domain.devices import (
    Condition,
    Gpu,
    GpuHealth,
    IdStrategy,
    Link,
    P2PLevel,
    Snapshot,
    Topology,
)


def _gpu(index: int, numa: int | None = 0, healthy: bool = True) -> Gpu:
    health = GpuHealth() if healthy else GpuHealth((Condition("xid", "79"),))
    return Gpu(index=index, uuid=f"GPU-{index}", minor=index, name="H100", memory_mib=1,
               pci_bus_id=f"00000000:{index:02x}:00.0", numa_node=numa, health=health)  # fmt: skip


SNAPSHOT = Snapshot(
    gpus=(_gpu(0, 0), _gpu(1, 0), _gpu(2, 1), _gpu(3, 1, healthy=False), _gpu(4, 1))
)
UUID = AllocationPolicy()


def test_envvar_lists_allocated_uuids_in_request_order() -> None:
    gpus = UUID.resolve(SNAPSHOT, ["GPU-2", "GPU-0"])
    assert UUID.container_allocation(gpus).envs == {"NVIDIA_VISIBLE_DEVICES": "GPU-2,GPU-0"}


def test_index_strategy_names_gpus_by_index() -> None:
    policy = AllocationPolicy(id_strategy=IdStrategy.INDEX)
    gpus = policy.resolve(SNAPSHOT, ["1"])
    assert policy.container_allocation(gpus).envs == {"NVIDIA_VISIBLE_DEVICES": "1"}


def test_volume_mounts_strategy() -> None:
    policy = AllocationPolicy(list_strategies=("volume-mounts",))
    alloc = policy.container_allocation(policy.resolve(SNAPSHOT, ["GPU-0"]))
    assert alloc.envs == {"NVIDIA_VISIBLE_DEVICES": "/var/run/nvidia-container-devices"}
    assert [(m.container_path, m.host_path) for m in alloc.mounts] == [
        ("/var/run/nvidia-container-devices/GPU-0", "/dev/null")
    ]


@pytest.mark.parametrize(
    ("ids", "error", "message"),
    [
        pytest.param(["GPU-9", "GPU-0", "nope"], UnknownDevicesError, "GPU-9, nope", id="unknown"),
        pytest.param(["GPU-3"], UnhealthyDevicesError, "GPU-3 (xid 79)", id="unhealthy"),
        pytest.param(["GPU-0", "GPU-0"], DuplicateDevicesError, "GPU-0", id="duplicate"),
        pytest.param([], EmptyRequestError, "no device", id="empty"),
        pytest.param(["0"], UnknownDevicesError, "0", id="index-under-uuid-strategy"),
    ],
)
def test_refusals_name_the_ids(ids: list[str], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=re.escape(message)):
        UUID.resolve(SNAPSHOT, ids)


def test_unknown_is_reported_before_unhealthy() -> None:
    with pytest.raises(UnknownDevicesError):
        UUID.resolve(SNAPSHOT, ["GPU-3", "GPU-9"])


ALL = ["GPU-0", "GPU-1", "GPU-2", "GPU-4"]


@pytest.mark.parametrize(
    ("available", "must", "size", "expected"),
    [
        pytest.param(ALL, [], 2, ["GPU-0", "GPU-1"], id="lowest-indexes"),
        pytest.param(ALL, ["GPU-2"], 2, ["GPU-2", "GPU-4"], id="same-numa-as-must-include"),
        pytest.param(ALL, ["GPU-2", "GPU-0"], 2, ["GPU-2", "GPU-0"], id="must-include-fills-size"),
        pytest.param(ALL, [], 9, ALL, id="fewer-available-than-size"),
        pytest.param(["GPU-4", "GPU-9"], [], 1, ["GPU-4"], id="unknown-available-skipped"),
        pytest.param(ALL, [], 0, [], id="size-zero"),
        pytest.param(["GPU-2", "GPU-0", "GPU-1"], ["GPU-0"], 3, ["GPU-0", "GPU-1", "GPU-2"],
                     id="numa-then-index"),
    ],
)  # fmt: skip
def test_preferred(available: list[str], must: list[str], size: int, expected: list[str]) -> None:
    assert UUID.preferred(SNAPSHOT, available, must, size) == expected


def test_preferred_follows_nvlink_over_numa() -> None:
    linked = Snapshot(
        gpus=SNAPSHOT.gpus,
        topology=Topology(links=(Link(0, 4, p2p=P2PLevel.SYSTEM, nvlinks=4),)),
    )
    assert UUID.preferred(linked, ALL, ["GPU-0"], 2) == ["GPU-0", "GPU-4"]


def test_container_allocation_has_no_device_specs_annotations_or_cdi_devices() -> None:
    alloc = UUID.container_allocation(UUID.resolve(SNAPSHOT, ["GPU-0"]))
    assert (alloc.devices, dict(alloc.annotations), alloc.cdi_devices) == ((), {}, ())
