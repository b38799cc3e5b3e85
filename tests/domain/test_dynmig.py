"""MIG made on demand, as DRA publishes it: a counter set per GPU, every shape at every
placement consuming its share and its memory slices, the whole GPU consuming everything, in
slices that pass the 1.37 (and 1.34) schemas and the API server's rules for counters."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import pytest
from support.fake_apiserver import K8S_VERSIONS, validate_slice
from support.nodes import gpu, mig, mig_shapes, node

from gpuagent.domain.claims import MadeMig
from gpuagent.domain.devices import Condition, Gpu, GpuHealth
from gpuagent.domain.dra import DraDevice, DraGpus, DraMig, dra_devices
from gpuagent.domain.dynmig import Standing, made_standing, partition_name, same_boot
from gpuagent.domain.migshapes import Instance, Placement
from gpuagent.domain.slices import MAX_COUNTER_SETS_PER_SLICE, slice_manifests
from gpuagent.gpu.sim.profiles import A100_80GB

DRIVER = "gpu.nvidia.com"
MIB = 1024 * 1024


def partitioned(index: int = 0, **kw: Any) -> Gpu:
    return replace(gpu(index, **kw), architecture="hopper", mig_partitions=mig_shapes())


def devices(*gpus: Gpu, mig_mode: DraMig = DraMig.DYNAMIC) -> dict[str, DraDevice]:
    return {d.name: d for d in dra_devices(node(*gpus), DraGpus(all=True), mig=mig_mode)}


def test_every_shape_at_every_placement_and_the_whole_gpu() -> None:
    published = devices(partitioned(0))
    # H100: 7 + 7 (1g.10gb, +me) + 4 (1g.20gb) + 3 (2g) + 2 (3g) + 1 (4g) + 1 (7g), and the GPU.
    assert len(published) == 26
    assert {"gpu-0", "gpu-0-mig-1g10gb-19-0", "gpu-0-mig-1g10gb-19-6", "gpu-0-mig-1g10gb-me-20-3",
            "gpu-0-mig-1g20gb-15-6", "gpu-0-mig-3g40gb-9-4", "gpu-0-mig-7g80gb-0-0"} <= set(
        published
    )  # fmt: skip
    small = published["gpu-0-mig-1g10gb-19-3"]
    assert small.made_on_prepare
    assert small.uuid == ""
    assert small.attributes["type"] == "mig"
    assert small.attributes["profile"] == "1g.10gb"
    assert small.attributes["parentUUID"] == published["gpu-0"].uuid
    assert small.capacity["multiprocessors"] == 16
    assert small.memory_bytes == 9984 * MIB


def test_counters_make_overlapping_placements_exclusive() -> None:
    published = devices(partitioned(0))
    (counter_set,) = {d.counter_set for d in published.values()}
    assert counter_set is not None
    assert counter_set.name == "gpu-0-counter-set"
    held = counter_set.counters
    assert {f"memory-slice-{i}" for i in range(8)} <= set(held)
    assert held["multiprocessors"] == 132
    assert held["memory"] == 81152 * MIB  # the largest shape's
    half = published["gpu-0-mig-3g40gb-9-4"].consumes
    assert {k for k in half if k.startswith("memory-slice")} == {
        f"memory-slice-{i}" for i in range(4, 8)
    }
    assert half["copy-engines"] == 3
    assert published["gpu-0"].consumes == held  # the whole GPU takes everything
    # Two placements that share a memory slice cannot both fit in the set.
    small = published["gpu-0-mig-1g10gb-19-5"].consumes
    assert small["memory-slice-5"] + half["memory-slice-5"] > held["memory-slice-5"]


def test_ampere_is_whole_while_mig_mode_is_off_and_partitioned_while_on() -> None:
    ampere = replace(
        gpu(0, name="NVIDIA A100-SXM4-80GB", memory_mib=81920),
        architecture="ampere",
        mig_partitions=mig_shapes(A100_80GB, toggles=False),
    )
    off = devices(ampere)
    assert list(off) == ["gpu-0"]
    assert off["gpu-0"].counter_set is None
    on = devices(replace(ampere, mig_enabled=True))
    assert "gpu-0" not in on
    assert len(on) == 25
    assert {d.counter_set.name for d in on.values() if d.counter_set} == {"gpu-0-counter-set"}


def test_shapes_unknown_or_static_publish_as_before() -> None:
    plain = gpu(0)
    assert list(devices(plain)) == ["gpu-0"]
    assert devices(partitioned(0), mig_mode=DraMig.STATIC)["gpu-0"].counter_set is None


def test_an_xid_on_an_instance_taints_only_its_placement() -> None:
    shapes = mig_shapes()
    one = next(s for s in shapes.shapes if s.name == "1g.10gb")
    made = replace(
        mig(0, 9, "1g.10gb", 9984),
        profile_id=one.profile_id,
        placement=Placement(2, 1),
        health=GpuHealth((Condition("xid", "94"),)),
    )
    sick = replace(partitioned(0), mig_devices=(made,), mig_enabled=True)
    published = devices(sick)
    at = partition_name(0, one, Placement(2, 1))
    assert not published[at].healthy
    assert [t.key for t in published[at].taints] == [f"{DRIVER}/xid"]
    unhealthy = {n for n, d in published.items() if not d.healthy}
    assert unhealthy == {at}


def _valid(manifest: dict[str, Any]) -> None:
    assert validate_slice(manifest) == []
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(manifest, version, strict=True)


@pytest.mark.parametrize("count", [1, 8, 9])
def test_slices_hold_counters_apart_from_devices_within_the_limits(count: int) -> None:
    gpus = [partitioned(i) for i in range(count)]
    published = tuple(dra_devices(node(*gpus), DraGpus(all=True), mig=DraMig.DYNAMIC))
    manifests = slice_manifests(published, node="n", node_uid="u", driver=DRIVER, generation=2)
    for manifest in manifests:
        _valid(manifest)
    shared = [m for m in manifests if "sharedCounters" in m["spec"]]
    with_devices = [m for m in manifests if m["spec"].get("devices")]
    assert len(shared) + len(with_devices) == len(manifests)
    assert sum(len(m["spec"]["sharedCounters"]) for m in shared) == count
    assert all(len(m["spec"]["sharedCounters"]) <= MAX_COUNTER_SETS_PER_SLICE for m in shared)
    assert sum(len(m["spec"]["devices"]) for m in with_devices) == 26 * count
    assert manifests[0] in shared  # counters first
    assert {m["spec"]["pool"]["resourceSliceCount"] for m in manifests} == {len(manifests)}
    device = next(d for d in with_devices[0]["spec"]["devices"] if d["name"].endswith("-9-4"))
    (use,) = device["consumesCounters"]
    assert use["counterSet"] == "gpu-0-counter-set"
    assert use["counters"]["memory"] == {"value": "40448Mi"}
    assert device["capacity"]["multiprocessors"] == {"value": "60"}


MADE = MadeMig("GPU-a", 19, 6, 13, boot="boot-1")  # a 1g.10gb at memory slice 6
AT_6 = Placement(6, 1)


def instance(gi: int, profile: int, start: int, size: int, *, computed: bool = True) -> Instance:
    return Instance(gi, profile, Placement(start, size), computed)


@pytest.mark.parametrize(
    ("found", "boot", "placement", "standing", "blocker"),
    [
        # Its instance, in its boot (or a boot unknown: the driver alone tells).
        ([instance(13, 19, 6, 1)], "boot-1", AT_6, Standing.HELD, None),
        ([instance(13, 19, 6, 1)], "", AT_6, Standing.HELD, None),
        # Nothing there: made again.
        ([], "boot-2", AT_6, Standing.GONE, None),
        ([instance(7, 19, 0, 1)], "boot-1", AT_6, Standing.GONE, None),
        # Another boot: an instance of its ID, profile and placement is someone else's.
        ([instance(13, 19, 6, 1)], "boot-2", AT_6, Standing.TAKEN, instance(13, 19, 6, 1)),
        # Its placement overlapped by another instance (a 2g.20gb over slices 6-7).
        ([instance(6, 14, 6, 2)], "boot-1", AT_6, Standing.TAKEN, instance(6, 14, 6, 2)),
        # Its GPU instance without its compute instance: not a MIG device.
        ([instance(13, 19, 6, 1, computed=False)], "boot-1", AT_6, Standing.TAKEN,
         instance(13, 19, 6, 1, computed=False)),
        # Its placement unknown (no longer offered): nothing can be found taking it.
        ([instance(6, 14, 6, 2)], "boot-1", None, Standing.GONE, None),
    ],
)  # fmt: skip
def test_where_a_made_mig_device_stands_when_its_claim_is_prepared_again(
    found: list[Instance],
    boot: str,
    placement: Placement | None,
    standing: Standing,
    blocker: Instance | None,
) -> None:
    assert made_standing(MADE, found, boot=boot, placement=placement) == (standing, blocker)


def test_a_made_mig_device_of_unknown_boot_may_be_of_any() -> None:
    assert same_boot(MADE, "boot-1")
    assert not same_boot(MADE, "boot-2")
    assert same_boot(MADE, "")
    assert same_boot(replace(MADE, boot=""), "boot-2")
