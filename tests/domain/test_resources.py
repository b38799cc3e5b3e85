"""Advertised resources: names, MIG strategies, kubelet IDs, time-slicing replicas."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
from support.nodes import gpu, gpu_uuid, mig, mig_uuid, node

from gpuagent.domain.devices import IdStrategy, Telemetry
from gpuagent.domain.errors import ResourceError, SettingError
from gpuagent.domain.naming import annotated_id, mig_resource_name, resource_name, strip_replica
from gpuagent.domain.resources import MigStrategy, NodeResources, ResourceSettings, build_resources
from gpuagent.domain.snapshot import Snapshot
from gpuagent.domain.timeslicing import ReplicaRule, TimeSlicing

G0, G1, G2 = gpu_uuid(0), gpu_uuid(1), gpu_uuid(2)

# GPU 0 whole; GPU 1 in MIG mode with two 1g.10gb and one 2g.20gb; GPU 2 whole, on NUMA node 1.
MIXED_NODE = node(
    gpu(0, numa=0),
    gpu(1, numa=0, migs=[mig(1, 7), mig(1, 8), mig(1, 3, "2g.20gb", 19968)]),
    gpu(2, numa=1, healthy=False),
)
# Every GPU in MIG mode with one profile.
UNIFORM_MIG = node(gpu(0, migs=[mig(0, 7), mig(0, 8)]), gpu(1, migs=[mig(1, 7)]))
WHOLE = node(gpu(0, numa=0), gpu(1, numa=0), gpu(2, numa=1))


def ids_by_resource(snapshot: Snapshot, **settings: object) -> dict[str, list[str]]:
    resources = build_resources(snapshot, ResourceSettings(**settings))  # type: ignore[arg-type]
    return {r.name: list(r.ids) for r in resources.resources}


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("gpu", "nvidia.com/gpu"),
        ("nvidia.com/gpu", "nvidia.com/gpu"),
        ("gpu.shared", "nvidia.com/gpu.shared"),
        ("example.com/tpu", "example.com/tpu"),
        ("mig-1g.10gb", "nvidia.com/mig-1g.10gb"),
    ],
)
def test_resource_name_adds_nvidia_domain(given: str, expected: str) -> None:
    assert resource_name(given) == expected


@pytest.mark.parametrize(
    ("given", "reason"),
    [
        pytest.param("nvidia.com/" + "g" * 53, "longer than 63", id="too-long"),
        pytest.param("nvidia.com/GPU", "DNS subdomain", id="upper-case-name"),
        pytest.param("nvidia.com/gpu_x", "DNS subdomain", id="underscore"),
        pytest.param("nvidia.com/-gpu", "DNS subdomain", id="leading-dash"),
        pytest.param("Nvidia.com/gpu", "not a lower-case DNS subdomain", id="upper-case-domain"),
        pytest.param("kubernetes.io/gpu", "kubernetes.io", id="kubernetes-namespace"),
        pytest.param("nvidia.com/", "DNS subdomain", id="empty-name"),
    ],
)
def test_resource_name_rejects(given: str, reason: str) -> None:
    with pytest.raises(ValueError, match=re.escape(reason)):
        resource_name(given)


def test_resource_name_limit_is_the_whole_name() -> None:
    assert resource_name("nvidia.com/" + "g" * 52) == "nvidia.com/" + "g" * 52  # 63 in all


@pytest.mark.parametrize(
    ("profile", "domain", "expected"),
    [
        ("1g.10gb", "nvidia.com", "nvidia.com/mig-1g.10gb"),
        ("1g.10gb+me", "nvidia.com", "nvidia.com/mig-1g.10gb.me"),
        ("1g.20gb+me.all", "nvidia.com", "nvidia.com/mig-1g.20gb.me.all"),
        ("1g.10gb-me", "nvidia.com", "nvidia.com/mig-1g.10gb-me"),
        ("3g.40gb+gfx", "example.com", "example.com/mig-3g.40gb.gfx"),
    ],
)
def test_mig_resource_names_follow_nvidia(profile: str, domain: str, expected: str) -> None:
    assert mig_resource_name(profile, domain) == expected


def test_replica_ids() -> None:
    assert annotated_id("GPU-x", 3) == "GPU-x::3"
    assert strip_replica("GPU-x::3") == "GPU-x"
    assert strip_replica("1:0") == "1:0"


# ----- MIG strategies and kubelet ID strategies -----------------------------------------------
M17, M18, M13 = mig_uuid(1, 7), mig_uuid(1, 8), mig_uuid(1, 3)


@pytest.mark.parametrize(
    ("snapshot", "strategy", "kubelet_ids", "expected"),
    [
        pytest.param(
            MIXED_NODE, MigStrategy.NONE, IdStrategy.UUID,
            {"nvidia.com/gpu": [G0, G2]}, id="none-uuid",
        ),
        pytest.param(
            MIXED_NODE, MigStrategy.NONE, IdStrategy.INDEX,
            {"nvidia.com/gpu": ["0", "2"]}, id="none-index",
        ),
        pytest.param(
            MIXED_NODE, MigStrategy.MIXED, IdStrategy.UUID,
            {
                "nvidia.com/gpu": [G0, G2],
                "nvidia.com/mig-1g.10gb": [M17, M18],
                "nvidia.com/mig-2g.20gb": [M13],
            },
            id="mixed-uuid",
        ),
        pytest.param(
            MIXED_NODE, MigStrategy.MIXED, IdStrategy.INDEX,
            {
                "nvidia.com/gpu": ["0", "2"],
                "nvidia.com/mig-1g.10gb": ["1:0", "1:1"],
                "nvidia.com/mig-2g.20gb": ["1:2"],
            },
            id="mixed-index",
        ),
        pytest.param(
            UNIFORM_MIG, MigStrategy.SINGLE, IdStrategy.UUID,
            {"nvidia.com/gpu": [mig_uuid(0, 7), mig_uuid(0, 8), mig_uuid(1, 7)]},
            id="single-uuid",
        ),
        pytest.param(
            UNIFORM_MIG, MigStrategy.SINGLE, IdStrategy.INDEX,
            {"nvidia.com/gpu": ["0:0", "0:1", "1:0"]}, id="single-index",
        ),
        pytest.param(
            WHOLE, MigStrategy.SINGLE, IdStrategy.UUID,
            {"nvidia.com/gpu": [G0, G1, G2]}, id="single-without-mig-is-none",
        ),
        pytest.param(
            WHOLE, MigStrategy.MIXED, IdStrategy.UUID,
            {"nvidia.com/gpu": [G0, G1, G2]}, id="mixed-without-mig",
        ),
        pytest.param(
            UNIFORM_MIG, MigStrategy.NONE, IdStrategy.UUID, {}, id="none-all-in-mig-mode",
        ),
    ],
)  # fmt: skip
def test_strategies(
    snapshot: Snapshot,
    strategy: MigStrategy,
    kubelet_ids: IdStrategy,
    expected: dict[str, list[str]],
) -> None:
    got = ids_by_resource(snapshot, mig_strategy=strategy, kubelet_ids=kubelet_ids)
    assert got == expected


def test_none_strategy_can_advertise_mig_mode_gpus_like_nvidia() -> None:
    got = ids_by_resource(MIXED_NODE, mig_enabled_gpus_as_full=True)
    assert got == {"nvidia.com/gpu": [G0, gpu_uuid(1), G2]}


def test_none_strategy_notes_what_it_leaves_out() -> None:
    resources = build_resources(MIXED_NODE)
    assert resources.notes == ("GPU 1 is in MIG mode: not advertised with mig-strategy none",)


def test_custom_resource_name_and_its_domain_for_mig() -> None:
    settings = ResourceSettings(resource_name="example.com/accel", mig_strategy=MigStrategy.MIXED)
    assert build_resources(MIXED_NODE, settings).names == (
        "example.com/accel",
        "example.com/mig-1g.10gb",
        "example.com/mig-2g.20gb",
    )


def test_single_refuses_gpus_in_and_out_of_mig_mode() -> None:
    with pytest.raises(ResourceError, match=r"same migEnabled value .*GPUs 1 are in MIG mode"):
        build_resources(MIXED_NODE, ResourceSettings(mig_strategy=MigStrategy.SINGLE))


def test_single_refuses_two_profiles() -> None:
    snapshot = node(gpu(0, migs=[mig(0, 7)]), gpu(1, migs=[mig(1, 3, "2g.20gb")]))
    with pytest.raises(
        ResourceError,
        match=re.escape("more than one MIG device type present on node "
                        "(1g.10gb on GPU 0; 2g.20gb on GPU 1)"),
    ):  # fmt: skip
        build_resources(snapshot, ResourceSettings(mig_strategy=MigStrategy.SINGLE))


def test_mixed_leaves_out_compute_instance_profiles_and_empty_mig_gpus() -> None:
    snapshot = node(
        gpu(0, migs=[mig(0, 7), mig(0, 1, "1c.3g.40gb")]),
        gpu(1, mig_enabled=True),
    )
    resources = build_resources(snapshot, ResourceSettings(mig_strategy=MigStrategy.MIXED))
    assert resources.names == ("nvidia.com/mig-1g.10gb",)
    assert resources.notes == (
        "MIG device 0:1 has compute-instance profile 1c.3g.40gb: not advertised with "
        "mig-strategy mixed",
        "GPU 1 is in MIG mode without MIG devices: not advertised",
    )


def test_single_advertises_compute_instance_profiles_too() -> None:
    snapshot = node(gpu(0, migs=[mig(0, 1, "1c.3g.40gb"), mig(0, 2, "1c.3g.40gb")]))
    resources = build_resources(snapshot, ResourceSettings(mig_strategy=MigStrategy.SINGLE))
    assert resources.get("nvidia.com/gpu") is not None


def test_devices_carry_placement_health_and_nodes() -> None:
    resources = build_resources(MIXED_NODE, ResourceSettings(mig_strategy=MigStrategy.MIXED))
    whole = resources.get("nvidia.com/gpu")
    sliced = resources.get("nvidia.com/mig-1g.10gb")
    assert whole is not None
    assert sliced is not None
    assert whole.kubelet_devices() == ((G0, "Healthy", 0), (G2, "Unhealthy", 1))
    assert whole.devices[1].reason == "xid 79"
    first = sliced.devices[0]
    assert (first.uuid, first.index, first.gpu, first.gpu_uuid) == (M17, "1:0", 1, gpu_uuid(1))
    assert first.is_mig
    assert first.mig_profile == "1g.10gb"
    assert first.device_nodes == (
        "/dev/nvidia1",
        "/dev/nvidia-caps/nvidia-cap117",
        "/dev/nvidia-caps/nvidia-cap217",
    )
    assert first.name(IdStrategy.UUID) == M17
    assert first.name(IdStrategy.INDEX) == "1:0"
    assert sliced.socket_name == "nvidia-mig-1g.10gb.sock"


def test_resource_equality_ignores_telemetry_but_not_health() -> None:
    hotter = replace(WHOLE, gpus=tuple(replace(g, telemetry=Telemetry(temperature_c=90.0))
                                       for g in WHOLE.gpus))  # fmt: skip
    assert build_resources(hotter) == build_resources(WHOLE)
    sick = node(gpu(0, numa=0, healthy=False), gpu(1, numa=0), gpu(2, numa=1))
    assert build_resources(sick) != build_resources(WHOLE)


# ----- time-slicing ---------------------------------------------------------------------------
def sharing(*rules: ReplicaRule, rename: bool = False, fail: bool = False) -> TimeSlicing:
    return TimeSlicing(
        resources=rules, rename_by_default=rename, fail_requests_greater_than_one=fail
    )


def test_replicas_are_annotated_uuids() -> None:
    got = ids_by_resource(
        node(gpu(0), gpu(1)), time_slicing=sharing(ReplicaRule("nvidia.com/gpu", 2))
    )
    assert got == {"nvidia.com/gpu": [f"{G0}::0", f"{G0}::1", f"{G1}::0", f"{G1}::1"]}


def test_replicas_with_index_kubelet_ids() -> None:
    got = ids_by_resource(
        node(gpu(0)),
        kubelet_ids=IdStrategy.INDEX,
        time_slicing=sharing(ReplicaRule("gpu", 3)),
    )
    assert got == {"nvidia.com/gpu": ["0::0", "0::1", "0::2"]}


def test_replica_devices_know_their_number_and_count() -> None:
    resources = build_resources(
        node(gpu(0)), ResourceSettings(time_slicing=sharing(ReplicaRule("gpu", 2)))
    )
    (resource,) = resources.resources
    assert [(d.replica, d.replicas, d.uuid) for d in resource.devices] == [(0, 2, G0), (1, 2, G0)]
    assert resource.shared
    assert not resource.renamed


def test_rename_by_default_appends_shared() -> None:
    resources = build_resources(
        node(gpu(0)),
        ResourceSettings(time_slicing=sharing(ReplicaRule("gpu", 2), rename=True)),
    )
    (resource,) = resources.resources
    assert (resource.name, resource.origin, resource.renamed) == (
        "nvidia.com/gpu.shared",
        "nvidia.com/gpu",
        True,
    )
    assert resource.socket_name == "nvidia-gpu.shared.sock"


def test_per_gpu_replica_counts() -> None:
    """NVIDIA #1786: GPU 0 in 4, the rest in 2 — rules match first come, first served."""
    got = ids_by_resource(
        WHOLE,
        time_slicing=sharing(
            ReplicaRule("gpu", 4, devices=("0",)), ReplicaRule("gpu", 2, devices="all")
        ),
    )
    assert got == {
        "nvidia.com/gpu": [
            *(f"{G0}::{n}" for n in range(4)),
            f"{G1}::0", f"{G1}::1", f"{G2}::0", f"{G2}::1",
        ]
    }  # fmt: skip


