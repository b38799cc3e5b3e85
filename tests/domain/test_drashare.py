"""DRA shares of a GPU (--dra-sharing mps) as values: quantities, the published capacities and
their request policies (valid for the 1.34 and 1.37 schemas and the API server's rules), a
claim's consumed capacity read into a share, the checkpoint, and the devices as served."""

from __future__ import annotations

from dataclasses import replace
from fractions import Fraction
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import pytest
from support.fake_apiserver import K8S_VERSIONS, claim, validate_slice
from support.nodes import gpu, gpu_uuid, mig, node

from gpuagent.domain.apivalues import quantity
from gpuagent.domain.claims import (
    ClaimRef,
    PreparedClaim,
    PreparedDevice,
    checkpoint_json,
    claims_from_checkpoint,
)
from gpuagent.domain.devices import Condition, GpuHealth
from gpuagent.domain.dra import DraGpus, DraPlan
from gpuagent.domain.drashare import (
    MIB,
    DraSharing,
    Share,
    ShareError,
    claim_shares,
    lone_share,
    memory_policy,
    share_daemon,
)
from gpuagent.domain.drasharing import served_devices, share_daemons
from gpuagent.domain.mps import MpsState, MpsStatus
from gpuagent.domain.resources import MigStrategy
from gpuagent.domain.slices import slice_manifests

DRIVER = "gpu.nvidia.com"
POOL = "n1"
H100_MIB = 81559
SHARED = DraPlan(gpus=DraGpus(all=True), sharing=DraSharing.MPS, mig_strategy=MigStrategy.MIXED)


@pytest.mark.parametrize(
    ("text", "value"),
    [("16Gi", 16 << 30), ("81559Mi", 81559 << 20), ("25", 25), ("500m", Fraction(1, 2)),
     ("1e3", 1000), ("10G", 10**10), ("1.5Ki", 1536), (".5", Fraction(1, 2)), ("+3k", 3000)],
)  # fmt: skip
def test_quantities_read_as_kubernetes_writes_them(text: str, value: Fraction) -> None:
    assert quantity(text) == value


@pytest.mark.parametrize("bad", ["", "Gi", "1 Gi", "1GiB", "1.2.3", "0x10", "1e"])
def test_what_is_not_a_quantity_is_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="not a Kubernetes quantity"):
        quantity(bad)


def test_a_shared_gpu_is_published_with_consumable_memory_and_compute() -> None:
    snapshot = node(gpu(0), gpu(1, migs=[mig(1, 3, "3g.40gb", 40192)]))
    up = MpsState().with_status(
        f"{DRIVER}/gpu-0", MpsStatus(up=True, daemon=share_daemon(DRIVER, "gpu-0", 0, gpu_uuid(0)))
    )
    devices = served_devices(replace(snapshot, mps=up), SHARED)
    assert [(d.name, d.shared) for d in devices] == [
        ("gpu-0", True),
        ("gpu-1-mig-3g40gb-3-0", False),
    ]
    (manifest,) = slice_manifests(devices, node=POOL, node_uid="u", driver=DRIVER, generation=1)
    assert validate_slice(manifest) == []
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(manifest, version, strict=True)
    shared, whole_mig = manifest["spec"]["devices"]
    assert shared["allowMultipleAllocations"] is True
    assert shared["capacity"] == {
        "memory": {"value": f"{H100_MIB}Mi", "requestPolicy": {
            "default": f"{H100_MIB}Mi",
            "validRange": {"min": "1Gi", "max": f"{H100_MIB}Mi", "step": "1Mi"}}},
        "compute": {"value": "100", "requestPolicy": {
            "default": "100", "validRange": {"min": "1", "max": "100", "step": "1"}}},
    }  # fmt: skip
    assert "allowMultipleAllocations" not in whole_mig
    assert "taints" not in shared


