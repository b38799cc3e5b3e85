"""Which containers hold the node's DRA devices: pod-resources' claimed devices resolved to GPUs
and MIG GPU instances as the DRA side publishes them."""

from __future__ import annotations

from dataclasses import replace

from support.synthetic import synthetic_snapshot

from gpuagent.domain.accounting import account
from gpuagent.domain.attribution import Target
from gpuagent.domain.cgroups import CgroupOwner
from gpuagent.domain.devices import Allocated, Attribution, Condition, GpuHealth, PodRef
from gpuagent.domain.dra import DraGpus, DraPlan, dra_devices
from gpuagent.domain.drapods import claimed_resource, dra_holders
from gpuagent.domain.nodehealth import project
from gpuagent.domain.resources import MigStrategy
from gpuagent.domain.snapshot import Snapshot
from gpuagent.domain.usage import GpuProcess, ProcessReading

DRIVER = "gpu.nvidia.com"
ALL = DraPlan(gpus=DraGpus(all=True))


def claiming(snapshot: Snapshot, *items: tuple[str, str, str]) -> Snapshot:
    """``snapshot`` with containers ``(pod, driver, device)`` holding claimed devices."""
    allocated = tuple(
        Allocated("ns", pod, "main", claimed_resource(driver), (device,))
        for pod, driver, device in items
    )
    return replace(snapshot, pods=Attribution(allocated=allocated, refreshed_at=1.0))


def test_whole_gpus_by_their_dra_names() -> None:
    snapshot = claiming(
        synthetic_snapshot(2),
        ("a", DRIVER, "gpu-0"),
        ("b", DRIVER, "gpu-0"),
        ("c", DRIVER, "gpu-1"),
        ("x", "other.example.com", "gpu-1"),  # another driver's device of that name
        ("y", DRIVER, "gpu-7"),  # no such device here
    )
    assert dra_holders(snapshot, ALL) == {
        Target(0): (PodRef("ns", "a", "main"), PodRef("ns", "b", "main")),
        Target(1): (PodRef("ns", "c", "main"),),
    }


def test_only_the_gpus_given_to_dra() -> None:
    snapshot = claiming(synthetic_snapshot(2), ("a", DRIVER, "gpu-0"), ("c", DRIVER, "gpu-1"))
    assert dra_holders(snapshot, DraPlan(gpus=DraGpus(refs=frozenset({"1"})))) == {
        Target(1): (PodRef("ns", "c", "main"),)
    }
    assert dra_holders(snapshot, DraPlan()) == {}  # DRA off: nothing of its own


def test_a_static_mig_device_holds_its_gpu_instance() -> None:
    snapshot = synthetic_snapshot(1, mig=True)
    plan = DraPlan(gpus=DraGpus(all=True), mig_strategy=MigStrategy.MIXED)
    device = dra_devices(snapshot, plan.gpus, mig_strategy=plan.mig_strategy)[2]
    mig = next(m for m in snapshot.gpus[0].mig_devices if m.uuid == device.uuid)
    holders = dra_holders(claiming(snapshot, ("a", DRIVER, device.name)), plan)
    assert holders == {Target(0, mig.gpu_instance_id): (PodRef("ns", "a", "main"),)}


def test_nothing_without_claims_and_no_device_plugin_resource_is_taken() -> None:
    snapshot = synthetic_snapshot(2, replicas=2)  # device-plugin holders only
    assert snapshot.pods.allocated
    assert dra_holders(snapshot, ALL) == {}


def test_accounting_counts_a_claim_holders_work_as_allocated() -> None:
    snapshot = claiming(synthetic_snapshot(1), ("a", DRIVER, "gpu-0"))
    gpu = replace(
        snapshot.gpus[0],
        processes=ProcessReading(processes=(GpuProcess(11, 1 << 30),), samples=()),
    )
    snapshot = replace(snapshot, gpus=(gpu,))
    owners = {11: CgroupOwner("c" * 64, "uid-a")}
    names = {"c" * 64: PodRef("ns", "a", "main")}
    without, _ = account(snapshot, owners, names)  # DRA's claims not consulted
    (usage,) = without.containers
    assert usage.unallocated
    with_dra, _ = account(snapshot, owners, names, dra=ALL)
    (usage,) = with_dra.containers
    assert usage.allocated
    assert not usage.unallocated


def test_the_node_health_view_names_claim_holders_of_a_failing_gpu() -> None:
    snapshot = claiming(synthetic_snapshot(2), ("a", DRIVER, "gpu-1"))
    failing = replace(
        snapshot,
        gpus=(snapshot.gpus[0], replace(snapshot.gpus[1], health=GpuHealth((Condition("lost"),)))),
    )
    view = project(failing, ("nvidia.com/gpu",), lambda: dra_holders(failing, ALL))
    assert view is not None
    (fault,) = view.faults
    assert view.holders_of(fault.device) == (PodRef("ns", "a", "main"),)
