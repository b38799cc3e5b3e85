"""Synthetic snapshots: GPUs, MIG devices, telemetry and pod attribution built in memory.

For renderer tests and the render benchmark, where a simulated driver would only add noise (and
where the simulator cannot yet produce the shape wanted, e.g. 1,024 replicas).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields, replace
from types import MappingProxyType

from gpuagent.domain.devices import (
    Allocated,
    Attribution,
    DriverState,
    Gpu,
    MigDevice,
    PodRef,
    Registration,
    Telemetry,
)
from gpuagent.domain.snapshot import Snapshot
from gpuagent.domain.usage import ContainerUsage, ProcessReading, Usage

__all__ = ["full_telemetry", "gpu_uuid", "mig_uuid", "synthetic_snapshot", "with_usage"]

# Seven 1g slices of an H100 80GB: profile and GPU-instance id per MIG device.
MIG_1G = tuple(("1g.10gb", gi) for gi in range(7, 14))


def gpu_uuid(index: int) -> str:
    return f"GPU-{index:08x}-aaaa-bbbb-cccc-{index:012x}"


def mig_uuid(gpu: int, gi: int) -> str:
    return f"MIG-{gpu:08x}-{gi:04x}-bbbb-cccc-{gi:012x}"


def full_telemetry(seed: int = 0) -> Telemetry:
    """A Telemetry with every field set to a distinct, plausible value."""
    values = {f.name: float(10 + i + seed) for i, f in enumerate(fields(Telemetry))}
    values["energy_mj"] = 123_456_789.0 + seed
    values["power_w"] = 312.5 + seed
    for ratio in ("gr_engine_active", "sm_active", "sm_occupancy", "tensor_active", "dram_active"):
        values[ratio] = 0.25
    return Telemetry(**values)


def synthetic_snapshot(
    gpus: int = 8,
    *,
    mig: bool = False,
    replicas: int = 0,
    model: str = "NVIDIA H100 80GB HBM3",
    version: int = 1,
    pod_prefix: str = "pod",
    namespace: str = "team-a",
    refreshed_at: float | None = 100.0,
) -> Snapshot:
    """``gpus`` GPUs, each with 7 MIG devices when ``mig``; with ``replicas`` > 0 every GPU (or MIG
    device) is shared by that many replicas, each held by its own pod."""
    built = []
    allocated: list[Allocated] = []
    for i in range(gpus):
        migs: tuple[MigDevice, ...] = ()
        if mig:
            migs = tuple(
                MigDevice(
                    uuid=mig_uuid(i, gi),
                    parent_index=i,
                    gpu_instance_id=gi,
                    compute_instance_id=0,
                    profile=profile,
                    memory_mib=9856,
                    telemetry=Telemetry(fb_used_mib=100.0 + gi, fb_free_mib=9000.0),
                )
                for profile, gi in MIG_1G
            )
        built.append(
            Gpu(
                index=i,
                uuid=gpu_uuid(i),
                minor=i,
                name=model,
                memory_mib=81559,
                pci_bus_id=f"00000000:{0x18 + i:02X}:00.0",
                numa_node=i * 2 // max(gpus, 1),
                telemetry=full_telemetry(i),
                mig_enabled=mig,
                mig_devices=migs,
            )
        )
        ids = [m.uuid for m in migs] if mig else [gpu_uuid(i)]
        resource = "nvidia.com/mig-1g.10gb" if mig else "nvidia.com/gpu"
        for device_id in ids:
            for r in range(replicas):
                pod = f"{pod_prefix}-{i}-{device_id[-4:]}-{r}"
                allocated.append(
                    Allocated(namespace, pod, "main", resource, (f"{device_id}::{r}",))
                )
    return Snapshot(
        version=version,
        gpus=tuple(built),
        driver=DriverState(up=True, version="580.95.05"),
        discovered=True,
        registrations=MappingProxyType({"nvidia.com/gpu": Registration(registered=True)}),
        pods=Attribution(
            allocated=tuple(allocated), refreshed_at=refreshed_at if replicas else None
        ),
    )


def with_usage(snapshot: Snapshot, seed: int = 0) -> Snapshot:
    """``snapshot`` with per-container accounting: every container holding a GPU (or MIG device)
    uses it, each with readings of its own (MIG: no per-process utilisation, as NVML has none),
    and the kubelet's allocations known (unallocated use judged: none)."""
    mig_of = {m.uuid: (g.index, m.gpu_instance_id) for g in snapshot.gpus for m in g.mig_devices}
    by_uuid = {g.uuid: g.index for g in snapshot.gpus}
    rows = []
    for n, held in enumerate(snapshot.pods.allocated):
        device = held.device_ids[0].split("::")[0]
        gpu, instance = mig_of.get(device, (by_uuid.get(device, 0), None))
        share = None if instance is not None else round(0.001 * (n % 97 + seed), 6)
        rows.append(
            ContainerUsage(
                gpu, instance, held.namespace, held.pod, held.container, processes=1 + n % 3,
                memory_bytes=(256 + n * 7 + seed) * 1024 * 1024, sm_ratio=share,
                mem_ratio=share, energy_joules=None if share is None else 1000.0 + n + seed,
                allocated=True,
            )
        )  # fmt: skip
    rows.sort(key=lambda u: (u.gpu, u.gpu_instance or -1, u.namespace, u.pod, u.container))
    gpus = tuple(replace(g, processes=ProcessReading()) for g in snapshot.gpus)
    return replace(snapshot, gpus=gpus, usage=Usage(tuple(rows), judged=True))


def pods_by_device(
    mapping: Mapping[str, tuple[PodRef, ...]],
    resource: str = "nvidia.com/gpu",
    refreshed_at: float = 1.0,
) -> Attribution:
    """Pods holding the given device IDs, as the kubelet would list them."""
    return Attribution(
        allocated=tuple(
            Allocated(ref.namespace, ref.pod, ref.container, resource, (device_id,))
            for device_id, refs in mapping.items()
            for ref in refs
        ),
        refreshed_at=refreshed_at,
    )