def test_the_stand_in_refuses_what_the_api_server_refuses() -> None:
    """The request-policy rules the stand-in checks the agent's slices against can fail."""
    policy = {"default": "100", "validRange": {"min": "1", "max": "100", "step": "1"}}
    device: dict[str, Any] = {
        "name": "gpu-0",
        "capacity": {"compute": {"value": "100", "requestPolicy": policy}},
    }
    manifest = slice_manifests((), node=POOL, node_uid="u", driver=DRIVER, generation=1)[0]
    manifest["spec"]["devices"] = [device]
    assert validate_slice(manifest) == [
        "spec.devices[0].capacity[compute].requestPolicy: allowMultipleAllocations must be true"
    ]
    device["allowMultipleAllocations"] = True
    assert validate_slice(manifest) == []
    device["capacity"]["compute"]["requestPolicy"]["validRange"]["min"] = "3"
    device["capacity"]["compute"]["requestPolicy"]["validRange"]["step"] = "2"
    assert len(validate_slice(manifest)) == 2  # neither 100 nor max is a whole step from 3


@pytest.mark.parametrize("mib", [H100_MIB, 143771, 1024, 2, 1536])
def test_the_memory_policy_is_valid_for_any_gpu(mib: int) -> None:
    policy = memory_policy(mib * MIB)
    assert policy.default == policy.max == mib * MIB
    assert 0 <= policy.min <= policy.max - policy.step
    assert (policy.max - policy.min) % policy.step == 0


def _claim(consumed: dict[str, str] | None, *devices: str) -> dict[str, Any]:
    results = [(f"r{i}", DRIVER, POOL, d) for i, d in enumerate(devices or ("gpu-0",))]
    return claim("ns", "c", "u1", results, consumed=consumed)


SHARED_MIB = {"gpu-0": H100_MIB, "gpu-1": H100_MIB}


@pytest.mark.parametrize(
    ("consumed", "want"),
    [
        ({"memory": "16Gi", "compute": "25"}, Share(16384, 25)),
        ({"memory": "10G", "compute": "12.5"}, Share(9536, 13)),  # whole MiB down, percent up
        ({"memory": f"{H100_MIB}Mi", "compute": "50"}, Share(H100_MIB, 50)),
        ({"memory": f"{H100_MIB}Mi", "compute": "100"}, None),  # the whole GPU
        ({"memory": "8Gi"}, Share(8192, 100)),  # a capacity not listed is consumed whole
        (None, None),  # no consumedCapacity at all: a scheduler without KEP-5075
    ],
)
def test_a_claims_consumed_capacity_is_its_share(
    consumed: dict[str, str] | None, want: Share | None
) -> None:
    shares = claim_shares(_claim(consumed), driver=DRIVER, pool=POOL, shared=SHARED_MIB)
    assert shares.get("gpu-0") == want


def test_results_of_one_device_add_up_and_others_are_not_ours() -> None:
    obj = _claim({"memory": "4Gi", "compute": "10"}, "gpu-0", "gpu-0", "gpu-1")
    obj["status"]["allocation"]["devices"]["results"][2]["driver"] = "other.example.com"
    shares = claim_shares(obj, driver=DRIVER, pool=POOL, shared=SHARED_MIB)
    assert shares == {"gpu-0": Share(8192, 20)}


@pytest.mark.parametrize(
    ("consumed", "message"),
    [
        ({"memory": "0", "compute": "10"}, "a share needs some of both"),
        ({"memory": "1Gi", "compute": "0"}, "a share needs some of both"),
        ({"memory": "100000Mi", "compute": "10"}, "more than the GPU has"),
        ({"memory": "1Gi", "compute": "150"}, "more than the GPU has"),
        ({"memory": "lots", "compute": "10"}, "consumed memory: 'lots' is not"),
    ],
)
def test_a_consumed_capacity_no_share_can_hold_is_refused(
    consumed: dict[str, str], message: str
) -> None:
    obj = _claim({"memory": "1Gi", "compute": "1"})
    obj["status"]["allocation"]["devices"]["results"][0]["consumedCapacity"] = consumed
    with pytest.raises(ShareError, match=message):
        claim_shares(obj, driver=DRIVER, pool=POOL, shared=SHARED_MIB)


