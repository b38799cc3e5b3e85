"""The DRA services the kubelet calls on ``dra.sock`` to prepare and unprepare claims (v1 and
v1beta1, one implementation); device health is :mod:`gpuagent.dra.health`.

Handlers never raise anything but :class:`grpclib.GRPCError`: a claim that cannot be prepared is
answered with its own ``error`` (the kubelet retries it and shows the text in the pod's events);
the other claims of the same request are prepared regardless.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import structlog

from gpuagent._proto.k8s.io.kubelet.pkg.apis.dra import v1 as dra_v1
from gpuagent._proto.k8s.io.kubelet.pkg.apis.dra import v1beta1 as dra_v1beta1
from gpuagent.domain.claims import (
    ClaimError,
    ClaimRef,
    ClaimUnavailable,
    MadeMig,
    PreparedClaim,
    PreparedDevice,
    allocated_devices,
    cdi_id,
)
from gpuagent.domain.dra import DraDevice
from gpuagent.domain.snapshot import Snapshot
from gpuagent.dra.claims import ClaimFiles, claim_spec, with_claim, without_claim
from gpuagent.dra.dynamic import DynamicMig
from gpuagent.dra.recheck import changed_devices, checked_again
from gpuagent.dra.shares import ClaimShares, DaemonDown
from gpuagent.dra.stats import DraStats
from gpuagent.state.store import DeviceStore

log = structlog.get_logger("gpuagent.dra")

# Services for the plugin watcher's GetInfo: "<gRPC package>.<service>", preferred first.
SUPPORTED_SERVICES = (
    "v1.DRAPlugin",
    "v1beta1.DRAPlugin",
    "v1.DRAResourceHealth",
    "v1alpha1.DRAResourceHealth",
)
MAX_ERROR = 1024
#: A claim's UID as the API server makes them (an RFC 4122 UUID), or any name that is safe as a
#: file name: it names the claim's CDI spec and record.
_UID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
#: How long a claim prepared before the agent started waits for the GPUs to be described (and
#: the MIG devices of prepared claims checked) before its devices are checked again.
SETTLE_S = 10.0

ClaimReader = Callable[[str, str], Awaitable[Mapping[str, Any]]]
DeviceSource = Callable[[Snapshot], tuple[DraDevice, ...]]
# The node's CDI spec for a snapshot (blocking: it may read the driver root); ``None``: no GPUs.
NodeSpecSource = Callable[[Snapshot], Mapping[str, Any] | None]


@dataclass(frozen=True, slots=True)
class DraConfig:
    """What the DRA side serves under: driver name and the node's pool."""

    driver: str
    pool: str
    health_timeout_s: int = 60


