"""ResourceClaims on this node: which of our devices a claim was allocated, and the checkpoint.

The kubelet names a claim (namespace, name, UID) in ``NodePrepareResources``; the claim's
allocation comes from the API server. :func:`allocated_devices` reads that allocation (the
``resource.k8s.io/v1`` JSON) and keeps the results of our driver, refusing what this node cannot
serve with a :class:`ClaimError` whose message goes back to the kubelet and into the pod's events.

A prepared claim is remembered (:class:`PreparedClaim`, serialised one claim a record by
:func:`record_json`; the node's facts by :func:`node_json`; :func:`checkpoint_json` is the one
document of older agents, read to carry it over) so a second ``NodePrepareResources`` needs
nothing from the API server, and ``NodeUnprepareResources`` neither — the claim may be gone by
then. The checkpoint records the boot it was written in (the kernel's boot ID) and the boot each
MIG device made for a claim was made in: a MIG device does not outlive a reboot. A repeated
prepare checks the claim's devices again (:func:`restated` here, MIG made on demand:
:func:`gpuagent.domain.dynmig.made_standing`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace
from typing import Any

from gpuagent.domain.drashare import Share

__all__ = [
    "CHECKPOINT_VERSION",
    "ClaimError",
    "ClaimRef",
    "ClaimUnavailable",
    "MadeMig",
    "PreparedClaim",
    "PreparedDevice",
    "allocated_devices",
    "cdi_id",
    "cdi_kind",
    "cdi_name",
    "boot_from_checkpoint",
    "checkpoint_json",
    "claim_from_record",
    "claims_from_checkpoint",
    "node_json",
    "record_json",
    "restated",
    "switched_from_checkpoint",
]

CHECKPOINT_VERSION = 1


class ClaimError(Exception):
    """This claim cannot be prepared here; the message says why (it reaches the pod's events)."""


class ClaimUnavailable(Exception):
    """The claim could not be read from the API server (unreachable, forbidden, not found)."""


@dataclass(frozen=True, slots=True)
class ClaimRef:
    """A claim as the kubelet names it."""

    namespace: str
    name: str
    uid: str


@dataclass(frozen=True, slots=True)
class MadeMig:
    """A MIG device made when its claim was prepared (``--dra-mig dynamic``): its GPU, its GPU
    instance's profile ID, placement start and ID — what unpreparing destroys, and what a
    restarted agent keeps; ``boot``: the kernel's boot ID when it was made (empty: unknown, a
    checkpoint written before boots were recorded, or the boot ID was unreadable)."""

    gpu_uuid: str
    profile_id: int
    start: int
    gpu_instance_id: int
    boot: str = ""


@dataclass(frozen=True, slots=True)
class PreparedDevice:
    """One allocated device: the requests it serves, where it is, and its CDI device IDs;
    ``made``: the MIG device made for it, if it was; ``share``: the claim's share of it, where
    it was given less than a whole shared GPU (``--dra-sharing mps``)."""

    requests: tuple[str, ...]
    pool: str
    device: str
    cdi_ids: tuple[str, ...]
    uuid: str = ""
    made: MadeMig | None = None
    share: Share | None = None


@dataclass(frozen=True, slots=True)
class PreparedClaim:
    """A claim whose devices are prepared (CDI spec written), as checkpointed."""

    ref: ClaimRef
    devices: tuple[PreparedDevice, ...]


def cdi_kind(driver: str) -> str:
    """The CDI kind of the per-claim specs: ``k8s.gpu.nvidia.com/claim`` (NVIDIA's, too)."""
    return f"k8s.{driver}/claim"


def cdi_name(claim_uid: str, device: str) -> str:
    """A claim's device in its CDI spec: ``<claim UID>-<device>``."""
    return f"{claim_uid}-{device}"


def cdi_id(driver: str, claim_uid: str, device: str) -> str:
    """The fully qualified CDI device ID the container runtime resolves."""
    return f"{cdi_kind(driver)}={cdi_name(claim_uid, device)}"


def _get(obj: object, *path: str) -> object:
    for key in path:
        if not isinstance(obj, Mapping):
            return None
        obj = obj.get(key)
    return obj


def allocated_devices(
    claim: Mapping[str, Any],
    ref: ClaimRef,
    *,
    driver: str,
    pool: str,
    known: Collection[str],
) -> list[tuple[str, tuple[str, ...]]]:
    """``(device name, request names)`` of our driver's results in ``claim``'s allocation.

    Raises :class:`ClaimError` when the claim is not the one the kubelet named (UID), is not
    allocated, has a result of our driver in another pool, names a device this node does not
    publish (not ours, or owned by the device plugin), or carries configuration for our driver
    (gpuagent has no driver-specific settings to apply). Sub-request names are reduced to their
    request (``gpu/large`` → ``gpu``), as the kubelet expects.
    """
    uid = _get(claim, "metadata", "uid")
    if uid != ref.uid:
        raise ClaimError(
            f"claim {ref.namespace}/{ref.name} has UID {uid!r}, not {ref.uid!r}: it was replaced"
        )
    allocation = _get(claim, "status", "allocation")
    if not isinstance(allocation, Mapping):
        raise ClaimError(f"claim {ref.namespace}/{ref.name} is not allocated")
    results = _get(allocation, "devices", "results")
    if not isinstance(results, list):
        results = []
    configs = _get(allocation, "devices", "config")
    for config in configs if isinstance(configs, list) else []:
        if _get(config, "opaque", "driver") == driver:
            raise ClaimError(
                f"claim {ref.namespace}/{ref.name} carries opaque configuration for {driver}, "
                "which gpuagent does not support"
            )
    out: dict[str, list[str]] = {}
    for result in results:
        if not isinstance(result, Mapping) or result.get("driver") != driver:
            continue
        device, request, where = result.get("device"), result.get("request"), result.get("pool")
        if not isinstance(device, str) or not isinstance(request, str):
            raise ClaimError(f"claim {ref.namespace}/{ref.name} has a malformed result {result!r}")
        if where != pool:
            raise ClaimError(
                f"claim {ref.namespace}/{ref.name}: device {device} was allocated from pool "
                f"{where!r}, not this node's ({pool!r})"
            )
        if device not in known:
            raise ClaimError(
                f"claim {ref.namespace}/{ref.name}: device {device} is not served by DRA on "
                "this node"
            )
        requests = out.setdefault(device, [])
        base = request.split("/", 1)[0]
        if base not in requests:
            requests.append(base)
    return [(device, tuple(requests)) for device, requests in out.items()]


def _made_json(made: MadeMig | None) -> dict[str, Any]:
    if made is None:
        return {}
    mig: dict[str, Any] = {
        "gpu": made.gpu_uuid,
        "profileId": made.profile_id,
        "start": made.start,
        "gpuInstance": made.gpu_instance_id,
    }
    if made.boot:
        mig["boot"] = made.boot
    return {"mig": mig}


def _share_json(share: Share | None) -> dict[str, Any]:
    if share is None:
        return {}
    return {"share": {"memoryMiB": share.memory_mib, "compute": share.compute}}


def _share(entry: Mapping[str, Any]) -> Share | None:
    """The share of a checkpointed device; none for an entry without one (an older agent's)."""
    share = entry.get("share")
    if share is None:
        return None
    memory, compute = share["memoryMiB"], share["compute"]
    if type(memory) is not int or type(compute) is not int or memory <= 0 or compute <= 0:
        raise TypeError(f"share {share!r} is not a positive memoryMiB and compute")
    return Share(memory_mib=memory, compute=compute)


def _made(entry: Mapping[str, Any], boot: str) -> MadeMig | None:
    """The MIG device made for a checkpointed device; ``boot``: the checkpoint's, for an entry
    that does not name its own."""
    mig = entry.get("mig")
    if mig is None:
        return None
    values = (mig["gpu"], mig["profileId"], mig["start"], mig["gpuInstance"])
    if not isinstance(values[0], str) or not all(type(v) is int for v in values[1:]):
        raise TypeError(f"mig {mig!r} is not a GPU UUID and three integers")
    made_in = mig.get("boot", boot)
    if not isinstance(made_in, str):
        raise TypeError(f"mig boot {made_in!r} is not a string")
    return MadeMig(*values, boot=made_in)


def _entry_json(claim: PreparedClaim) -> dict[str, Any]:
    return {
        "namespace": claim.ref.namespace,
        "name": claim.ref.name,
        "devices": [
            {
                "requests": list(d.requests),
                "pool": d.pool,
                "device": d.device,
                "cdi": list(d.cdi_ids),
                "uuid": d.uuid,
                **_made_json(d.made),
                **_share_json(d.share),
            }
            for d in claim.devices
        ],
    }


def _claim_from_entry(uid: str, entry: Any, boot: str) -> PreparedClaim:
    try:
        ref = ClaimRef(namespace=entry["namespace"], name=entry["name"], uid=uid)
        devices = tuple(
            PreparedDevice(
                requests=tuple(d["requests"]),
                pool=d["pool"],
                device=d["device"],
                cdi_ids=tuple(d["cdi"]),
                uuid=d.get("uuid", ""),
                made=_made(d, boot),
                share=_share(d),
            )
            for d in entry["devices"]
        )
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"checkpoint entry {uid!r} is malformed: {exc!r}") from None
    return PreparedClaim(ref=ref, devices=devices)