def test_devices_not_replicated_stay_whole_under_the_name() -> None:
    got = ids_by_resource(WHOLE, time_slicing=sharing(ReplicaRule("gpu", 2, devices=(G1,))))
    assert got == {"nvidia.com/gpu": [G0, f"{G1}::0", f"{G1}::1", G2]}


def test_rename_splits_replicas_from_whole_gpus() -> None:
    got = ids_by_resource(
        WHOLE, time_slicing=sharing(ReplicaRule("gpu", 2, devices=1), rename=True)
    )
    assert got == {
        "nvidia.com/gpu": [G1, G2],
        "nvidia.com/gpu.shared": [f"{G0}::0", f"{G0}::1"],
    }


def test_rule_rename_overrides_the_default() -> None:
    got = ids_by_resource(
        WHOLE,
        time_slicing=sharing(
            ReplicaRule("gpu", 2, devices=("0",), rename="gpu.small"),
            ReplicaRule("gpu", 8, devices=("2",)),
            rename=True,
        ),
    )
    assert got == {
        "nvidia.com/gpu": [G1],
        "nvidia.com/gpu.shared": [f"{G2}::{n}" for n in range(8)],
        "nvidia.com/gpu.small": [f"{G0}::0", f"{G0}::1"],
    }


def test_mig_resources_are_shared_by_gpu_or_mig_reference() -> None:
    got = ids_by_resource(
        MIXED_NODE,
        mig_strategy=MigStrategy.MIXED,
        kubelet_ids=IdStrategy.INDEX,
        time_slicing=sharing(
            ReplicaRule("mig-1g.10gb", 2, devices=("1",)),
            ReplicaRule("mig-2g.20gb", 3, devices=("1:2",)),
        ),
    )
    assert got == {
        "nvidia.com/gpu": ["0", "2"],
        "nvidia.com/mig-1g.10gb": ["1:0::0", "1:0::1", "1:1::0", "1:1::1"],
        "nvidia.com/mig-2g.20gb": ["1:2::0", "1:2::1", "1:2::2"],
    }