class ClaimPreparer:
    """Prepares and unprepares claims, one operation at a time, remembered on disk."""

    def __init__(
        self,
        store: DeviceStore,
        devices: DeviceSource,
        read_claim: ClaimReader,
        files: ClaimFiles,
        config: DraConfig,
        *,
        node_spec: NodeSpecSource,
        stats: DraStats | None = None,
        settle_s: float = SETTLE_S,
    ) -> None:
        self._store = store
        self._node_spec = node_spec
        self._devices = devices
        self._read_claim = read_claim
        self._files = files
        self._config = config
        self.stats = stats or DraStats()
        self._lock = asyncio.Lock()
        self.claims: dict[str, PreparedClaim] = {}
        # MIG made on demand (--dra-mig dynamic), once the driver is there: see manage_mig.
        self.mig: DynamicMig | None = None
        # Set once the GPUs are described and the MIG devices of prepared claims checked.
        self.settled = asyncio.Event()
        self.shares = ClaimShares(store, config.driver)
        self._settle_s = settle_s
        self.counted()

    def counted(self) -> None:
        """Put the claims' counts in the store, as they are now (after each change)."""
        self._store.counters.claims_counted(self.stats.counts(prepared_claims=len(self.claims)))

    async def load(self) -> None:
        """Read the claims' records (a restart keeps every prepared claim) and the boot this
        process runs in. A record that cannot be read is logged and its claim set aside (the
        kubelet's prepare reads it again from the API server, its unprepare removes it); the
        state directory unreadable as a whole is logged and the agent starts empty."""
        switched: frozenset[str] = frozenset()
        written_in = ""
        try:
            loaded = await asyncio.to_thread(self._files.load)
        except OSError as exc:
            log.error("dra checkpoint unreadable; starting empty", error=str(exc))
            self.claims = {}
        else:
            self.claims, switched, written_in = loaded.claims, loaded.switched, loaded.boot
            for problem in loaded.unreadable:
                log.error("dra checkpoint file unreadable; set aside", error=problem)
        self.shares.publish(self.claims)
        try:
            boot = await asyncio.to_thread(self._files.boot)
        except OSError as exc:
            boot = ""
            log.warning(
                "boot id unreadable; mig devices of prepared claims are checked against the "
                "driver alone",
                error=str(exc),
            )
        if self.mig is not None:
            self.mig.switched = switched
            self.mig.boot = boot
        self.counted()
        log.info(
            "dra claims restored",
            claims=len(self.claims),
            same_boot=None if not written_in or not boot else written_in == boot,
        )

    async def sweep(self) -> None:
        """Once every GPU is described: destroy the MIG devices no prepared claim holds (after
        a restart; only where MIG is made on demand), then let claims prepared before be
        checked again (:attr:`settled`)."""
        # Waited for outside the lock: a claim prepared before the restart waits for it, within
        # settle_s; a new claim's devices are published only once their GPU is described.
        async for discovered in self._store.watch(lambda s: s.discovered):
            if discovered:
                break
        if self.mig is not None:
            await self._sweep_mig(self.mig)
        self.settled.set()

    async def _sweep_mig(self, mig: DynamicMig) -> None:
        async with self._lock:
            kept = [d.made for c in self.claims.values() for d in c.devices if d.made]
            removed = await mig.sweep(self._devices(self._store.snapshot), kept)
            try:
                await asyncio.to_thread(self._files.save_node, mig.switched)
            except OSError as exc:  # the next prepare or unprepare writes it again
                log.error("dra checkpoint not written after the mig sweep", error=str(exc))
        log.info("mig devices of prepared claims checked", kept=len(kept), orphans_removed=removed)

    @property
    def _switched(self) -> frozenset[str]:
        return frozenset() if self.mig is None else self.mig.switched

    async def _ready(self, device: DraDevice) -> tuple[MadeMig | None, str]:
        """``device`` ready for its claim (see :meth:`DynamicMig.ready`): ``(record, UUID)``."""
        if self.mig is not None:
            return await self.mig.ready(device)
        if device.made_on_prepare:
            raise ClaimError(f"device {device.name}: MIG devices cannot be made yet")
        return None, device.uuid

    async def prepare(self, ref: ClaimRef) -> PreparedClaim:
        """The claim's devices, prepared (a claim prepared before: checked again); raises
        :class:`ClaimError`. A shared GPU's daemon not up is waited for (outside the lock), once."""
        if ref.uid in self.claims and not self.settled.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._settle_s):
                    await self.settled.wait()
        try:
            return await self._prepare(ref)
        except DaemonDown as down:
            await self.shares.until_up(down.daemons)
        return await self._prepare(ref)

    async def _prepare(self, ref: ClaimRef) -> PreparedClaim:
        async with self._lock:
            known = self.claims.get(ref.uid)
            if known is not None:
                return await self._again(known)
            started = time.perf_counter()
            try:
                claim = await self._read_claim(ref.namespace, ref.name)
            except ClaimUnavailable as exc:
                raise ClaimError(f"reading claim {ref.namespace}/{ref.name}: {exc}") from None
            read = time.perf_counter() - started
            self.stats.record(self.stats.api_read_seconds, read)
            prepared = await self._prepare_new(ref, claim)
            self._store.allocated()  # (the pod-resources client looks again soon)
            self.stats.record(self.stats.prepare_seconds, time.perf_counter() - started - read)
            log.info("claim prepared", claim=f"{ref.namespace}/{ref.name}", uid=ref.uid,
                     devices=[d.device for d in prepared.devices],
                     shares={d.device: d.share for d in prepared.devices if d.share})  # fmt: skip
            return prepared

    async def _prepare_new(self, ref: ClaimRef, claim: Mapping[str, Any]) -> PreparedClaim:
        """``claim``'s devices made ready, its CDI spec and the checkpoint written (under the
        lock); what was made is undone when it fails."""
        devices = {d.name: d for d in self._devices(self._store.snapshot)}
        chosen = allocated_devices(
            claim, ref, driver=self._config.driver, pool=self._config.pool, known=devices
        )
        shares = self.shares.of(claim, ref, [n for n, _ in chosen], devices, self._config.pool)
        made: list[PreparedDevice] = []
        try:
            for name, requests in chosen:
                record, uuid = await self._ready(devices[name])
                made.append(
                    PreparedDevice(
                        requests=requests,
                        pool=self._config.pool,
                        device=name,
                        cdi_ids=(cdi_id(self._config.driver, ref.uid, name),),
                        uuid=uuid,
                        made=record,
                        share=shares.get(name),
                    )
                )
            prepared = PreparedClaim(ref=ref, devices=tuple(made))
            await self._commit(prepared)
        except ClaimError:
            if self.mig is not None:
                await self.mig.remove_all(made, undo=True)
            raise
        return prepared

    async def _commit(self, prepared: PreparedClaim) -> None:
        """Write ``prepared``'s CDI spec and its record, then remember it."""
        claims = with_claim(self.claims, prepared)
        try:
            # The snapshot now, which lists the MIG devices just made.
            await asyncio.to_thread(self._write, self._store.snapshot, prepared)
        except OSError as exc:
            raise ClaimError(f"writing the claim's CDI spec or checkpoint: {exc}") from None
        self.claims = claims
        self.shares.publish(claims)

    async def _again(self, known: PreparedClaim) -> PreparedClaim:
        """A claim prepared before, checked again (:func:`checked_again`): its CDI spec and the
        checkpoint rewritten when a device was prepared again. Before the GPUs are described
        (within settle_s) it is answered as checkpointed, unless it has MIG devices made for it
        (they may be gone: refused, the kubelet asks again)."""
        if not self.settled.is_set():
            if any(d.made for d in known.devices):
                raise ClaimError(
                    "the GPUs are not described yet, so the MIG devices made for this claim "
                    "cannot be checked; the kubelet tries again"
                )
            return known
        try:
            devices = {d.name: d for d in self._devices(self._store.snapshot)}
            again = await checked_again(known, self._store.snapshot, devices, self.mig)
        except ClaimError:
            self.stats.gone_refused += 1
            raise
        changed = changed_devices(known.devices, again.devices)
        if not changed:
            return known
        claims = with_claim(self.claims, again)
        try:
            await asyncio.to_thread(self._write, self._store.snapshot, again)
        except OSError as exc:
            if self.mig is not None:
                await self.mig.remove_all(changed, undo=True)
            raise ClaimError(f"writing the claim's CDI spec or checkpoint: {exc}") from None
        self.claims = claims
        self.stats.gone_prepared_again += len(changed)
        log.info(
            "claim prepared again: its devices were gone",
            claim=f"{known.ref.namespace}/{known.ref.name}",
            uid=known.ref.uid,
            devices=[d.device for d in changed],
        )
        return again

    def _write(self, snapshot: Snapshot, prepared: PreparedClaim) -> None:
        """The claim's CDI spec (from the node's, which may read the driver root), the node's
        facts where they changed (a GPU switched to MIG mode), then the claim's record; runs off
        the event loop."""
        spec = claim_spec(
            self._node_spec(snapshot),
            prepared.ref.uid,
            [(d.device, d.uuid) for d in prepared.devices],
            driver=self._config.driver,
            extra=self.shares.edits(prepared, snapshot.plan.serving.containers.mps),
        )
        self._files.write_spec(prepared.ref.uid, spec)
        self._files.save_node(self._switched)
        self._files.save_claim(prepared)

    async def unprepare(self, ref: ClaimRef) -> None:
        """Destroy the claim's MIG devices made for it, forget the claim and remove its CDI
        spec; a claim never prepared is not an error."""
        async with self._lock:
            known = self.claims.get(ref.uid)
            if known is not None and self.mig is not None:
                await self.mig.remove_all(known.devices)
            claims = without_claim(self.claims, ref.uid)
            try:
                await asyncio.to_thread(self._remove, ref.uid)
            except OSError as exc:
                raise ClaimError(
                    f"removing the claim's CDI spec or checkpoint entry: {exc}"
                ) from None
            if ref.uid in self.claims:
                log.info("claim unprepared", claim=f"{ref.namespace}/{ref.name}", uid=ref.uid)
            self.claims = claims
            self.shares.publish(claims)

    def _remove(self, uid: str) -> None:
        self._files.remove_spec(uid)
        self._files.remove_claim(uid)
        self._files.save_node(self._switched)


