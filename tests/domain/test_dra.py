"""DRA domain: ownership, the devices and slices published, taints, claims and the checkpoint."""

from __future__ import annotations

from dataclasses import replace

import kubernetes_validate  # type: ignore[import-untyped]
import pytest
from support.fake_apiserver import K8S_VERSIONS, claim, validate_slice
from support.nodes import gpu, gpu_uuid, mig, mig_uuid, node

from gpuagent.domain.apivalues import pci_bus_id, semver
from gpuagent.domain.claims import (
    ClaimError,
    ClaimRef,
    MadeMig,
    PreparedClaim,
    PreparedDevice,
    allocated_devices,
    boot_from_checkpoint,
    cdi_id,
    checkpoint_json,
    claims_from_checkpoint,
    restated,
)
from gpuagent.domain.devices import Condition, DriverState, GpuHealth
from gpuagent.domain.dra import (
    DraGpus,
    Effect,
    Taint,
    dra_devices,
    taints,
    unpublished_gpus,
)
from gpuagent.domain.errors import SettingError
from gpuagent.domain.plan import Plan
from gpuagent.domain.resources import MigStrategy
from gpuagent.domain.serving import ResourceView, ServingPolicy
from gpuagent.domain.slices import MAX_DEVICES_PER_SLICE, slice_manifests
from gpuagent.domain.snapshot import Snapshot

DRIVER = "gpu.nvidia.com"


@pytest.mark.parametrize(
    ("text", "owns"),
    [
        ("none", []),
        ("", []),
        ("all", [0, 1, 2]),
        ("1", [1]),
        ("0, 2", [0, 2]),
        (gpu_uuid(1), [1]),
        (f"0,{gpu_uuid(2)}", [0, 2]),
    ],
)
def test_dra_gpus_selects_by_index_or_uuid(text: str, owns: list[int]) -> None:
    selection = DraGpus.parse(text)
    assert [g.index for g in node(gpu(0), gpu(1), gpu(2)).gpus if selection.owns(g)] == owns
    assert selection.enabled == bool(owns)


@pytest.mark.parametrize("bad", ["gpu0", "1,1", "MIG-abc", "-1", "0,,1"])
def test_dra_gpus_rejects_what_is_not_a_gpu(bad: str) -> None:
    with pytest.raises(SettingError) as error:
        DraGpus.parse(bad)
    assert error.value.key == "dra-gpus"


@pytest.mark.parametrize(
    ("text", "known", "absent", "decided"),
    [
        pytest.param("0,1", (0, 1), (), True, id="all-there"),
        pytest.param("1,5", (0, 1), ("5",), True, id="index-past-the-count"),
        pytest.param("GPU-x,12,5,2", (0, 1, 2), ("5", "12", "GPU-x"), True,
                     id="every-uuid-known-indexes-first"),
        pytest.param("2", (0, 1), (), True, id="index-of-an-undescribed-gpu"),
        pytest.param("GPU-x", (0, 1), (), False, id="uuid-maybe-of-the-undescribed-gpu"),
        pytest.param(gpu_uuid(1), (0, 1), (), True, id="uuid-found"),
        pytest.param("all", (0,), (), True, id="all"),
    ],
)  # fmt: skip
def test_dra_gpus_the_node_does_not_have(
    text: str, known: tuple[int, ...], absent: tuple[str, ...], decided: bool
) -> None:
    """Of a node with three GPUs (the driver's count), ``known`` are described: an index is
    judged by the count, a UUID only once every GPU's UUID is known."""
    gpus = node(*(gpu(i) for i in known)).gpus
    selection = DraGpus.parse(text)
    assert selection.absent(gpus, 3) == absent
    assert selection.decided(gpus, 3) == decided


def test_unpublished_gpus_are_those_with_a_device_in_no_published_slice() -> None:
    snapshot = node(gpu(0), gpu(1, migs=[mig(1, 7), mig(1, 8)]), gpu(2))
    current = dra_devices(snapshot, DraGpus(all=True), mig_strategy=MigStrategy.MIXED)
    assert unpublished_gpus(current, None) == (0, 1, 2)  # never published
    assert unpublished_gpus(current, {d.name for d in current}) == ()
    # GPU 1 got a MIG device since the last publication; GPU 2's device was published.
    before = {d.name for d in current if d.gpu_index == 2 or d.uuid == mig_uuid(1, 7)}
    assert unpublished_gpus(current, before) == (0, 1)
    # A GPU with no device to publish (MIG mode under the none strategy) is not counted.
    assert (
        unpublished_gpus(dra_devices(node(gpu(1, migs=[mig(1, 7)])), DraGpus(all=True)), None) == ()
    )


