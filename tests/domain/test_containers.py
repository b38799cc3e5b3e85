"""Allocate: validation and the container's view, for every device-list and ID strategy."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import pytest
from support.nodes import gpu, gpu_uuid, mig, mig_uuid, node

from gpuagent.domain.allocation import (
    ContainerAllocation,
    DeviceSpec,
    DuplicateDevicesError,
    EmptyRequestError,
    MountSpec,
    SharedRequestTooLargeError,
    UnhealthyDevicesError,
    UnknownDevicesError,
)
from gpuagent.domain.containers import (
    CONTROL_NODES,
    ContainerSettings,
    DeviceListStrategy,
    allocate,
    annotation_key,
    cdi_name,
    container_allocation,
    validate_request,
)
from gpuagent.domain.devices import IdStrategy
from gpuagent.domain.errors import SettingError
from gpuagent.domain.resources import MigStrategy, Resource, ResourceSettings, build_resources
from gpuagent.domain.snapshot import Snapshot
from gpuagent.domain.timeslicing import ReplicaRule, TimeSlicing

ENVVAR = DeviceListStrategy.ENVVAR
MOUNTS = DeviceListStrategy.VOLUME_MOUNTS
ANNOTATIONS = DeviceListStrategy.CDI_ANNOTATIONS
CRI = DeviceListStrategy.CDI_CRI

# GPU 0 whole, GPU 1 in MIG mode (two 1g.10gb), GPU 2 whole and unhealthy.
NODE = node(gpu(0), gpu(1, migs=[mig(1, 7), mig(1, 8)]), gpu(2, healthy=False))
SINGLE_NODE = node(gpu(0, migs=[mig(0, 7)]), gpu(1, migs=[mig(1, 7)]))


def resource(
    name: str,
    *,
    snapshot: Snapshot = NODE,
    mig: MigStrategy = MigStrategy.NONE,
    replicas: int = 0,
    fail: bool = False,
    kubelet_ids: IdStrategy = IdStrategy.UUID,
) -> Resource:
    sharing = TimeSlicing(
        resources=(ReplicaRule(name, replicas),) if replicas else (),
        fail_requests_greater_than_one=fail,
    )
    settings = ResourceSettings(mig_strategy=mig, time_slicing=sharing, kubelet_ids=kubelet_ids)
    found = build_resources(snapshot, settings).get(name)
    assert found is not None
    return found


@dataclass(frozen=True)
class Case:
    """One MIG mode and sharing: the resource, the IDs asked for, and the container's names."""

    resource: Resource
    ids: tuple[str, ...]
    uuid_names: tuple[str, ...]
    index_names: tuple[str, ...]


G0, M17, M18 = gpu_uuid(0), mig_uuid(1, 7), mig_uuid(1, 8)
CASES = {
    "none": Case(resource("nvidia.com/gpu"), (G0,), (G0,), ("0",)),
    "none-replicas": Case(
        resource("nvidia.com/gpu", replicas=4), (f"{G0}::1", f"{G0}::3"), (G0,), ("0",)
    ),
    "mixed": Case(
        resource("nvidia.com/mig-1g.10gb", mig=MigStrategy.MIXED),
        (M18, M17),
        (M18, M17),
        ("1:1", "1:0"),
    ),
    "mixed-replicas": Case(
        resource("nvidia.com/mig-1g.10gb", mig=MigStrategy.MIXED, replicas=2),
        (f"{M17}::1",),
        (M17,),
        ("1:0",),
    ),
    "single": Case(
        resource("nvidia.com/gpu", snapshot=SINGLE_NODE, mig=MigStrategy.SINGLE),
        (mig_uuid(0, 7), mig_uuid(1, 7)),
        (mig_uuid(0, 7), mig_uuid(1, 7)),
        ("0:0", "1:0"),
    ),
    "single-replicas": Case(
        resource("nvidia.com/gpu", snapshot=SINGLE_NODE, mig=MigStrategy.SINGLE, replicas=2),
        (f"{mig_uuid(1, 7)}::0",),
        (mig_uuid(1, 7),),
        ("1:0",),
    ),
}


