"""DRA shares of a GPU (``--dra-sharing mps``), as values: what a shared GPU offers, what a claim
was given of it, and the MPS control daemon that holds the claim to it.

A shared GPU is published with ``allowMultipleAllocations`` and two consumable capacities
(KEP-5075; the names of Kubernetes' DRA example driver, ``memory`` also NVIDIA's DRA driver's):

- ``memory``, in bytes: the GPU's memory; a claim asks for at least 1 GiB, in steps of 1 MiB;
- ``compute``, in percent of the GPU's SMs: 100; a claim asks for 1 to 100, in steps of 1.

A request that names neither consumes the whole GPU (each policy's default is the whole
capacity), so a claim written for a whole GPU gets one, and nothing else is allocated beside it.
The scheduler records what each claim consumed in its allocation result (``consumedCapacity``);
:func:`claim_shares` reads it. A claim given less than the whole GPU is held to its share by
the GPU's MPS control daemon (one per shared GPU, named by :func:`daemon_name`): its pinned
device memory limit is the memory it consumed, its active thread percentage the compute.

Pure values, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from enum import StrEnum
from fractions import Fraction
from typing import Any

from gpuagent.domain.apivalues import quantity
from gpuagent.domain.mps import MpsDaemon, MpsGpu

__all__ = [
    "COMPUTE",
    "COMPUTE_POLICY",
    "MEMORY",
    "MIB",
    "ClaimShare",
    "DraSharing",
    "RequestPolicy",
    "Share",
    "ShareError",
    "claim_shares",
    "daemon_name",
    "lone_share",
    "memory_policy",
    "share_daemon",
]

MEMORY = "memory"
COMPUTE = "compute"
MIB = 1 << 20
#: The compute capacity: percent of the GPU's SMs (an MPS client's active thread percentage).
WHOLE_COMPUTE = 100
#: The least memory a claim may ask for, and the steps it is counted in.
MEMORY_MIN = 1 << 30
MEMORY_STEP = MIB


class DraSharing(StrEnum):
    """``--dra-sharing``: ``none`` (each DRA GPU to one claim at a time), or ``mps`` (a whole
    GPU shared by claims, each held to its share through the GPU's MPS control daemon)."""

    NONE = "none"
    MPS = "mps"


class ShareError(ValueError):
    """A claim's consumed capacity that this node cannot hold it to; the message says why."""


@dataclass(frozen=True, slots=True)
class RequestPolicy:
    """A consumable capacity's request policy (``requestPolicy``): ``default`` when a request
    does not name it, and the range a request is rounded up into (``validRange``)."""

    default: int
    min: int
    max: int
    step: int


def memory_policy(memory_bytes: int) -> RequestPolicy:
    """The ``memory`` capacity's policy for a GPU of ``memory_bytes`` (a whole number of MiB):
    the whole GPU by default, 1 GiB to all of it in steps of 1 MiB (a smaller GPU: one step
    less than all of it at least, as the API wants room for a step above the minimum)."""
    least = min(MEMORY_MIN, max(memory_bytes - MEMORY_STEP, 0))
    return RequestPolicy(default=memory_bytes, min=least, max=memory_bytes, step=MEMORY_STEP)


COMPUTE_POLICY = RequestPolicy(default=WHOLE_COMPUTE, min=1, max=WHOLE_COMPUTE, step=1)


@dataclass(frozen=True, slots=True)
class Share:
    """What a claim was given of a GPU, less than all of it: ``memory_mib`` (its pinned device
    memory limit) and ``compute`` (its active thread percentage, 1-100)."""

    memory_mib: int
    compute: int


@dataclass(frozen=True, slots=True)
class ClaimShare:
    """A prepared claim's share of one GPU (``uuid``) through ``driver``'s device ``device``,
    as the node's state records it (for the accounting that compares the claim's use with it)."""

    driver: str
    namespace: str
    claim: str
    uid: str
    device: str
    uuid: str
    share: Share

    @property
    def memory_bytes(self) -> int:
        return self.share.memory_mib * MIB


def daemon_name(driver: str, device: str) -> str:
    """The control daemon of shared device ``device``: ``<driver>/<device>`` (its directories
    under the MPS root; no device-plugin resource is named so)."""
    return f"{driver}/{device}"


def share_daemon(driver: str, device: str, gpu: int, uuid: str) -> MpsDaemon:
    """The control daemon of a shared GPU. It sets no defaults: each client brings its claim's
    limits in its environment."""
    return MpsDaemon(name=daemon_name(driver, device), gpus=(MpsGpu(index=gpu, uuid=uuid),))


def claim_shares(
    claim: Mapping[str, Any], *, driver: str, pool: str, shared: Mapping[str, int]
) -> dict[str, Share]:
    """The shares ``claim``'s allocation gives it of this node's shared devices (``shared``:
    their names and memory in MiB), by device; a device the claim consumed whole is left out
    (it is prepared as an unshared one). Results of one device (several requests) add up.

    Raises :class:`ShareError` for a consumed capacity this node cannot hold a claim to."""
    consumed: dict[str, tuple[Fraction, Fraction]] = {}
    for result in _results(claim):
        device = result.get("device")
        if result.get("driver") != driver or result.get("pool") != pool:
            continue
        if not isinstance(device, str) or device not in shared:
            continue
        memory, compute = _consumed(result.get("consumedCapacity"), shared[device])
        before = consumed.get(device, (Fraction(0), Fraction(0)))
        consumed[device] = (before[0] + memory, before[1] + compute)
    out: dict[str, Share] = {}
    for device, (memory, compute) in consumed.items():
        share = _share(device, memory, compute, shared[device])
        if share is not None:
            out[device] = share
    return out


def _results(claim: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    allocation = (claim.get("status") or {}).get("allocation") or {}
    results = (allocation.get("devices") or {}).get("results") or []
    return [r for r in results if isinstance(r, Mapping)]


def _consumed(consumed: object, memory_mib: int) -> tuple[Fraction, Fraction]:
    """``consumedCapacity``'s memory (bytes) and compute (percent); a capacity it lacks, or a
    result without it (a scheduler without consumable capacity), is consumed whole."""
    values = consumed if isinstance(consumed, Mapping) else {}
    out = []
    for name, whole in ((MEMORY, memory_mib * MIB), (COMPUTE, WHOLE_COMPUTE)):
        raw = values.get(name)
        if raw is None:
            out.append(Fraction(whole))
            continue
        try:
            out.append(quantity(str(raw)))
        except ValueError as exc:
            raise ShareError(f"consumed {name}: {exc}") from None
    return out[0], out[1]


def _share(device: str, memory: Fraction, compute: Fraction, memory_mib: int) -> Share | None:
    mib, percent = math.floor(memory / MIB), math.ceil(compute)
    if mib <= 0 or percent <= 0:
        raise ShareError(
            f"device {device}: consumed {memory} bytes of memory and {compute} % of compute; a "
            "share needs some of both"
        )
    if mib > memory_mib or percent > WHOLE_COMPUTE:
        raise ShareError(
            f"device {device}: consumed {mib} MiB and {percent} % of compute, more than the GPU "
            f"has ({memory_mib} MiB, {WHOLE_COMPUTE} %)"
        )
    if mib == memory_mib and percent == WHOLE_COMPUTE:
        return None
    return Share(memory_mib=mib, compute=percent)


def lone_share(devices: Collection[str], shares: Mapping[str, Share]) -> str | None:
    """Why a claim of ``devices`` with ``shares`` cannot be prepared, or ``None``: a claim given
    a share of a GPU holds no other device, since its processes reach the GPU as clients of that
    GPU's MPS daemon, which serves that GPU alone (and a process has one daemon)."""
    if not shares or len(devices) == 1:
        return None
    return (
        f"the claim holds {', '.join(sorted(devices))} with a share of "
        f"{', '.join(sorted(shares))}: a claim with a share of a GPU can hold no other device (its "
        "processes reach the GPU through that GPU's MPS daemon alone); ask for each share in a "
        "claim of its own"
    )
