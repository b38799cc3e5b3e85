"""Each DRA claim's use of its share of a GPU, compared with the share (``--dra-sharing mps``).

A claim's share is held by the GPU's MPS daemon per CUDA process: its pinned device memory limit
binds each client process on its own, and it is the client's own environment. So a claim whose
container runs several CUDA processes, or a process that sets its own limit, can use more than
its share. The accounting catches it: the memory of the processes of the containers that hold
the claim (the kubelet's pod-resources names them, per-container accounting joins their
processes) summed on the claim's GPU, against the memory the claim was given. A claim over it is
said on /metrics and, once per episode, in an event on each pod holding it. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuagent.domain.devices import NodeState, PodRef, claimed_resource
from gpuagent.domain.drashare import ClaimShare

__all__ = ["Overuse", "ShareUse", "overused", "share_uses"]


@dataclass(frozen=True, slots=True)
class ShareUse:
    """A claim's share, the GPU's index now (``None``: not on the node), the containers holding
    the claim, and their processes' memory on the GPU (``None``: no container is known to hold
    the claim)."""

    share: ClaimShare
    gpu: int | None
    holders: tuple[PodRef, ...]
    used_bytes: int | None

    @property
    def over(self) -> bool:
        return self.used_bytes is not None and self.used_bytes > self.share.memory_bytes


@dataclass(frozen=True, slots=True)
class Overuse:
    """A claim whose processes use more memory than its share of GPU ``gpu``, and the containers
    holding it (without the amount, which moves with every reading: an episode is one value)."""

    share: ClaimShare
    gpu: int
    holders: tuple[PodRef, ...]


def share_uses(state: NodeState) -> tuple[ShareUse, ...]:
    """Every share of ``state``, with its use; in the shares' order (by claim UID, device)."""
    if not state.shares:
        return ()
    gpus = {gpu.uuid: gpu.index for gpu in state.gpus}
    used: dict[tuple[int, PodRef], int] = {}
    for usage in state.usage.containers:
        if usage.gpu_instance is None and usage.known and usage.memory_bytes is not None:
            ref = PodRef(usage.namespace, usage.pod, usage.container)
            used[(usage.gpu, ref)] = used.get((usage.gpu, ref), 0) + usage.memory_bytes
    out = []
    for share in state.shares:
        gpu = gpus.get(share.uuid)
        holders = _holders(state, share)
        amount = None
        if gpu is not None and holders:
            amount = sum(used.get((gpu, ref), 0) for ref in holders)
        out.append(ShareUse(share, gpu, holders, amount))
    return tuple(out)


def overused(state: NodeState) -> tuple[Overuse, ...]:
    """The claims over their share now, with the containers holding them."""
    return tuple(
        Overuse(use.share, use.gpu, use.holders)
        for use in share_uses(state)
        if use.over and use.gpu is not None
    )


def _holders(state: NodeState, share: ClaimShare) -> tuple[PodRef, ...]:
    resource = claimed_resource(share.driver)
    claim = f"{share.namespace}/{share.claim}"
    refs = {
        PodRef(a.namespace, a.pod, a.container)
        for a in state.pods.allocated
        if a.resource == resource and a.claim == claim and share.device in a.device_ids
    }
    return tuple(sorted(refs, key=lambda r: (r.namespace, r.pod, r.container)))