def _ref(claim: dra_v1.Claim | dra_v1beta1.Claim) -> ClaimRef:
    return ClaimRef(namespace=claim.namespace, name=claim.name, uid=claim.uid)


def _check(ref: ClaimRef) -> None:
    if not ref.uid or not ref.name or not ref.namespace:
        raise ClaimError(f"claim {ref!r} lacks a namespace, name or UID")
    if not _UID.fullmatch(ref.uid):  # it names the claim's files
        raise ClaimError(
            f"claim {ref.namespace}/{ref.name}: UID {ref.uid!r} is not a Kubernetes UID "
            "(letters, digits, '-', '_' and '.', at most 128)"
        )


def _bounded(text: str) -> str:
    return text if len(text) <= MAX_ERROR else f"{text[:MAX_ERROR]}… (truncated)"


class DraPluginV1(dra_v1.DraPluginBase):
    """``k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin``."""

    def __init__(self, preparer: ClaimPreparer) -> None:
        self._preparer = preparer

    async def node_prepare_resources(
        self, message: dra_v1.NodePrepareResourcesRequest
    ) -> dra_v1.NodePrepareResourcesResponse:
        out: dict[str, dra_v1.NodePrepareResourceResponse] = {}
        for claim in message.claims:
            ref = _ref(claim)
            stats = self._preparer.stats
            try:
                _check(ref)
                prepared = await self._preparer.prepare(ref)
            except ClaimError as exc:
                stats.prepare_errors += 1
                log.warning("claim not prepared", uid=ref.uid, error=str(exc))
                out[ref.uid] = dra_v1.NodePrepareResourceResponse(error=_bounded(str(exc)))
                continue
            stats.prepares += 1
            out[ref.uid] = dra_v1.NodePrepareResourceResponse(
                devices=[
                    dra_v1.Device(
                        request_names=list(d.requests),
                        pool_name=d.pool,
                        device_name=d.device,
                        cdi_device_ids=list(d.cdi_ids),
                    )
                    for d in prepared.devices
                ]
            )
        self._preparer.counted()
        return dra_v1.NodePrepareResourcesResponse(claims=out)

    async def node_unprepare_resources(
        self, message: dra_v1.NodeUnprepareResourcesRequest
    ) -> dra_v1.NodeUnprepareResourcesResponse:
        out: dict[str, dra_v1.NodeUnprepareResourceResponse] = {}
        for claim in message.claims:
            ref = _ref(claim)
            try:
                _check(ref)
                await self._preparer.unprepare(ref)
            except ClaimError as exc:
                log.warning("claim not unprepared", uid=ref.uid, error=str(exc))
                out[ref.uid] = dra_v1.NodeUnprepareResourceResponse(error=_bounded(str(exc)))
                continue
            self._preparer.stats.unprepares += 1
            out[ref.uid] = dra_v1.NodeUnprepareResourceResponse()
        self._preparer.counted()
        return dra_v1.NodeUnprepareResourcesResponse(claims=out)