def test_a_gpu_given_to_dra_leaves_the_device_plugin() -> None:
    snapshot = node(gpu(0), gpu(1), gpu(2))
    plan = Plan(serving=ServingPolicy(dra_gpus=DraGpus.parse("1")))
    (resource,) = ResourceView().resources(snapshot, plan.serving).resources
    assert [d.gpu for d in resource.devices] == [0, 2]
    devices = dra_devices(snapshot, DraGpus.parse("1"))
    assert [d.gpu_index for d in devices] == [1]


@pytest.mark.parametrize(
    ("raw", "want"),
    [("550.54.15", "550.54.15"), ("535.104.05", "535.104.5"), ("9.0", "9.0.0"),
     ("12", "12.0.0"), ("", None), ("12.4a", None), ("1.2.3.4", None)],
)  # fmt: skip
def test_versions_become_semver(raw: str, want: str | None) -> None:
    version = semver(raw)
    assert (version.text if version else None) == want


@pytest.mark.parametrize(
    ("raw", "want"),
    [("00000000:3B:00.0", "0000:3b:00.0"), ("0000:18:00.0", "0000:18:00.0"),
     ("18:00.1", "0000:18:00.1"), ("junk", None), ("0000:3b:40.0", None)],
)  # fmt: skip
def test_pci_bus_ids_take_the_standard_attributes_form(raw: str, want: str | None) -> None:
    assert pci_bus_id(raw) == want


def _snapshot() -> Snapshot:
    return replace(
        node(
            replace(gpu(0, numa=1), architecture="hopper", pci_bus_id="00000000:18:00.0"),
            gpu(1, migs=[mig(1, 3, "3g.40gb", 40192), mig(1, 5, "1g.10gb")]),
        ),
        driver=DriverState(up=True, version="580.95.05", cuda_version=(13, 0)),
    )


def test_a_gpu_carries_nvidia_dra_driver_attributes_and_memory() -> None:
    snapshot = _snapshot()
    (device,) = dra_devices(snapshot, DraGpus(all=True))
    attrs = device.attributes
    assert device.name == "gpu-0"
    assert attrs["type"] == "gpu"
    assert attrs["uuid"] == gpu_uuid(0)
    assert attrs["productName"] == "NVIDIA H100 80GB HBM3"
    assert attrs["architecture"] == "Hopper"
    assert attrs["cudaComputeCapability"] == semver("9.0")
    assert attrs["driverVersion"] == semver("580.95.05")
    assert attrs["cudaDriverVersion"] == semver("13.0")
    assert attrs["resource.kubernetes.io/pciBusID"] == "0000:18:00.0"
    assert attrs["resource.kubernetes.io/numaNode"] == 1
    assert device.memory_bytes == 81559 * 1024 * 1024


def test_mig_devices_are_published_under_a_mig_strategy_only() -> None:
    snapshot = _snapshot()
    assert [d.kind for d in dra_devices(snapshot, DraGpus(all=True))] == ["gpu"]
    devices = dra_devices(snapshot, DraGpus(all=True), mig_strategy=MigStrategy.MIXED)
    migs = [d for d in devices if d.kind == "mig"]
    assert [d.attributes["profile"] for d in migs] == ["3g.40gb", "1g.10gb"]
    assert [d.uuid for d in migs] == [mig_uuid(1, 3), mig_uuid(1, 5)]
    assert {d.attributes["parentUUID"] for d in migs} == {gpu_uuid(1)}
    assert migs[0].memory_bytes == 40192 * 1024 * 1024
    assert migs[0].name == "gpu-1-mig-3g40gb-3-0"


@pytest.mark.parametrize(
    ("conditions", "want"),
    [
        ((), []),
        ((Condition("xid", "79"),), [(f"{DRIVER}/xid", "", Effect.NO_SCHEDULE)]),
        ((Condition("lost"),), [(f"{DRIVER}/lost", "", Effect.NO_EXECUTE)]),
        ((Condition("recovery_action", "gpu_reset"),),
         [(f"{DRIVER}/recovery-action", "gpu_reset", Effect.NO_EXECUTE)]),
        ((Condition("recovery_action", "drain_p2p"),),
         [(f"{DRIVER}/recovery-action", "drain_p2p", Effect.NO_SCHEDULE)]),
        ((Condition("nvml_error", "Unknown Error (NVML 999)"),),
         [(f"{DRIVER}/nvml-error", "Unknown_Error_NVML_999", Effect.NO_SCHEDULE)]),
    ],
)  # fmt: skip
def test_taints_follow_the_health_policy(
    conditions: tuple[Condition, ...], want: list[tuple[str, str, Effect]]
) -> None:
    assert [(t.key, t.value, t.effect) for t in taints(GpuHealth(conditions), DRIVER)] == want