def checkpoint_json(
    claims: Mapping[str, PreparedClaim], switched: Collection[str] = (), boot: str = ""
) -> dict[str, Any]:
    """The checkpoint document for the prepared claims (keyed by UID) and the GPUs (UUIDs)
    whose MIG mode the agent switched on, written in ``boot`` (omitted when unknown): the one
    file agents before per-claim records (:func:`record_json`) wrote, which this one reads only
    to carry its claims over (:func:`claims_from_checkpoint`). Nothing here writes it any more:
    it states that format, which docs/dra.md's downgrade command writes, for the tests.

    Version 1 throughout: ``bootId``, a MIG device's ``boot`` and a device's ``share`` are
    optional, so an agent without them reads this document, and this one reads theirs (their
    MIG devices' boot is unknown: see :func:`gpuagent.domain.dynmig.made_standing`)."""
    return {
        **node_json(switched, boot),
        "claims": {uid: _entry_json(c) for uid, c in sorted(claims.items())},
    }


def claims_from_checkpoint(document: object) -> dict[str, PreparedClaim]:
    """The prepared claims of a checkpoint document; raises :class:`ValueError` if malformed."""
    if not isinstance(document, Mapping) or document.get("version") != CHECKPOINT_VERSION:
        raise ValueError(f"not a version {CHECKPOINT_VERSION} checkpoint")
    claims = document.get("claims")
    if not isinstance(claims, Mapping):
        raise ValueError("checkpoint has no claims mapping")  # noqa: TRY004 - one error kind
    boot = boot_from_checkpoint(document)
    return {str(uid): _claim_from_entry(str(uid), entry, boot) for uid, entry in claims.items()}