def expected_envvar(names: Sequence[str]) -> ContainerAllocation:
    return ContainerAllocation(envs={"NVIDIA_VISIBLE_DEVICES": ",".join(names)})


def expected_mounts(names: Sequence[str]) -> ContainerAllocation:
    root = "/var/run/nvidia-container-devices"
    return ContainerAllocation(
        envs={"NVIDIA_VISIBLE_DEVICES": root},
        mounts=tuple(MountSpec(f"{root}/{n}", "/dev/null", read_only=False) for n in names),
    )


def expected_cri(names: Sequence[str]) -> ContainerAllocation:
    return ContainerAllocation(
        cdi_devices=tuple(f"k8s.device-plugin.nvidia.com/gpu={n}" for n in names)
    )


def expected_annotations(names: Sequence[str]) -> ContainerAllocation:
    value = ",".join(f"k8s.device-plugin.nvidia.com/gpu={n}" for n in names)
    return ContainerAllocation(annotations={"cdi.k8s.io/nvidia-device-plugin_req-1": value})


EXPECTED: Mapping[DeviceListStrategy, Callable[[Sequence[str]], ContainerAllocation]] = {
    ENVVAR: expected_envvar,
    MOUNTS: expected_mounts,
    CRI: expected_cri,
    ANNOTATIONS: expected_annotations,
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
@pytest.mark.parametrize("id_strategy", list(IdStrategy), ids=lambda s: s.value)
@pytest.mark.parametrize("strategy", list(DeviceListStrategy), ids=lambda s: s.value)
def test_every_strategy_id_strategy_sharing_and_mig_mode(
    case: str, id_strategy: IdStrategy, strategy: DeviceListStrategy
) -> None:
    c = CASES[case]
    settings = ContainerSettings(strategies=(strategy,), id_strategy=id_strategy)
    got = allocate(c.resource, c.ids, settings, response_id="req-1")
    names = c.uuid_names if id_strategy is IdStrategy.UUID else c.index_names
    assert got == EXPECTED[strategy](names)


def test_envvar_exactly_as_nvidia() -> None:
    got = allocate(CASES["none"].resource, [G0], ContainerSettings())
    assert dict(got.envs) == {"NVIDIA_VISIBLE_DEVICES": G0}
    assert (got.mounts, got.devices, dict(got.annotations), got.cdi_devices) == ((), (), {}, ())


def test_envvar_and_volume_mounts_together_point_at_the_mounts() -> None:
    settings = ContainerSettings(strategies=(ENVVAR, MOUNTS))
    got = allocate(CASES["mixed"].resource, [M17], settings)
    assert got == expected_mounts([M17])


def test_envvar_with_cdi_cri_sets_both() -> None:
    settings = ContainerSettings(strategies=(ENVVAR, CRI), id_strategy=IdStrategy.INDEX)
    got = allocate(CASES["mixed"].resource, [M17], settings)
    assert dict(got.envs) == {"NVIDIA_VISIBLE_DEVICES": "1:0"}
    assert got.cdi_devices == ("k8s.device-plugin.nvidia.com/gpu=1:0",)


def test_index_kubelet_ids_map_back_to_uuids_for_the_container() -> None:
    res = resource("nvidia.com/gpu", kubelet_ids=IdStrategy.INDEX, replicas=2)
    got = allocate(res, ["0::1"], ContainerSettings(id_strategy=IdStrategy.UUID))
    assert dict(got.envs) == {"NVIDIA_VISIBLE_DEVICES": G0}


def test_two_replicas_of_one_gpu_name_it_once() -> None:
    got = allocate(CASES["none-replicas"].resource, [f"{G0}::0", f"{G0}::2"], ContainerSettings())
    assert dict(got.envs) == {"NVIDIA_VISIBLE_DEVICES": G0}


# ----- CDI annotation key -----------------------------------------------------------------------
def test_annotation_key_default_is_stable_and_differs_per_resource() -> None:
    settings = ContainerSettings(strategies=(ANNOTATIONS,))
    one = allocate(CASES["mixed"].resource, [M17], settings)
    again = allocate(CASES["mixed"].resource, [M17], settings)
    other = allocate(CASES["mixed-replicas"].resource, [f"{M17}::0"], settings)
    assert one == again
    (key,) = one.annotations
    (other_key,) = other.annotations
    assert key != other_key
    assert re.fullmatch(r"cdi\.k8s\.io/nvidia-device-plugin_[0-9a-f-]{36}", key)
    assert len(key.removeprefix("cdi.k8s.io/")) <= 63


@pytest.mark.parametrize(
    ("response_id", "prefix", "expected"),
    [
        ("abc", "cdi.k8s.io/", "cdi.k8s.io/nvidia-device-plugin_abc"),
        ("a/b", "example.com/", "example.com/nvidia-device-plugin_a_b"),
        ("x" * 80, "cdi.k8s.io/", "cdi.k8s.io/nvidia-device-plugin_" + "x" * 42),
        ("x" * 41 + "--y", "cdi.k8s.io/", "cdi.k8s.io/nvidia-device-plugin_" + "x" * 41),
        ("abc", "/", "/nvidia-device-plugin_abc"),
    ],
)
def test_annotation_key(response_id: str, prefix: str, expected: str) -> None:
    key = annotation_key(response_id, prefix)
    assert key == expected
    assert len(key.removeprefix(prefix)) <= 63


def test_custom_annotation_prefix() -> None:
    settings = ContainerSettings(strategies=(ANNOTATIONS,), cdi_annotation_prefix="example.com/")
    got = allocate(CASES["none"].resource, [G0], settings, response_id="r")
    assert dict(got.annotations) == {
        "example.com/nvidia-device-plugin_r": f"k8s.device-plugin.nvidia.com/gpu={G0}"
    }


def test_cdi_name() -> None:
    assert cdi_name("0:1") == "k8s.device-plugin.nvidia.com/gpu=0:1"


# ----- device specs ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("case", "ids", "dev_root", "present", "expected"),
    [
        pytest.param(
            "none", [G0], "/", CONTROL_NODES,
            [*CONTROL_NODES, "/dev/nvidia0"], id="full-gpu-all-control-nodes",
        ),
        pytest.param(
            "none", [G0], "/", ("/dev/nvidia-uvm", "/dev/nvidiactl"),
            ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia0"], id="only-present-nodes",
        ),
        pytest.param(
            "mixed", [M17, M18], "/", (),
            ["/dev/nvidia1",
             "/dev/nvidia-caps/nvidia-cap117", "/dev/nvidia-caps/nvidia-cap217",
             "/dev/nvidia-caps/nvidia-cap118", "/dev/nvidia-caps/nvidia-cap218"],
            id="mig-parent-once-and-caps",
        ),
        pytest.param(
            "none-replicas", [f"{G0}::0", f"{G0}::1"], "/", (),
            ["/dev/nvidia0"], id="replicas-one-node",
        ),
    ],
)  # fmt: skip
def test_device_specs(
    case: str, ids: list[str], dev_root: str, present: tuple[str, ...], expected: list[str]
) -> None:
    settings = ContainerSettings(pass_device_specs=True, dev_root=dev_root, control_nodes=present)
    got = allocate(CASES[case].resource, ids, settings)
    assert got.devices == tuple(DeviceSpec(p, p, "rw") for p in expected)


