"""Our own per-GPU families in the device part: health, conditions, XID counts, identity.

They change only with a new snapshot version, so they are rendered with the device part and
cached with it (see :mod:`gpuagent.web.metrics`); the identity families change only with the
layout (see :mod:`gpuagent.web.layout`).
"""

from __future__ import annotations

from gpuagent.domain.attribution import Target
from gpuagent.domain.devices import PodRef
from gpuagent.domain.snapshot import Snapshot
from gpuagent.web.dcgm import xid_action, xid_label
from gpuagent.web.exposition import Family, escape_label, label_pairs, render

__all__ = ["health_families", "identity_families"]


def health_families(snapshot: Snapshot) -> str:
    healthy = Family(
        "gpuagent_gpu_healthy",
        "gauge",
        "Whether the GPU and every MIG device of it are Healthy (1) or not (0), as the "
        "kubelet is told.",
    )
    condition = Family(
        "gpuagent_gpu_condition",
        "gauge",
        "Active reasons a GPU is unhealthy (1 while active); gpu_instance and "
        "compute_instance name a MIG device when the reason is that device's alone.",
    )
    mig_healthy = Family(
        "gpuagent_mig_device_healthy",
        "gauge",
        "Whether the kubelet is told the MIG device is Healthy (1) or Unhealthy (0).",
    )
    xids = Family(
        "gpuagent_xid_errors_total",
        "counter",
        'XID errors reported by the driver, per XID of NVIDIA\'s catalog (xid="other": any '
        "other value), with the catalog's immediate action.",
    )
    for gpu in snapshot.gpus:
        own = (("gpu", str(gpu.index)), ("uuid", gpu.uuid))
        healthy.add(own, 1 if gpu.overall_health.healthy else 0)
        for c in gpu.health.conditions:
            condition.add((*own, ("condition", c.kind), ("detail", c.detail)), 1)
        for m in gpu.mig_devices:
            instance = (
                ("gpu_instance", str(m.gpu_instance_id)),
                ("compute_instance", str(m.compute_instance_id)),
            )
            mig_healthy.add(
                (*own, ("mig_uuid", m.uuid), *instance), 1 if gpu.health_of(m).healthy else 0
            )
            for c in m.health.conditions:
                condition.add((*own, ("condition", c.kind), ("detail", c.detail), *instance), 1)
        per_label: dict[str, tuple[int, str]] = {}
        for xid, count in gpu.xid_counts.items():
            label = xid_label(xid)
            total, _ = per_label.get(label, (0, ""))
            per_label[label] = (total + count, xid_action(xid))
        for label, (count, action) in sorted(per_label.items(), key=lambda kv: _xid_order(kv[0])):
            xids.add((*own, ("xid", label), ("action", action)), count)
    return render([healthy, condition, mig_healthy, xids])


def identity_families(snapshot: Snapshot, pods: dict[Target, tuple[PodRef, ...]]) -> str:
    info = Family(
        "gpuagent_gpu_info",
        "gauge",
        "A GPU the agent serves, with its identity (value 1).",
    )
    mig = Family(
        "gpuagent_mig_device_info",
        "gauge",
        "A MIG device of a MIG-enabled GPU, with its identity (value 1).",
    )
    allocated = Family(
        "gpuagent_device_allocated",
        "gauge",
        "A container holding a GPU or MIG device, per the kubelet's pod-resources API "
        "(value 1; the gpu_instance label is empty for a full GPU).",
    )
    by_index = {gpu.index: gpu for gpu in snapshot.gpus}
    for gpu in snapshot.gpus:
        own = (("gpu", str(gpu.index)), ("uuid", gpu.uuid))
        info.add(
            (
                *own,
                ("pci_bus_id", gpu.pci_bus_id),
                ("device", f"nvidia{gpu.index}"),  # joins the dcgm-exporter series
                ("device_node", gpu.device_node),
                ("model_name", gpu.name),
                ("numa_node", "" if gpu.numa_node is None else str(gpu.numa_node)),
                ("mig_enabled", "true" if gpu.mig_enabled else "false"),
            ),
            1,
        )
        for m in gpu.mig_devices:
            mig.add(
                (
                    *own,
                    ("mig_uuid", m.uuid),
                    ("profile", m.profile),
                    ("gpu_instance", str(m.gpu_instance_id)),
                    ("compute_instance", str(m.compute_instance_id)),
                ),
                1,
            )
    for target, refs in sorted(pods.items()):
        parent = by_index.get(target.gpu)
        if parent is None:
            continue
        instance = "" if target.gpu_instance is None else str(target.gpu_instance)
        device = label_pairs(
            (("gpu", str(target.gpu)), ("uuid", parent.uuid), ("gpu_instance", instance))
        )
        for ref in refs:  # up to hundreds a node: the device's labels are rendered once
            allocated.add(
                f'{{{device},namespace="{escape_label(ref.namespace)}"'
                f',pod="{escape_label(ref.pod)}",container="{escape_label(ref.container)}"}}',
                1,
            )
    return render([info, mig, allocated])


def _xid_order(label: str) -> tuple[int, int]:
    """Catalog XIDs by number, then ``other``."""
    return (0, int(label)) if label.isdigit() else (1, 0)