def test_at_most_four_taints_per_device() -> None:
    many = GpuHealth(tuple(Condition(f"c{i}") for i in range(6)))
    assert len(taints(many, DRIVER)) == 4


def test_a_taint_stays_the_same_while_its_cause_holds() -> None:
    """The next XID on a GPU already failing (the policy replaces the XID condition, moving it
    last) changes no taint, even past the limit of four: a repeat of a fault writes nothing."""
    causes = (Condition("ecc_dbe"), Condition("row_remap_failure"), Condition("unresponsive", "x"))
    before = GpuHealth((*causes, Condition("xid", "79"), Condition("lost")))
    after = GpuHealth((*causes, Condition("lost"), Condition("xid", "48")))
    assert taints(before, DRIVER) == taints(after, DRIVER)
    # The ones that need a reset are kept first.
    assert taints(before, DRIVER)[0] == Taint(f"{DRIVER}/lost", "", Effect.NO_EXECUTE)


def _valid(manifest: dict[str, object]) -> None:
    assert validate_slice(manifest) == []
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(manifest, version, strict=True)


def test_slices_pass_the_api_schema_and_the_api_servers_rules() -> None:
    sick = replace(gpu(2), health=GpuHealth((Condition("xid", "48"), Condition("lost"))))
    snapshot = replace(_snapshot(), gpus=(*_snapshot().gpus, sick))
    devices = dra_devices(snapshot, DraGpus(all=True), mig_strategy=MigStrategy.MIXED)
    (manifest,) = slice_manifests(devices, node="n1", node_uid="uid", driver=DRIVER, generation=3)
    _valid(manifest)
    spec = manifest["spec"]
    assert spec["pool"] == {"name": "n1", "generation": 3, "resourceSliceCount": 1}
    by_name = {d["name"]: d for d in spec["devices"]}
    assert by_name["gpu-0"]["capacity"] == {"memory": {"value": "81559Mi"}}
    assert by_name["gpu-0"]["attributes"]["driverVersion"] == {"version": "580.95.5"}
    assert len(by_name["gpu-2"]["taints"]) == 2


def test_a_large_pool_is_split_into_slices_of_the_api_limit() -> None:
    gpus = [gpu(i, migs=[mig(i, gi) for gi in range(1, 8)]) for i in range(10)]
    devices = dra_devices(node(*gpus), DraGpus(all=True), mig_strategy=MigStrategy.MIXED)
    assert len(devices) == 70
    manifests = slice_manifests(devices, node="n", node_uid="u", driver=DRIVER, generation=1)
    assert [len(m["spec"]["devices"]) for m in manifests] == [MAX_DEVICES_PER_SLICE, 6]
    assert {m["spec"]["pool"]["resourceSliceCount"] for m in manifests} == {2}
    for manifest in manifests:
        _valid(manifest)


def test_an_empty_pool_is_still_published() -> None:
    (manifest,) = slice_manifests((), node="n", node_uid="u", driver=DRIVER, generation=1)
    assert manifest["spec"]["devices"] == []
    _valid(manifest)


REF = ClaimRef("ns", "c", "uid-1")


def test_allocated_devices_keep_our_results_and_base_request_names() -> None:
    obj = claim(
        "ns", "c", "uid-1",
        [("gpu/large", DRIVER, "n1", "gpu-0"), ("gpu", DRIVER, "n1", "gpu-0"),
         ("nic", "net.example.com", "n1", "eth0"), ("mig", DRIVER, "n1", "gpu-1")],
    )  # fmt: skip
    got = allocated_devices(obj, REF, driver=DRIVER, pool="n1", known={"gpu-0", "gpu-1"})
    assert got == [("gpu-0", ("gpu",)), ("gpu-1", ("mig",))]


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        (claim("ns", "c", "uid-2", [("gpu", DRIVER, "n1", "gpu-0")]), "replaced"),
        (claim("ns", "c", "uid-1", None), "not allocated"),
        (claim("ns", "c", "uid-1", [("gpu", DRIVER, "n2", "gpu-0")]), "pool 'n2'"),
        (claim("ns", "c", "uid-1", [("gpu", DRIVER, "n1", "gpu-9")]), "not served by DRA"),
        (claim("ns", "c", "uid-1", [("gpu", DRIVER, "n1", "gpu-0")],
               config=[{"source": "FromClass", "requests": [],
                        "opaque": {"driver": DRIVER, "parameters": {}}}]), "opaque"),
    ],
)  # fmt: skip
def test_claims_this_node_cannot_serve_are_refused(obj: dict[str, object], message: str) -> None:
    with pytest.raises(ClaimError, match=message):
        allocated_devices(obj, REF, driver=DRIVER, pool="n1", known={"gpu-0"})