def test_rules_for_resources_the_node_lacks_are_ignored() -> None:
    got = ids_by_resource(WHOLE, time_slicing=sharing(ReplicaRule("mig-1g.10gb", 2)))
    assert got == {"nvidia.com/gpu": [G0, G1, G2]}


def test_fail_requests_greater_than_one_marks_shared_resources_only() -> None:
    resources = build_resources(
        WHOLE,
        ResourceSettings(
            time_slicing=sharing(ReplicaRule("gpu", 2, devices=1), rename=True, fail=True)
        ),
    )
    flags = {r.name: r.fail_requests_greater_than_one for r in resources.resources}
    assert flags == {"nvidia.com/gpu": False, "nvidia.com/gpu.shared": True}


@pytest.mark.parametrize(
    ("rules", "message"),
    [
        pytest.param(
            (ReplicaRule("gpu", 2, devices=4),),
            "resources[0]: requested 4 devices of nvidia.com/gpu to be replicated, but only 3",
            id="count-too-large",
        ),
        pytest.param(
            (ReplicaRule("gpu", 2, devices=("7",)),),
            "resources[0]: no device of nvidia.com/gpu matches '7'",
            id="unknown-index",
        ),
        pytest.param(
            (ReplicaRule("gpu", 2, devices=("GPU-nope",)),),
            "no device of nvidia.com/gpu matches 'GPU-nope'",
            id="unknown-uuid",
        ),
        pytest.param(
            (ReplicaRule("gpu", 2, devices=("0",)), ReplicaRule("gpu", 4, devices=(G0,))),
            "resources[1]: " + repr(G0) + " names 0, already replicated by an earlier rule",
            id="listed-twice",
        ),
        pytest.param(
            (ReplicaRule("gpu", 2, devices="all"), ReplicaRule("gpu", 4, devices=("1",))),
            "resources[1]: '1' names 1, already replicated",
            id="listed-after-all",
        ),
    ],
)
def test_replica_rules_that_do_not_fit_the_node(
    rules: tuple[ReplicaRule, ...], message: str
) -> None:
    with pytest.raises(ResourceError, match=re.escape(message)):
        build_resources(WHOLE, ResourceSettings(time_slicing=sharing(*rules)))


