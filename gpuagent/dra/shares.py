"""Claims' shares of shared GPUs on the DRA side (``--dra-sharing mps``): read from a claim's
allocation, checked against the GPUs' MPS daemons, written into the claim's CDI spec, and told to
the store (the accounting compares each claim's use with its share).

A claim with a share is prepared only while its GPU's MPS control daemon is up: a container
started without the daemon would reach the GPU outside its share. A prepare that finds the daemon
not up yet (the agent just started it, or is starting it again) waits for it a few seconds,
outside the preparer's lock, then tries once more; still down, the claim is refused and the
kubelet asks again. A claim prepared before is answered from the checkpoint, daemon or not (its
spec is written already; its pod may be running).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

from gpuagent.domain.claims import ClaimError, ClaimRef, PreparedClaim
from gpuagent.domain.dra import DraDevice
from gpuagent.domain.drashare import (
    MIB,
    ClaimShare,
    Share,
    ShareError,
    claim_shares,
    daemon_name,
    lone_share,
    share_daemon,
)
from gpuagent.domain.mps import MpsDirs, daemon_reason
from gpuagent.dra.claims import share_edits
from gpuagent.state.store import DeviceStore

__all__ = ["DAEMON_WAIT_S", "ClaimShares", "DaemonDown"]

#: How long a prepare waits for a shared GPU's MPS daemon that is not up.
DAEMON_WAIT_S = 5.0


class DaemonDown(ClaimError):
    """A shared GPU's MPS daemon is not up: the claim cannot be held to its share now."""

    def __init__(self, reasons: Mapping[str, str]) -> None:
        super().__init__("; ".join(reasons.values()) + "; the kubelet tries again")
        self.daemons = frozenset(reasons)


class ClaimShares:
    """The shares of ``driver``'s claims on this node, and what a share needs."""

    def __init__(self, store: DeviceStore, driver: str, *, wait_s: float = DAEMON_WAIT_S) -> None:
        self._store = store
        self._driver = driver
        self._wait_s = wait_s

    def of(
        self,
        claim: Mapping[str, Any],
        ref: ClaimRef,
        chosen: Iterable[str],
        devices: Mapping[str, DraDevice],
        pool: str,
    ) -> dict[str, Share]:
        """The shares ``claim`` (allocated the devices named in ``chosen``) has of shared
        devices, by device name. Raises :class:`ClaimError` for a share this node cannot hold,
        and :class:`DaemonDown` while the daemon of a shared GPU it has a share of is not up."""
        names = list(chosen)
        shared = {n: devices[n].memory_bytes // MIB for n in names if devices[n].shared}
        if not shared:
            return {}
        where = f"claim {ref.namespace}/{ref.name}"
        try:
            shares = claim_shares(claim, driver=self._driver, pool=pool, shared=shared)
        except ShareError as exc:
            raise ClaimError(f"{where}: {exc}") from None
        lone = lone_share(names, shares)
        if lone is not None:
            raise ClaimError(f"{where}: {lone}")
        self._check_up(devices[name] for name in shares)
        return shares

    def _check_up(self, devices: Iterable[DraDevice]) -> None:
        state = self._store.snapshot.mps
        down = {}
        for device in devices:
            daemon = share_daemon(self._driver, device.name, device.gpu_index, device.gpu_uuid)
            reason = daemon_reason(daemon, state)
            if reason is not None:
                down[daemon.name] = reason
        if down:
            raise DaemonDown(down)

    async def until_up(self, daemons: frozenset[str]) -> None:
        """Until each of ``daemons`` is up, or the wait is over (the caller tries again)."""

        def up(snapshot: Any) -> bool:
            return all(
                (status := snapshot.mps.status(name)) is not None and status.up for name in daemons
            )

        watch = self._store.watch(up)
        deadline = asyncio.get_running_loop().time() + self._wait_s  # the watch's clock
        ready = await watch.next()
        while not ready and asyncio.get_running_loop().time() < deadline:
            ready = await watch.next(deadline)

    def edits(self, prepared: PreparedClaim, dirs: MpsDirs) -> dict[str, dict[str, list[Any]]]:
        """The CDI edits each shared device of ``prepared`` adds, by device name (``dirs``: the
        MPS root's layout)."""
        return {
            d.device: share_edits(dirs, daemon_name(self._driver, d.device), d.share)
            for d in prepared.devices
            if d.share is not None
        }

    def publish(self, claims: Mapping[str, PreparedClaim]) -> None:
        """Put the shares of ``claims`` (every prepared claim) into the store."""
        shares = tuple(
            ClaimShare(
                driver=self._driver,
                namespace=claim.ref.namespace,
                claim=claim.ref.name,
                uid=uid,
                device=device.device,
                uuid=device.uuid,
                share=device.share,
            )
            for uid, claim in sorted(claims.items())
            for device in claim.devices
            if device.share is not None
        )
        self._store.update(lambda s: replace(s, shares=shares))