def test_device_specs_live_under_the_dev_root() -> None:
    settings = ContainerSettings(
        strategies=(ENVVAR, CRI), pass_device_specs=True, dev_root="/run/nvidia/driver",
        control_nodes=("/dev/nvidiactl",),
    )  # fmt: skip
    got = allocate(CASES["mixed"].resource, [M17], settings)
    assert [(d.container_path, d.host_path) for d in got.devices] == [
        ("/dev/nvidiactl", "/run/nvidia/driver/dev/nvidiactl"),
        ("/dev/nvidia1", "/run/nvidia/driver/dev/nvidia1"),
        ("/dev/nvidia-caps/nvidia-cap117", "/run/nvidia/driver/dev/nvidia-caps/nvidia-cap117"),
        ("/dev/nvidia-caps/nvidia-cap217", "/run/nvidia/driver/dev/nvidia-caps/nvidia-cap217"),
    ]
    assert got.cdi_devices == (f"k8s.device-plugin.nvidia.com/gpu={M17}",)


@pytest.mark.parametrize("strategies", [(CRI,), (ANNOTATIONS,)], ids=["cdi-cri", "cdi-annotations"])
def test_cdi_strategies_alone_pass_no_device_specs(strategies: tuple[DeviceListStrategy]) -> None:
    """With every strategy a CDI one the spec brings the nodes: NVIDIA's plugin returns the CDI
    names alone whatever --pass-device-specs says (its getAllocateResponse returns early)."""
    settings = ContainerSettings(strategies=strategies, pass_device_specs=True)
    got = allocate(CASES["mixed"].resource, [M17], settings)
    assert got.devices == ()
    assert got.envs == {}
    assert got.mounts == ()
    assert [*got.cdi_devices, *got.annotations.values()] == [
        f"k8s.device-plugin.nvidia.com/gpu={M17}"
    ]