def test_the_checkpoint_round_trips_and_rejects_garbage() -> None:
    prepared = PreparedClaim(
        REF,
        (PreparedDevice(("gpu",), "n1", "gpu-0", (cdi_id(DRIVER, "uid-1", "gpu-0"),), "GPU-x"),),
    )
    document = checkpoint_json({"uid-1": prepared})
    assert claims_from_checkpoint(document) == {"uid-1": prepared}
    assert cdi_id(DRIVER, "uid-1", "gpu-0") == "k8s.gpu.nvidia.com/claim=uid-1-gpu-0"
    for bad in ({}, {"version": 2, "claims": {}}, {"version": 1, "claims": {"u": {"name": 1}}}):
        with pytest.raises(ValueError, match=r"checkpoint|malformed"):
            claims_from_checkpoint(bad)


def test_the_checkpoint_records_its_boot_and_each_made_mig_devices() -> None:
    made = MadeMig("GPU-a", 19, 6, 13, boot="boot-1")
    device = PreparedDevice(("m",), "n1", "gpu-0-mig-1g10gb-19-6", ("x",), "MIG-a", made)
    document = checkpoint_json({"uid-1": PreparedClaim(REF, (device,))}, (), "boot-2")
    assert document["bootId"] == "boot-2"
    assert document["claims"]["uid-1"]["devices"][0]["mig"]["boot"] == "boot-1"
    assert boot_from_checkpoint(document) == "boot-2"
    assert claims_from_checkpoint(document)["uid-1"].devices[0].made == made
    # A MIG device without its own boot was made in the checkpoint's.
    del document["claims"]["uid-1"]["devices"][0]["mig"]["boot"]
    (again,) = claims_from_checkpoint(document)["uid-1"].devices
    assert again.made == replace(made, boot="boot-2")
    with pytest.raises(ValueError, match="bootId"):
        boot_from_checkpoint({**document, "bootId": 7})


def test_a_checkpoint_from_before_boots_were_recorded_is_read_with_boots_unknown() -> None:
    """Version 1 as written before: no ``bootId``, no MIG device's ``boot``."""
    legacy = {
        "version": 1,
        "migSwitched": ["GPU-a"],
        "claims": {"uid-1": {"namespace": "ns", "name": "c", "devices": [{
            "requests": ["m"], "pool": "n1", "device": "gpu-0-mig-1g10gb-19-6", "cdi": ["x"],
            "uuid": "MIG-a", "mig": {"gpu": "GPU-a", "profileId": 19, "start": 6,
                                     "gpuInstance": 13}}]}},
    }  # fmt: skip
    assert boot_from_checkpoint(legacy) == ""
    (device,) = claims_from_checkpoint(legacy)["uid-1"].devices
    assert device.made == MadeMig("GPU-a", 19, 6, 13, boot="")
    # Written back unchanged but for what this agent adds: still version 1.
    written = checkpoint_json(claims_from_checkpoint(legacy), ["GPU-a"])
    assert written["version"] == 1
    assert "bootId" not in written
    assert "boot" not in written["claims"]["uid-1"]["devices"][0]["mig"]


def test_a_device_prepared_before_is_restated_against_the_node_now() -> None:
    whole = PreparedDevice(("gpu",), "n1", "gpu-0", ("x",), "GPU-a")
    static = PreparedDevice(("m",), "n1", "gpu-0-mig-1g10gb-13-0", ("y",), "MIG-old")
    # There: unchanged.
    assert restated(whole, {"GPU-a"}) is whole
    assert restated(static, {"GPU-a", "MIG-old"}, "MIG-old") is static
    # A MIG device made again under its name (MIG manager after a reboot): its new UUID.
    assert restated(static, {"GPU-a", "MIG-new"}, "MIG-new") == replace(static, uuid="MIG-new")
    # Gone, and nothing of its name: refused, naming it.
    with pytest.raises(ClaimError, match=r"gpu-0-mig-1g10gb-13-0: its MIG device MIG-old is gone"):
        restated(static, {"GPU-a"})
    with pytest.raises(ClaimError, match=r"device gpu-0: its GPU GPU-a is gone"):
        restated(whole, set())
    # A checkpoint entry without a UUID (written before they were kept) is taken as it is.
    assert restated(replace(whole, uuid=""), set()) == replace(whole, uuid="")
