"""What the device series' labels depend on, kept while only readings change.

A layout holds each series' label blocks and the identity families;
:class:`gpuagent.web.metrics.MetricsRenderer` builds a new one only when a GPU's identity, the
driver, the pods or the served resources change.

A GPU (or MIG GPU instance) has **one** series per family: with the labels of the container
holding it when exactly one does (as dcgm-exporter's dashboards expect), with empty pod labels
when none does or several share it (time-slicing: who shares it is told by
``gpuagent_device_allocated`` and the ``gpuagent_container_*`` families). ``per_container``
(``--dcgm-series-per-container``) gives instead one series per container holding it, each with
that container's labels: the series then multiply by the containers sharing a GPU.
"""

from __future__ import annotations

from collections.abc import Collection, Generator
from dataclasses import dataclass

from gpuagent.domain.attribution import Target, attributions, by_device, merged
from gpuagent.domain.devices import Allocated, Gpu, MigDevice, PodRef
from gpuagent.domain.dra import DraPlan
from gpuagent.domain.drapods import dra_holders
from gpuagent.domain.snapshot import Snapshot
from gpuagent.web.exposition import escape_label, label_pairs
from gpuagent.web.gpufamilies import identity_families

__all__ = ["Layout", "Series", "build_layout", "identity", "layout_steps"]


@dataclass(frozen=True, slots=True)
class Series:
    """One series' device and label blocks (one per container holding it, or one unattributed).

    ``gpu`` and ``mig`` are positions in ``snapshot.gpus`` and that GPU's ``mig_devices``.
    """

    target: Target
    gpu: int
    mig: int | None
    blocks: tuple[bytes, ...]
    # The container of each block (none when unattributed or shared, one series per device).
    refs: tuple[PodRef, ...] = ()


@dataclass(frozen=True, slots=True)
class Layout:
    """What stays put while only readings change: series, label blocks and identity families."""

    gpus: tuple[object, ...]
    driver: str
    allocated: tuple[Allocated, ...]
    served: frozenset[str]
    dra: DraPlan  # whose claims hold devices too
    per_container: bool
    device_ids: int  # device IDs of served resources the kubelet lists as held
    series: tuple[Series, ...]
    static: bytes


def build_layout(
    snapshot: Snapshot,
    served: Collection[str],
    gpus: tuple[object, ...],
    host: str,
    *,
    per_container: bool = False,
) -> Layout:
    """The layout of ``snapshot`` under ``served``; ``gpus`` are its GPUs' :func:`identity`,
    ``host`` the host label (``,Hostname="..."``, or empty); ``per_container``: a series per
    container holding a device (else one per device)."""
    steps = layout_steps(snapshot, served, gpus, host, per_container=per_container)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            layout: Layout = done.value
            return layout


def layout_steps(
    snapshot: Snapshot,
    served: Collection[str],
    gpus: tuple[object, ...],
    host: str,
    *,
    per_container: bool = False,
) -> Generator[None, None, Layout]:
    """:func:`build_layout` in steps of about 2 ms at 50 containers a GPU (the caller may hand
    the event loop back at each ``yield``); returns the layout."""
    driver = snapshot.driver.version
    allocated = snapshot.pods.allocated
    mapping = by_device(allocated, served)
    yield
    # The containers holding each device through the device plugin, and through DRA claims.
    pods = merged(attributions(snapshot, mapping), dra_holders(snapshot, snapshot.plan.dra))
    yield
    tail = f'{host},DCGM_FI_DRIVER_VERSION="{escape_label(driver)}"'
    series = []
    for position, gpu in enumerate(snapshot.gpus):
        base = label_pairs(
            (
                ("gpu", str(gpu.index)),
                ("UUID", gpu.uuid),
                ("pci_bus_id", gpu.pci_bus_id),
                ("device", f"nvidia{gpu.index}"),  # dcgm-exporter: the index, not the minor
                ("modelName", gpu.name),
            )
        )
        instances = _gpu_instances(gpu) if gpu.mig_enabled else []
        if not instances:
            target = Target(gpu.index)
            refs = _labelled(pods.get(target, ()), per_container)
            series.append(Series(target, position, None, _blocks(base + tail, refs), refs))
            continue
        for mig_position, mig in instances:
            target = Target(gpu.index, mig.gpu_instance_id)
            labels = (
                f'{base},GPU_I_PROFILE="{escape_label(mig.profile)}"'
                f',GPU_I_ID="{mig.gpu_instance_id}"{tail}'
            )
            refs = _labelled(pods.get(target, ()), per_container)
            series.append(Series(target, position, mig_position, _blocks(labels, refs), refs))
    yield
    return Layout(
        gpus=gpus,
        driver=driver,
        allocated=allocated,
        served=frozenset(served),
        dra=snapshot.plan.dra,
        per_container=per_container,
        device_ids=len(mapping),
        series=tuple(series),
        static=identity_families(snapshot, pods).encode(),
    )


def identity(gpu: Gpu) -> object:
    """What a GPU's series labels depend on (not its readings or health)."""
    return (
        gpu.index,
        gpu.uuid,
        gpu.minor,
        gpu.name,
        gpu.pci_bus_id,
        gpu.numa_node,
        gpu.mig_enabled,
        tuple(
            (m.uuid, m.gpu_instance_id, m.compute_instance_id, m.profile) for m in gpu.mig_devices
        ),
    )


def _gpu_instances(gpu: Gpu) -> list[tuple[int, MigDevice]]:
    """One MIG device per GPU instance (dcgm-exporter reports GPU instances, not CIs)."""
    seen: dict[int, tuple[int, MigDevice]] = {}
    for position, mig in enumerate(gpu.mig_devices):
        seen.setdefault(mig.gpu_instance_id, (position, mig))
    return [seen[gi] for gi in sorted(seen)]


def _labelled(refs: tuple[PodRef, ...], per_container: bool) -> tuple[PodRef, ...]:
    """The containers a device's series are labelled with: each one per container, else the
    one holding it alone (none when unheld or shared)."""
    return refs if per_container or len(refs) == 1 else ()


_EMPTY_POD = ',container="",namespace="",pod=""'


def _blocks(labels: str, refs: tuple[PodRef, ...]) -> tuple[bytes, ...]:
    if not refs:
        return ((labels + _EMPTY_POD).encode(),)
    return tuple(
        (
            f'{labels},container="{escape_label(r.container)}"'
            f',namespace="{escape_label(r.namespace)}",pod="{escape_label(r.pod)}"'
        ).encode()
        for r in refs
    )