class DraPluginV1Beta1(dra_v1beta1.DraPluginBase):
    """``k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin``: the same service, older messages."""

    def __init__(self, v1: DraPluginV1) -> None:
        self._v1 = v1

    async def node_prepare_resources(
        self, message: dra_v1beta1.NodePrepareResourcesRequest
    ) -> dra_v1beta1.NodePrepareResourcesResponse:
        request = dra_v1.NodePrepareResourcesRequest(claims=_v1_claims(message.claims))
        response = await self._v1.node_prepare_resources(request)
        return dra_v1beta1.NodePrepareResourcesResponse(
            claims={
                uid: dra_v1beta1.NodePrepareResourceResponse(
                    error=r.error,
                    devices=[
                        dra_v1beta1.Device(
                            request_names=d.request_names,
                            pool_name=d.pool_name,
                            device_name=d.device_name,
                            cdi_device_ids=d.cdi_device_ids,
                        )
                        for d in r.devices
                    ],
                )
                for uid, r in response.claims.items()
            }
        )

    async def node_unprepare_resources(
        self, message: dra_v1beta1.NodeUnprepareResourcesRequest
    ) -> dra_v1beta1.NodeUnprepareResourcesResponse:
        request = dra_v1.NodeUnprepareResourcesRequest(claims=_v1_claims(message.claims))
        response = await self._v1.node_unprepare_resources(request)
        return dra_v1beta1.NodeUnprepareResourcesResponse(
            claims={
                uid: dra_v1beta1.NodeUnprepareResourceResponse(error=r.error)
                for uid, r in response.claims.items()
            }
        )


def _v1_claims(claims: Iterable[dra_v1beta1.Claim]) -> list[dra_v1.Claim]:
    return [dra_v1.Claim(namespace=c.namespace, uid=c.uid, name=c.name) for c in claims]
