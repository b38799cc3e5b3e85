"""Each DRA claim's use of its share of a GPU: joined from the kubelet's pod-resources and the
per-container accounting, compared with the share; an event on each pod holding a claim that
goes over (once per episode); /metrics' shares families (two series by default)."""

from __future__ import annotations

from dataclasses import replace

from prometheus_client.parser import text_string_to_metric_families
from support.nodes import gpu, gpu_uuid, node

from gpuagent.domain.devices import Allocated, Attribution, PodRef, claimed_resource
from gpuagent.domain.dra import DraGpus, DraPlan
from gpuagent.domain.drashare import MIB, ClaimShare, DraSharing, Share
from gpuagent.domain.nodehealth import NodeHealthModel, NodeHealthView, project
from gpuagent.domain.plan import Plan
from gpuagent.domain.shareuse import overused, share_uses
from gpuagent.domain.snapshot import Snapshot
from gpuagent.domain.usage import ContainerUsage, Usage
from gpuagent.web.exposition import render
from gpuagent.web.mpsfamilies import mps_families

DRIVER = "gpu.nvidia.com"
T0 = 1_767_225_600.0
SHARE = ClaimShare(DRIVER, "ml", "small", "uid-s", "gpu-0", gpu_uuid(0), Share(4096, 25))
OTHER = ClaimShare(DRIVER, "ml", "big", "uid-b", "gpu-0", gpu_uuid(0), Share(8192, 50))
PLAN = Plan(dra=DraPlan(gpus=DraGpus(all=True), sharing=DraSharing.MPS))


def _held(pod: str, claim: str, device: str = "gpu-0", container: str = "main") -> Allocated:
    return Allocated("ml", pod, container, claimed_resource(DRIVER), (device,), f"ml/{claim}")


def _using(pod: str, mib: int, gpu_index: int = 0, container: str = "main") -> ContainerUsage:
    return ContainerUsage(gpu_index, None, "ml", pod, container, 1, mib * MIB, allocated=True)


def _state(*usage: ContainerUsage, uids: tuple[tuple[str, str, str], ...] = ()) -> Snapshot:
    held = (_held("a", "small"), _held("a", "small", container="side"), _held("b", "big"))
    return replace(
        node(gpu(0), gpu(1)),
        plan=PLAN,
        shares=(SHARE, OTHER),
        pods=Attribution(allocated=held),
        usage=Usage(containers=usage, pod_uids=uids),
    )


def test_a_claims_use_is_its_holders_memory_on_its_gpu() -> None:
    state = _state(_using("a", 3000), _using("a", 2000, container="side"), _using("a", 9999, 1),
                   _using("b", 100), _using("c", 50000))  # fmt: skip
    small, big = share_uses(state)
    assert small.holders == (PodRef("ml", "a", "main"), PodRef("ml", "a", "side"))
    assert small.used_bytes == 5000 * MIB  # its GPU only, both containers
    assert small.over
    assert (big.used_bytes, big.over) == (100 * MIB, False)
    (over,) = overused(state)
    assert (over.share, over.gpu) == (SHARE, 0)


def test_a_claim_no_container_is_known_to_hold_has_no_use_and_is_never_over() -> None:
    state = replace(_state(_using("a", 9000)), pods=Attribution())
    assert [(u.used_bytes, u.over) for u in share_uses(state)] == [(None, False), (None, False)]
    assert share_uses(replace(state, shares=())) == ()


def test_going_over_is_one_event_on_each_pod_per_episode() -> None:
    uid = ("ml", "a", "4f1c1a4e-0000-4000-8000-000000000001")
    model = NodeHealthModel("node-a")
    served = PLAN.served_resources
    under, over = _state(_using("a", 1000)), _state(_using("a", 5000), uids=(uid,))
    more = _state(_using("a", 7000), uids=(uid,))
    model.observe(_view(under), T0)
    assert model.pending_events() == []
    model.observe(_view(over), T0 + 1)
    (event,) = model.pending_events()
    assert (event.type, event.key.reason, event.action) == (
        "Warning", "GPUShareExceeded", "CheckGPUShare"
    )  # fmt: skip
    assert event.key.regarding.reference() == {
        "apiVersion": "v1", "kind": "Pod", "name": "a", "namespace": "ml", "uid": uid[2]
    }  # fmt: skip
    assert event.key.note.startswith(
        "the processes of claim ml/small in this pod (containers main, side) use more memory of "
        f"GPU 0 ({gpu_uuid(0)}) than the claim's share (4096 MiB, 25 % of compute)"
    )
    # Using more still: the same view (an episode is one value), no second occurrence.
    assert project(more, served) == project(over, served)
    assert not model.observe(_view(more), T0 + 2)
    # Under, then over again: the same event's series.
    model.observe(_view(under), T0 + 3)
    model.observe(_view(over), T0 + 4)
    (again,) = model.pending_events()
    assert again.count == 2


def _view(state: Snapshot) -> NodeHealthView:
    view = project(state, PLAN.served_resources)
    assert view is not None
    return view


def test_shares_on_metrics_are_two_series_by_default_and_per_claim_in_detail() -> None:
    state = _state(_using("a", 5000), _using("b", 100))

    def page(detailed: bool) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        text = render(mps_families(state, detailed=detailed))
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
        }

    assert page(False) == {
        ("gpuagent_dra_shared_claims", ()): 2,
        ("gpuagent_dra_claims_over_share", ()): 1,
    }
    detailed = page(True)
    labels = (("UUID", gpu_uuid(0)), ("claim", "small"), ("device", "gpu-0"), ("namespace", "ml"))
    assert detailed[("gpuagent_dra_claim_share_memory_bytes", labels)] == 4096 * MIB
    assert detailed[("gpuagent_dra_claim_share_compute_ratio", labels)] == 0.25
    assert detailed[("gpuagent_dra_claim_memory_used_bytes", labels)] == 5000 * MIB
    assert len(detailed) == 2 + 3 * 2
    unshared = replace(state, plan=Plan())
    assert render(mps_families(unshared, detailed=True)) == ""