def node_json(switched: Collection[str] = (), boot: str = "") -> dict[str, Any]:
    """The node's part of the checkpoint: the GPUs whose MIG mode the agent switched on, and
    the boot it was written in (read back with :func:`switched_from_checkpoint` and
    :func:`boot_from_checkpoint`)."""
    return {
        "version": CHECKPOINT_VERSION,
        **({"bootId": boot} if boot else {}),
        "migSwitched": sorted(switched),
    }


def record_json(claim: PreparedClaim, boot: str = "") -> dict[str, Any]:
    """One prepared claim's record, written in ``boot`` (omitted when unknown): its UID and
    what :func:`checkpoint_json` keeps of it."""
    return {
        "version": CHECKPOINT_VERSION,
        **({"bootId": boot} if boot else {}),
        "uid": claim.ref.uid,
        **_entry_json(claim),
    }


def claim_from_record(document: object) -> PreparedClaim:
    """The prepared claim of a record (:func:`record_json`); raises :class:`ValueError` if
    malformed."""
    if not isinstance(document, Mapping) or document.get("version") != CHECKPOINT_VERSION:
        raise ValueError(f"not a version {CHECKPOINT_VERSION} claim record")
    uid = document.get("uid")
    if not isinstance(uid, str) or not uid:
        raise ValueError("claim record has no UID")
    return _claim_from_entry(uid, document, boot_from_checkpoint(document))


def switched_from_checkpoint(document: object) -> frozenset[str]:
    """The GPUs whose MIG mode the agent switched on, as a checkpoint remembers them."""
    switched = document.get("migSwitched", []) if isinstance(document, Mapping) else []
    if not isinstance(switched, list) or not all(isinstance(u, str) for u in switched):
        raise ValueError("checkpoint's migSwitched is not a list of GPU UUIDs")
    return frozenset(switched)


def boot_from_checkpoint(document: object) -> str:
    """The boot ID a checkpoint was written in; empty for one written before boots were
    recorded."""
    boot = document.get("bootId", "") if isinstance(document, Mapping) else ""
    if not isinstance(boot, str):
        raise ValueError(f"checkpoint's bootId {boot!r} is not a string")  # noqa: TRY004
    return boot


def restated(
    device: PreparedDevice, present: Collection[str], published: str = ""
) -> PreparedDevice:
    """A prepared device that is not made on prepare, as it stands at a repeated prepare.

    ``present``: the UUIDs of the GPUs and MIG devices on the node now; ``published``: the UUID
    of the device now published under ``device``'s name (empty: none). The device itself while
    its GPU or MIG device is there (or it names none: a checkpoint from before UUIDs were
    kept); under the UUID now published by its name when its own is gone (a MIG device made
    again with the same profile, GPU and compute instance, as by MIG manager after a reboot);
    else :class:`ClaimError`: what it was prepared for is gone.
    """
    if not device.uuid or device.uuid in present:
        return device
    if published:
        return replace(device, uuid=published)
    what = "MIG device" if device.uuid.startswith("MIG-") else "GPU"
    raise ClaimError(
        f"device {device.device}: its {what} {device.uuid} is gone from this node since the "
        "claim was prepared (a reboot, a driver reload or a MIG change) and no device of that "
        "name is offered now"
    )