# ----- validation -----------------------------------------------------------------------------
WHOLE = CASES["none"].resource


@pytest.mark.parametrize(
    ("res", "ids", "error", "message"),
    [
        pytest.param(WHOLE, [], EmptyRequestError, "names no device IDs", id="empty"),
        pytest.param(
            WHOLE, [G0, G0], DuplicateDevicesError, f"more than once: {G0}", id="duplicate"
        ),
        pytest.param(
            WHOLE, ["GPU-nope", G0, "0"], UnknownDevicesError,
            "unknown device IDs for nvidia.com/gpu: GPU-nope, 0", id="unknown",
        ),
        pytest.param(
            WHOLE, [gpu_uuid(2)], UnhealthyDevicesError,
            f"unhealthy device IDs: {gpu_uuid(2)} (xid 79)", id="unhealthy",
        ),
        pytest.param(
            resource("nvidia.com/gpu", replicas=2, fail=True), [f"{G0}::0", f"{G0}::1"],
            SharedRequestTooLargeError,
            "request for nvidia.com/gpu too large: maximum request size for shared resources "
            "is 1; found 2",
            id="fail-requests-greater-than-one",
        ),
        pytest.param(
            CASES["mixed"].resource, [G0], UnknownDevicesError, "for nvidia.com/mig-1g.10gb",
            id="other-resource-id",
        ),
    ],
)  # fmt: skip
def test_refusals(res: Resource, ids: list[str], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=re.escape(message)):
        validate_request(res, ids)


def test_unknown_comes_before_unhealthy_and_replica_count() -> None:
    res = resource("nvidia.com/gpu", replicas=2, fail=True)
    with pytest.raises(UnknownDevicesError):
        validate_request(res, [f"{gpu_uuid(2)}::0", f"{G0}::0", "nope"])


def test_one_replica_passes_fail_requests_greater_than_one() -> None:
    res = resource("nvidia.com/gpu", replicas=2, fail=True)
    assert [d.id for d in validate_request(res, [f"{G0}::1"])] == [f"{G0}::1"]


def test_several_replicas_pass_without_fail_requests_greater_than_one() -> None:
    res = resource("nvidia.com/gpu", replicas=2)
    assert len(validate_request(res, [f"{G0}::0", f"{G0}::1"])) == 2


