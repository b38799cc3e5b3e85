"""A claim prepared before, asked for again (the kubelet or the agent restarted, the node
rebooted): each of its devices checked against the node as it is now, before its CDI spec is
handed out again.

* A MIG device made on prepare (``--dra-mig dynamic``) is checked against the driver's GPU
  instances (:meth:`gpuagent.dra.dynamic.DynamicMig.again`): kept while it is there, made again
  at its placement when it is gone, refused when another instance holds the placement.
* Any other device (a whole GPU, a MIG device of a GPU the operator partitioned) is checked
  against the GPUs and MIG devices the driver lists (:func:`gpuagent.domain.claims.restated`).

What one device of a claim had made again is destroyed when another of its devices is refused:
the claim's prepare fails whole, and its checkpoint entry stays as it was.
"""

from __future__ import annotations

from collections.abc import Mapping

from gpuagent.domain.claims import ClaimError, PreparedClaim, PreparedDevice, restated
from gpuagent.domain.dra import DraDevice
from gpuagent.domain.snapshot import Snapshot
from gpuagent.dra.dynamic import DynamicMig

__all__ = ["changed_devices", "checked_again"]


def _present(snapshot: Snapshot) -> frozenset[str]:
    """The UUIDs of the node's GPUs and MIG devices."""
    return frozenset(
        uuid for g in snapshot.gpus for uuid in (g.uuid, *(m.uuid for m in g.mig_devices))
    )


async def checked_again(
    claim: PreparedClaim,
    snapshot: Snapshot,
    devices: Mapping[str, DraDevice],
    mig: DynamicMig | None,
) -> PreparedClaim:
    """``claim`` as it stands on the node now (``snapshot``, the devices published by name, the
    driver's MIG operations where MIG is made on demand); raises :class:`ClaimError`."""
    present = _present(snapshot)
    out: list[PreparedDevice] = []
    try:
        for device in claim.devices:
            current = devices.get(device.device)
            if device.made is not None and mig is not None:
                out.append(await mig.again(device, current))
            else:
                published = current.uuid if current is not None else ""
                out.append(restated(device, present, published))
    except ClaimError:
        if mig is not None:
            await mig.remove_all(changed_devices(claim.devices, out), undo=True)
        raise
    return PreparedClaim(ref=claim.ref, devices=tuple(out))


def changed_devices(
    before: tuple[PreparedDevice, ...], after: list[PreparedDevice] | tuple[PreparedDevice, ...]
) -> list[PreparedDevice]:
    """The devices of ``after`` that differ from their place in ``before``: prepared again."""
    return [new for old, new in zip(before, after, strict=False) if new != old]
