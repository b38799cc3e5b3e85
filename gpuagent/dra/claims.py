"""Prepared claims on disk: one CDI spec per claim, and a checkpoint of claim → devices.

Preparing writes the claim's CDI spec first and the checkpoint second; unpreparing removes the
spec first and the checkpoint entry second. So after a crash at any point, a restarted agent
either remembers the claim (and answers a repeated prepare from the checkpoint) or has nothing of
it on disk that an unprepare would not remove: the spec's path is derived from the claim's UID
alone, and an unprepare of an unknown UID still removes it.

The checkpoint records the boot it was written in (``/proc/sys/kernel/random/boot_id``, read once
a process): a MIG device made for a claim does not outlive a reboot (see
:func:`gpuagent.domain.dynmig.made_standing`).

The spec reuses the node's CDI spec (:func:`gpuagent.nodefiles.cdicontent.node_spec`) — its device
edits and common edits: device nodes, control nodes, the driver's libraries, binaries, sockets,
firmware and hooks — for the claim's devices only, renamed ``<claim UID>-<device>`` under kind
``k8s.<driver>/claim``. A device the claim has a share of (``--dra-sharing mps``) adds what makes
its processes clients of the GPU's MPS daemon held to the share (:func:`share_edits`).
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

from gpuagent.domain.claims import (
    PreparedClaim,
    boot_from_checkpoint,
    cdi_kind,
    cdi_name,
    checkpoint_json,
    claims_from_checkpoint,
    switched_from_checkpoint,
)
from gpuagent.domain.drashare import Share
from gpuagent.domain.mps import CONTAINER_SHM, MpsDirs, client_env
from gpuagent.nodefiles.atomicfile import remove_if_present, write_if_changed
from gpuagent.nodefiles.cdi import render_spec

__all__ = [
    "BOOT_ID_FILE",
    "CHECKPOINT_FILE",
    "Checkpoint",
    "ClaimFiles",
    "claim_spec",
    "share_edits",
    "with_claim",
    "without_claim",
]

CHECKPOINT_FILE = "checkpoint.json"
#: A container's MPS directories are its own to write (the daemon's pipe, the shared memory).
MPS_MOUNT_OPTIONS = ("rw", "nosuid", "nodev", "rbind", "rprivate")
#: The kernel's boot ID under a proc root (``/proc``; the simulated node has its own).
BOOT_ID_FILE = "sys/kernel/random/boot_id"


class Checkpoint(NamedTuple):
    """What the checkpoint holds: the prepared claims, the GPUs whose MIG mode the agent
    switched on, and the boot it was written in (empty: unknown)."""

    claims: dict[str, PreparedClaim]
    switched: frozenset[str]
    boot: str


def claim_spec(
    node_spec: Mapping[str, Any] | None,
    claim_uid: str,
    devices: Iterable[tuple[str, str]],
    *,
    driver: str,
    extra: Mapping[str, Mapping[str, list[Any]]] | None = None,
) -> dict[str, Any]:
    """The CDI spec of one claim: ``devices`` are ``(device name, GPU or MIG UUID)``, named in
    ``node_spec`` (the node's spec, which names every device by UUID); ``extra``: edits added
    to a device's, by device name (lists: ``env``, ``mounts``).

    Raises :class:`KeyError` for a UUID the node spec does not know.
    """
    wanted = dict(devices)
    by_name = {d["name"]: d for d in (node_spec or {}).get("devices", [])}
    out = []
    for name, uuid in wanted.items():
        device = by_name[uuid]
        edits = dict(device.get("containerEdits") or {})
        for key, values in (extra or {}).get(name, {}).items():
            edits[key] = [*edits.get(key, []), *values]
        out.append({**device, "name": cdi_name(claim_uid, name), "containerEdits": edits})
    spec: dict[str, Any] = {
        "cdiVersion": (node_spec or {}).get("cdiVersion", "0.6.0"),
        "kind": cdi_kind(driver),
        "devices": out,
    }
    if node_spec is not None and "containerEdits" in node_spec:
        spec["containerEdits"] = node_spec["containerEdits"]
    return spec


def share_edits(dirs: MpsDirs, daemon: str, share: Share) -> dict[str, list[Any]]:
    """What makes a container's processes clients of ``daemon`` (a shared GPU's MPS control
    daemon) held to ``share``: the daemon's pipe directory (``CUDA_MPS_PIPE_DIRECTORY``, and
    the directory mounted there) and the shared memory at ``/dev/shm``, as the device plugin's
    MPS devices have them; the client's own limits, ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` (the
    share's memory, for the container's one GPU: ordinal 0) and
    ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` (its compute)."""
    env = client_env(
        dirs, daemon, pinned_limits_mib={0: share.memory_mib}, thread_percentage=share.compute
    )
    options = list(MPS_MOUNT_OPTIONS)
    return {
        "env": [f"{key}={value}" for key, value in env.items()],
        "mounts": [
            {"hostPath": dirs.pipe(daemon), "containerPath": dirs.container_pipe(daemon),
             "options": options},
            {"hostPath": dirs.shm, "containerPath": CONTAINER_SHM, "options": options},
        ],
    }  # fmt: skip


class ClaimFiles:
    """The checkpoint under ``state_dir`` and the claims' CDI specs under ``cdi_dir``;
    ``proc_root``: where the kernel's boot ID is read.

    Every method blocks (files are fsynced); the caller runs them off the event loop.
    """

    def __init__(
        self, state_dir: Path, cdi_dir: Path, driver: str, proc_root: Path = Path("/proc")
    ) -> None:
        self.checkpoint = state_dir / CHECKPOINT_FILE
        self._cdi_dir = cdi_dir
        self._driver = driver
        self._boot_file = proc_root / BOOT_ID_FILE
        self._boot: str | None = None

    def boot(self) -> str:
        """The boot this process runs in (read once); raises :class:`OSError` when it cannot
        be read (then the checkpoint records no boot)."""
        if self._boot is None:
            try:
                self._boot = self._boot_file.read_text(encoding="ascii").strip()
            except (OSError, UnicodeDecodeError) as exc:
                self._boot = ""
                raise OSError(f"{self._boot_file}: {exc}") from None
        return self._boot

    def spec_path(self, claim_uid: str) -> Path:
        # CDI's transient spec name: "<vendor>-<class>_<uid>".
        vendor, _, cls = cdi_kind(self._driver).partition("/")
        return self._cdi_dir / f"{vendor}-{cls}_{claim_uid}.json"

    def load(self) -> Checkpoint:
        """The checkpoint; empty when there is none. Raises :class:`ValueError` for a
        checkpoint that cannot be read back (kept for a person to look at)."""
        try:
            text = self.checkpoint.read_text(encoding="utf-8")
        except FileNotFoundError:
            return Checkpoint({}, frozenset(), "")
        try:
            document = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{self.checkpoint}: {exc}") from None
        return Checkpoint(
            claims_from_checkpoint(document),
            switched_from_checkpoint(document),
            boot_from_checkpoint(document),
        )

    def save(self, claims: Mapping[str, PreparedClaim], switched: Collection[str] = ()) -> None:
        """Write the checkpoint, in this process's boot (none where it cannot be read)."""
        try:
            boot = self.boot()
        except OSError:
            boot = ""
        document = checkpoint_json(claims, switched, boot)
        write_if_changed(
            self.checkpoint, (json.dumps(document, indent=1) + "\n").encode(), mode=0o600
        )

    def write_spec(self, claim_uid: str, spec: Mapping[str, Any]) -> None:
        write_if_changed(self.spec_path(claim_uid), render_spec(spec))

    def remove_spec(self, claim_uid: str) -> None:
        remove_if_present(self.spec_path(claim_uid))


def with_claim(
    claims: Mapping[str, PreparedClaim], claim: PreparedClaim
) -> dict[str, PreparedClaim]:
    return {**claims, claim.ref.uid: claim}


def without_claim(claims: Mapping[str, PreparedClaim], uid: str) -> dict[str, PreparedClaim]:
    return {k: v for k, v in claims.items() if k != uid}
