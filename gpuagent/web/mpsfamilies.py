"""MPS's families: each control daemon (whether it is up, how often it was started) and, under
``--dra-sharing mps``, the DRA claims' shares of GPUs it holds them to.

Two series per daemon (none without MPS), so an alert can say "a shared resource's daemon is
down" (its devices are unhealthy meanwhile) and a dashboard can show a daemon that keeps
failing. The shares: two series a node by default (the claims holding a share, those whose
processes use more memory than it); per claim only with ``--detailed-agent-metrics`` (a node may
hold many shares, and a fleet pays for every series).
"""

from __future__ import annotations

from gpuagent.domain.drashare import DraSharing
from gpuagent.domain.shareuse import ShareUse, share_uses
from gpuagent.domain.snapshot import Snapshot
from gpuagent.web.exposition import Family, single

__all__ = ["mps_families"]


def mps_families(snapshot: Snapshot, *, detailed: bool) -> list[Family]:
    """The daemons' families, then the shares' (where DRA GPUs are shared)."""
    out = _daemon_families(snapshot)
    if snapshot.plan.dra.sharing is DraSharing.MPS:
        out += _share_families(share_uses(snapshot), detailed=detailed)
    return out


def _daemon_families(snapshot: Snapshot) -> list[Family]:
    state = snapshot.mps
    if not state.daemons:
        return []
    up = Family(
        "gpuagent_mps_daemon_up",
        "gauge",
        "Whether the MPS control daemon of a resource shared through MPS (or of a GPU shared "
        "through DRA: <driver>/<device>) is running and configured (1), or not (0: its devices "
        "are unhealthy meanwhile).",
    )
    starts = Family(
        "gpuagent_mps_daemon_starts_total",
        "counter",
        "Starts of the MPS control daemon of a resource since the agent started (the first "
        "start and every restart after it exited).",
    )
    for name, status in sorted(state.daemons.items()):
        labels = (("resource", name),)
        up.add(labels, 1 if status.up else 0)
        starts.add(labels, status.starts)
    return [up, starts]


def _share_families(uses: tuple[ShareUse, ...], *, detailed: bool) -> list[Family]:
    out = [
        single("gpuagent_dra_shared_claims", "gauge",
               "DRA claims prepared on this node with a share of a GPU (less than the whole "
               "GPU, held to it by the GPU's MPS daemon).", (), len(uses)),
        single("gpuagent_dra_claims_over_share", "gauge",
               "DRA claims whose processes use more memory of their GPU than their share (each "
               "CUDA process has the share as its own limit: several processes can exceed it).",
               (), sum(1 for u in uses if u.over)),
    ]  # fmt: skip
    if not detailed:
        return out
    memory = Family(
        "gpuagent_dra_claim_share_memory_bytes",
        "gauge",
        "A DRA claim's share of its GPU's memory (its processes' pinned device memory limit).",
    )
    compute = Family(
        "gpuagent_dra_claim_share_compute_ratio",
        "gauge",
        "A DRA claim's share of its GPU's compute (its processes' active thread percentage, as "
        "a ratio).",
    )
    used = Family(
        "gpuagent_dra_claim_memory_used_bytes",
        "gauge",
        "GPU memory used by the processes of the containers holding a DRA claim with a share, "
        "on the claim's GPU (while a container is known to hold it).",
    )
    for use in uses:
        share = use.share
        labels = (("namespace", share.namespace), ("claim", share.claim),
                  ("device", share.device), ("UUID", share.uuid))  # fmt: skip
        memory.add(labels, share.memory_bytes)
        compute.add(labels, share.share.compute / 100)
        if use.used_bytes is not None:
            used.add(labels, use.used_bytes)
    return [*out, memory, compute, used]