def test_two_resources_renamed_to_one_name_is_an_error() -> None:
    with pytest.raises(ResourceError, match=r"devices of both nvidia\.com/mig-1g\.10gb and"):
        build_resources(
            MIXED_NODE,
            ResourceSettings(
                mig_strategy=MigStrategy.MIXED,
                time_slicing=sharing(
                    ReplicaRule("mig-1g.10gb", 2, rename="mig.shared"),
                    ReplicaRule("mig-2g.20gb", 2, rename="mig.shared"),
                ),
            ),
        )


def test_shared_name_too_long_is_an_error() -> None:
    long = "nvidia.com/" + "g" * 50
    snapshot = node(gpu(0))
    with pytest.raises(ResourceError, match="longer than 63"):
        build_resources(
            snapshot,
            ResourceSettings(
                resource_name=long, time_slicing=sharing(ReplicaRule(long, 2), rename=True)
            ),
        )


# ----- settings validation --------------------------------------------------------------------
@pytest.mark.parametrize(
    ("rule", "key", "reason"),
    [
        pytest.param(ReplicaRule("gpu", 1), "replicas", "between 2 and 1024, got 1", id="one"),
        pytest.param(ReplicaRule("gpu", 5000), "replicas", "got 5000", id="too-many"),
        pytest.param(ReplicaRule("gpu", True), "replicas", "whole number", id="bool"),
        pytest.param(ReplicaRule("gpu", 2, devices="some"), "devices", "'all', a count", id="word"),
        pytest.param(ReplicaRule("gpu", 2, devices=0), "devices", "at least 1", id="zero"),
        pytest.param(ReplicaRule("gpu", 2, devices=()), "devices", "names no devices", id="empty"),
        pytest.param(
            ReplicaRule("gpu", 2, devices=("gpu0",)), "devices", "'gpu0' is not a GPU index",
            id="bad-reference",
        ),
        pytest.param(
            ReplicaRule("gpu", 2, devices=("0", "0")), "devices", "listed more than once: 0",
            id="duplicate",
        ),
        pytest.param(ReplicaRule("GPU", 2), "name", "DNS subdomain", id="bad-name"),
        pytest.param(ReplicaRule("gpu", 2, rename="a b"), "rename", "DNS subdomain", id="rename"),
    ],
)  # fmt: skip
def test_time_slicing_errors_name_the_key(rule: ReplicaRule, key: str, reason: str) -> None:
    with pytest.raises(SettingError) as caught:
        TimeSlicing(resources=(ReplicaRule("gpu", 2), rule))
    assert caught.value.key == f"sharing.timeSlicing.resources[1].{key}"
    assert reason in caught.value.reason


def test_time_slicing_normalises_names() -> None:
    rules = TimeSlicing(resources=(ReplicaRule("gpu", 2, devices=["0", "1:0"], rename="x"),))  # type: ignore[arg-type]
    assert rules.resources == (
        ReplicaRule("nvidia.com/gpu", 2, devices=("0", "1:0"), rename="nvidia.com/x"),
    )
    assert rules.enabled
    assert not TimeSlicing().enabled


def test_bad_resource_name_setting() -> None:
    with pytest.raises(SettingError) as caught:
        ResourceSettings(resource_name="Bad/Name")
    assert caught.value.key == "resource-name"


def test_no_gpus_no_resources() -> None:
    assert build_resources(node()) == NodeResources()