def test_a_claim_with_a_share_holds_no_other_device() -> None:
    assert lone_share(["gpu-0"], {"gpu-0": Share(1024, 10)}) is None
    assert lone_share(["gpu-0", "gpu-1"], {}) is None  # whole GPUs: as without sharing
    said = lone_share(["gpu-0", "gpu-1"], {"gpu-0": Share(1024, 10)})
    assert said is not None
    assert said.startswith("the claim holds gpu-0, gpu-1 with a share of gpu-0: ")


def test_the_checkpoint_keeps_every_share_and_reads_entries_without_one() -> None:
    ref = ClaimRef("ns", "c", "u1")
    shared = PreparedDevice(("gpu",), POOL, "gpu-0", ("x",), gpu_uuid(0), share=Share(4096, 30))
    whole = PreparedDevice(("gpu",), POOL, "gpu-1", ("y",), gpu_uuid(1))
    claims = {"u1": PreparedClaim(ref, (shared, whole))}
    document = checkpoint_json(claims)
    assert document["claims"]["u1"]["devices"][0]["share"] == {"memoryMiB": 4096, "compute": 30}
    assert "share" not in document["claims"]["u1"]["devices"][1]
    assert claims_from_checkpoint(document) == claims
    document["claims"]["u1"]["devices"][0]["share"] = {"memoryMiB": "4096", "compute": 30}
    with pytest.raises(ValueError, match="malformed"):
        claims_from_checkpoint(document)


def test_a_shared_gpus_device_follows_its_daemon() -> None:
    """Starting: unhealthy (nothing prepared on it) but not tainted (no fault: a start is no
    news for the slices); down after it ran or failed: tainted too; up: neither."""
    daemon = share_daemon(DRIVER, "gpu-0", 0, gpu_uuid(0))
    snapshot = node(gpu(0))

    def served(status: MpsStatus | None) -> Any:
        state = MpsState().with_status(daemon.name, status)
        (device,) = served_devices(replace(snapshot, mps=state), SHARED)
        return device

    starting = served(None)
    assert (starting.healthy, starting.taints) == (False, ())
    assert starting.reason == f"MPS control daemon for {DRIVER}/gpu-0: not started"
    down = served(MpsStatus(up=False, error="exited with status 1", daemon=daemon))
    assert not down.healthy
    assert [(t.key, t.value, t.effect.value) for t in down.taints] == [
        (f"{DRIVER}/mps-daemon", "", "NoSchedule")
    ]
    assert down.reason.endswith("exited with status 1")
    up = served(MpsStatus(up=True, error="", daemon=daemon))
    assert (up.healthy, up.taints, up.reason) == (True, (), "")


def test_a_failing_gpus_reason_keeps_its_own_cause_first() -> None:
    sick = replace(gpu(0), health=GpuHealth((Condition("xid", "48"),)))
    state = MpsState().with_status(f"{DRIVER}/gpu-0", MpsStatus(up=False, error="killed"))
    (device,) = served_devices(replace(node(sick), mps=state), SHARED)
    assert device.reason.startswith("xid 48; MPS control daemon")
    assert [t.key for t in device.taints] == [f"{DRIVER}/xid", f"{DRIVER}/mps-daemon"]


def test_one_daemon_per_shared_gpu_and_none_without_sharing() -> None:
    snapshot = node(gpu(0), gpu(1, migs=[mig(1, 3)]), gpu(2))
    plan = replace(SHARED, gpus=DraGpus.parse("0,1"))
    assert [d.name for d in share_daemons(snapshot, plan)] == [f"{DRIVER}/gpu-0"]
    assert share_daemons(snapshot, replace(plan, sharing=DraSharing.NONE)) == ()
    (daemon,) = share_daemons(snapshot, plan)
    assert daemon.commands() == ()  # no defaults: each client brings its claim's limits
    assert daemon.uuids == (gpu_uuid(0),)