def test_unhealthy_replicas_are_refused() -> None:
    res = resource("nvidia.com/gpu", replicas=2)
    with pytest.raises(UnhealthyDevicesError, match=re.escape(f"{gpu_uuid(2)}::1 (xid 79)")):
        validate_request(res, [f"{gpu_uuid(2)}::1"])


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"strategies": ()}, "device-list-strategy"),
        ({"cdi_annotation_prefix": "cdi.k8s.io"}, "cdi-annotation-prefix"),
        ({"cdi_annotation_prefix": "Bad_Prefix/"}, "cdi-annotation-prefix"),
        ({"dev_root": "run/nvidia"}, "dev-root"),
    ],
)
def test_bad_container_settings(kwargs: dict[str, object], key: str) -> None:
    with pytest.raises(SettingError) as caught:
        ContainerSettings(**kwargs)  # type: ignore[arg-type]
    assert caught.value.key == key


# ----- two MIG resources in one container (NVIDIA #728) -----------------------------------------
def kubelet_merge(responses: Sequence[ContainerAllocation]) -> ContainerAllocation:
    """The kubelet's pod_devices merge: maps and specs first value wins, CDI devices appended."""
    envs: dict[str, str] = {}
    annotations: dict[str, str] = {}
    mounts: dict[str, MountSpec] = {}
    devices: dict[str, DeviceSpec] = {}
    cdi: list[str] = []
    for r in responses:
        for k, v in r.envs.items():
            envs.setdefault(k, v)
        for k, v in r.annotations.items():
            annotations.setdefault(k, v)
        for m in r.mounts:
            mounts.setdefault(m.container_path, m)
        for d in r.devices:
            devices.setdefault(d.container_path, d)
        cdi.extend(r.cdi_devices)
    return ContainerAllocation(
        envs=envs,
        mounts=tuple(mounts.values()),
        devices=tuple(devices.values()),
        annotations=annotations,
        cdi_devices=tuple(cdi),
    )


TWO_PROFILES = node(gpu(0, migs=[mig(0, 7), mig(0, 3, "2g.20gb")]))
SMALL = build_resources(TWO_PROFILES, ResourceSettings(mig_strategy=MigStrategy.MIXED))


def merged(strategy: DeviceListStrategy) -> ContainerAllocation:
    small, large = SMALL.get("nvidia.com/mig-1g.10gb"), SMALL.get("nvidia.com/mig-2g.20gb")
    assert small is not None
    assert large is not None
    settings = ContainerSettings(strategies=(strategy,), pass_device_specs=True)
    return kubelet_merge(
        [
            allocate(small, [mig_uuid(0, 7)], settings),
            allocate(large, [mig_uuid(0, 3)], settings),
        ]
    )


BOTH = (mig_uuid(0, 7), mig_uuid(0, 3))


def test_two_mig_resources_cdi_cri_carries_both() -> None:
    got = merged(CRI)
    assert got.cdi_devices == tuple(cdi_name(m) for m in BOTH)
    assert got.devices == ()  # the CDI spec brings the nodes


def test_two_mig_resources_cdi_annotations_carry_both() -> None:
    got = merged(ANNOTATIONS)
    assert sorted(got.annotations.values()) == sorted(cdi_name(m) for m in BOTH)


def test_two_mig_resources_volume_mounts_carry_both() -> None:
    got = merged(MOUNTS)
    assert [m.container_path for m in got.mounts] == [
        f"/var/run/nvidia-container-devices/{m}" for m in BOTH
    ]
    assert {d.container_path for d in got.devices} >= {
        "/dev/nvidia0", "/dev/nvidia-caps/nvidia-cap107", "/dev/nvidia-caps/nvidia-cap103",
    }  # fmt: skip


def test_two_mig_resources_envvar_loses_one_the_documented_limitation() -> None:
    got = merged(ENVVAR)
    assert dict(got.envs) == {"NVIDIA_VISIBLE_DEVICES": mig_uuid(0, 7)}


def test_container_allocation_accepts_validated_devices() -> None:
    res = CASES["none"].resource
    devices = validate_request(res, [G0])
    assert container_allocation(res, devices, ContainerSettings()) == expected_envvar([G0])
