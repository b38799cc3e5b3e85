"""Small hand-built nodes for the allocation, CDI and label tests: GPUs, MIG devices, links."""

from __future__ import annotations

import random
from collections.abc import Iterable

from gpuagent.domain.devices import (
    Condition,
    DriverState,
    Gpu,
    GpuHealth,
    Link,
    MigDevice,
    P2PLevel,
    Topology,
)
from gpuagent.domain.migshapes import MigPartitions, MigShape, Placement
from gpuagent.domain.snapshot import Snapshot
from gpuagent.gpu.sim.profiles import H100_80GB, GpuProfile

__all__ = [
    "H100",
    "gpu",
    "gpu_uuid",
    "island_node",
    "link",
    "mig",
    "mig_shapes",
    "mig_uuid",
    "node",
]

H100 = "NVIDIA H100 80GB HBM3"


def gpu_uuid(index: int) -> str:
    return f"GPU-{index:08x}-1111-4222-8333-{index:012x}"


def mig_uuid(gpu_index: int, gi: int) -> str:
    return f"MIG-{gpu_index:08x}-{gi:04x}-4555-8666-{gi:012x}"


def mig(gpu_index: int, gi: int, profile: str = "1g.10gb", memory_mib: int = 9856) -> MigDevice:
    """A MIG device with GPU instance ``gi`` (compute instance 0) and its two caps nodes."""
    return MigDevice(
        uuid=mig_uuid(gpu_index, gi),
        parent_index=gpu_index,
        gpu_instance_id=gi,
        compute_instance_id=0,
        profile=profile,
        memory_mib=memory_mib,
        device_nodes=(
            f"/dev/nvidia-caps/nvidia-cap{100 + 10 * gpu_index + gi}",
            f"/dev/nvidia-caps/nvidia-cap{200 + 10 * gpu_index + gi}",
        ),
    )


def mig_shapes(model: GpuProfile = H100_80GB, *, toggles: bool = True) -> MigPartitions:
    """The MIG shapes and placements a driver offers for ``model`` (the simulator's table)."""
    return MigPartitions(
        shapes=tuple(
            MigShape(
                name=p.name,
                gi_profile=p.gi_profile,
                profile_id=p.profile_id,
                slices=p.slices,
                memory_mib=p.memory_mib,
                multiprocessors=p.multiprocessors,
                copy_engines=p.engines["copy"],
                decoders=p.engines["decoders"],
                encoders=p.engines["encoders"],
                jpeg_engines=p.engines["jpeg"],
                ofa_engines=p.engines["ofa"],
                placements=tuple(Placement(start, p.memory_slices) for start in p.placements),
            )
            for p in model.mig_profiles
        ),
        toggles=toggles,
    )


def gpu(
    index: int,
    *,
    numa: int | None = None,
    healthy: bool = True,
    name: str = H100,
    memory_mib: int = 81559,
    compute_capability: str = "9.0",
    migs: Iterable[MigDevice] = (),
    mig_enabled: bool | None = None,
    mig_capable: bool | None = None,
) -> Gpu:
    devices = tuple(migs)
    return Gpu(
        index=index,
        uuid=gpu_uuid(index),
        minor=index,
        name=name,
        memory_mib=memory_mib,
        pci_bus_id=f"00000000:{0x18 + index:02x}:00.0",
        numa_node=numa,
        health=GpuHealth() if healthy else GpuHealth((Condition("xid", "79"),)),
        compute_capability=compute_capability,
        mig_capable=mig_capable,
        mig_enabled=bool(devices) if mig_enabled is None else mig_enabled,
        mig_devices=devices,
    )


def link(a: int, b: int, nvlinks: int = 0, p2p: P2PLevel | None = None) -> Link:
    return Link(min(a, b), max(a, b), p2p=p2p, nvlinks=nvlinks)


def node(*gpus: Gpu, links: Iterable[Link] = (), driver: str = "550.54.15") -> Snapshot:
    return Snapshot(
        version=1,
        gpus=tuple(gpus),
        driver=DriverState(up=True, version=driver),
        discovered=True,
        topology=Topology(links=tuple(links)),
    )


def island_node(gpus: int, *, islands: int = 2, seed: int = 0) -> Snapshot:
    """``gpus`` GPUs in NVLink islands, one per NUMA node, with uneven link counts.

    Within an island every pair has 2 to 6 NVLinks (seeded), so scores differ and the search
    cannot prune on ties; across islands the GPUs share only the SMP interconnect.
    """
    rng = random.Random(seed)
    per_island = max(1, gpus // islands)
    island = [min(i // per_island, islands - 1) for i in range(gpus)]
    devices = tuple(
        Gpu(
            index=i,
            uuid=f"GPU-{i:08x}-0000-4000-8000-{i:012x}",
            minor=i,
            name="NVIDIA H100 80GB HBM3",
            memory_mib=81559,
            pci_bus_id=f"00000000:{0x18 + i:02x}:00.0",
            numa_node=island[i],
        )
        for i in range(gpus)
    )
    links = []
    for a in range(gpus):
        for b in range(a + 1, gpus):
            same = island[a] == island[b]
            links.append(
                Link(
                    a,
                    b,
                    p2p=P2PLevel.NODE if same else P2PLevel.SYSTEM,
                    nvlinks=rng.randint(2, 6) if same else 0,
                )
            )
    return Snapshot(gpus=devices, topology=Topology(links=tuple(links)))
