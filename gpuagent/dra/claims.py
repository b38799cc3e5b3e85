"""Prepared claims on disk: one CDI spec and one record per claim, and the node's facts.

Each prepared claim has a record of its own (``claims/<UID>.json`` under the state directory,
:func:`gpuagent.domain.claims.record_json`), so a prepare or an unprepare writes what belongs to
its claim alone, whatever the node holds. ``node.json`` beside them keeps the GPUs whose MIG
mode the agent switched on and the boot it was written in; it is written only when it changes.

Every write replaces its file atomically (a temporary file fsynced, renamed, the directory
fsynced: :func:`gpuagent.nodefiles.atomicfile.write_if_changed`). Preparing writes the claim's
CDI spec first, the node's facts next (a GPU just switched to MIG mode) and the claim's record
last; unpreparing removes the spec first and the record second. So after a crash at any point,
a restarted agent either remembers the claim (and answers a repeated prepare from its record) or
has nothing of it on disk that an unprepare would not remove: the spec's and the record's paths
are derived from the claim's UID alone, and an unprepare of an unknown UID still removes them.
A GPU the node's facts name as switched with no claim's MIG device on it is switched back by the
start-up sweep.

A record that cannot be read back sets that claim aside (it is left in place, and reported by
:meth:`ClaimFiles.load`); the others are kept. ``checkpoint.json``, the single file agents before
per-claim records rewrote whole on every change, is carried over when it is found at start: its
claims become records (records of claims it does not hold are removed: it is the truth of the
agent that wrote it last), its switched GPUs join the node's facts, and it is removed; one that
cannot be read is renamed ``checkpoint.json.unreadable`` and reported.

The checkpoint records the boot it was written in (``/proc/sys/kernel/random/boot_id``, read once
a process), in the node's facts and in each record: a MIG device made for a claim does not
outlive a reboot (see :func:`gpuagent.domain.dynmig.made_standing`).

The spec reuses the node's CDI spec (:func:`gpuagent.nodefiles.cdicontent.node_spec`) — its device
edits and common edits: device nodes, control nodes, the driver's libraries, binaries, sockets,
firmware and hooks — for the claim's devices only, renamed ``<claim UID>-<device>`` under kind
``k8s.<driver>/claim``. A device the claim has a share of (``--dra-sharing mps``) adds what makes
its processes clients of the GPU's MPS daemon held to the share (:func:`share_edits`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection, Iterable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

from gpuagent.domain.claims import (
    CHECKPOINT_VERSION,
    PreparedClaim,
    boot_from_checkpoint,
    cdi_kind,
    cdi_name,
    claim_from_record,
    claims_from_checkpoint,
    node_json,
    record_json,
    switched_from_checkpoint,
)
from gpuagent.domain.drashare import Share
from gpuagent.domain.mps import CONTAINER_SHM, MpsDirs, client_env
from gpuagent.nodefiles.atomicfile import remove_if_present, write_if_changed
from gpuagent.nodefiles.cdi import render_spec

__all__ = [
    "BOOT_ID_FILE",
    "CHECKPOINT_FILE",
    "NODE_FILE",
    "RECORDS_DIR",
    "Checkpoint",
    "ClaimFiles",
    "claim_spec",
    "share_edits",
    "with_claim",
    "without_claim",
]

#: The one file of agents before per-claim records (carried over at start).
CHECKPOINT_FILE = "checkpoint.json"
#: The claims' records, one file per claim UID.
RECORDS_DIR = "claims"
#: The node's facts: the GPUs whose MIG mode the agent switched on, the boot.
NODE_FILE = "node.json"
#: A container's MPS directories are its own to write (the daemon's pipe, the shared memory).
MPS_MOUNT_OPTIONS = ("rw", "nosuid", "nodev", "rbind", "rprivate")
#: The kernel's boot ID under a proc root (``/proc``; the simulated node has its own).
BOOT_ID_FILE = "sys/kernel/random/boot_id"


class Checkpoint(NamedTuple):
    """What the checkpoint holds: the prepared claims, the GPUs whose MIG mode the agent
    switched on, the boot it was written in (empty: unknown), and what could not be read (one
    line each: the file and why)."""

    claims: dict[str, PreparedClaim]
    switched: frozenset[str]
    boot: str
    unreadable: tuple[str, ...] = ()


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
    """The claims' records and the node's facts under ``state_dir``, the claims' CDI specs under
    ``cdi_dir``; ``proc_root``: where the kernel's boot ID is read.

    Every method blocks (files are fsynced); the caller runs them off the event loop, one at a
    time.
    """

    def __init__(
        self, state_dir: Path, cdi_dir: Path, driver: str, proc_root: Path = Path("/proc")
    ) -> None:
        self.checkpoint = state_dir / CHECKPOINT_FILE
        self.records = state_dir / RECORDS_DIR
        self.node_file = state_dir / NODE_FILE
        self._cdi_dir = cdi_dir
        self._driver = driver
        self._boot_file = proc_root / BOOT_ID_FILE
        self._boot: str | None = None
        self._node_written: bytes | None = None

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

    def _known_boot(self) -> str:
        try:
            return self.boot()
        except OSError:
            return ""

    def spec_path(self, claim_uid: str) -> Path:
        # CDI's transient spec name: "<vendor>-<class>_<uid>".
        vendor, _, cls = cdi_kind(self._driver).partition("/")
        return self._cdi_dir / f"{vendor}-{cls}_{claim_uid}.json"

    def record_path(self, claim_uid: str) -> Path:
        return self.records / f"{claim_uid}.json"

    def load(self) -> Checkpoint:
        """The prepared claims, the node's facts, and what could not be read (set aside); an
        older agent's ``checkpoint.json`` carried over first. Raises :class:`OSError` when the
        state directory cannot be read or the carried-over claims written."""
        unreadable: list[str] = []
        legacy = self._legacy(unreadable)
        claims = self._read_records(unreadable)
        switched, boot = self._read_node(unreadable)
        if legacy is not None:
            claims, switched = self._carry_over(legacy, claims, switched | legacy.switched)
            boot = legacy.boot
        return Checkpoint(claims, switched, boot, tuple(unreadable))

    def _legacy(self, unreadable: list[str]) -> Checkpoint | None:
        """``checkpoint.json``, if there is one; one that cannot be read is renamed aside."""
        try:
            document = json.loads(self.checkpoint.read_bytes())
            return Checkpoint(
                claims_from_checkpoint(document),
                switched_from_checkpoint(document),
                boot_from_checkpoint(document),
            )
        except FileNotFoundError:
            return None
        except ValueError as exc:  # (JSONDecodeError and UnicodeDecodeError are ValueErrors)
            aside = self.checkpoint.with_name(f"{CHECKPOINT_FILE}.unreadable")
            os.replace(self.checkpoint, aside)
            unreadable.append(f"{self.checkpoint}: {exc} (kept as {aside.name})")
            return None

    def _read_records(self, unreadable: list[str]) -> dict[str, PreparedClaim]:
        claims: dict[str, PreparedClaim] = {}
        try:
            paths = sorted(self.records.iterdir())
        except FileNotFoundError:
            return claims
        for path in paths:
            if path.name.startswith(".") or path.suffix != ".json":  # (".…tmp": a torn write)
                continue
            try:
                claim = _record(path)
            except (ValueError, OSError) as exc:
                unreadable.append(f"{path}: {exc}")
                continue
            claims[claim.ref.uid] = claim
        return claims

    def _read_node(self, unreadable: list[str]) -> tuple[frozenset[str], str]:
        try:
            data = self.node_file.read_bytes()
            facts = _node_facts(data)
        except FileNotFoundError:
            return frozenset(), ""
        except ValueError as exc:
            unreadable.append(f"{self.node_file}: {exc}")
            return frozenset(), ""
        self._node_written = data
        return facts

    def _carry_over(
        self, legacy: Checkpoint, records: Mapping[str, PreparedClaim], switched: frozenset[str]
    ) -> tuple[dict[str, PreparedClaim], frozenset[str]]:
        """``legacy``'s claims as records (the others' removed), ``switched`` in the node's
        facts, then ``checkpoint.json`` removed: each step done again after a crash."""
        for claim in legacy.claims.values():
            self._write_record(claim, legacy.boot)
        for uid in records.keys() - legacy.claims.keys():
            remove_if_present(self.record_path(uid))
        self._write_node(switched, legacy.boot or self._known_boot())
        remove_if_present(self.checkpoint)
        return dict(legacy.claims), switched

    def save_claim(self, claim: PreparedClaim) -> None:
        """Write ``claim``'s record, in this process's boot (none where it cannot be read)."""
        self._write_record(claim, self._known_boot())

    def _write_record(self, claim: PreparedClaim, boot: str) -> None:
        data = (json.dumps(record_json(claim, boot), indent=1) + "\n").encode()
        write_if_changed(self.record_path(claim.ref.uid), data, mode=0o600)

    def remove_claim(self, claim_uid: str) -> None:
        remove_if_present(self.record_path(claim_uid))

    def save_node(self, switched: Collection[str]) -> None:
        """Write the node's facts, in this process's boot, unless they are as last written."""
        self._write_node(switched, self._known_boot())

    def _write_node(self, switched: Collection[str], boot: str) -> None:
        data = (json.dumps(node_json(switched, boot), indent=1) + "\n").encode()
        if data != self._node_written:
            write_if_changed(self.node_file, data, mode=0o600)
            self._node_written = data

    def write_spec(self, claim_uid: str, spec: Mapping[str, Any]) -> None:
        write_if_changed(self.spec_path(claim_uid), render_spec(spec))

    def remove_spec(self, claim_uid: str) -> None:
        remove_if_present(self.spec_path(claim_uid))


def _record(path: Path) -> PreparedClaim:
    """The claim of the record at ``path``; raises :class:`ValueError`, :class:`OSError`."""
    claim = claim_from_record(json.loads(path.read_bytes()))
    if path.name != f"{claim.ref.uid}.json":
        raise ValueError(f"it holds claim {claim.ref.uid!r}")
    return claim


def _node_facts(data: bytes) -> tuple[frozenset[str], str]:
    """The switched GPUs and the boot of ``node.json``'s ``data``; raises :class:`ValueError`."""
    document = json.loads(data)
    if not isinstance(document, dict) or document.get("version") != CHECKPOINT_VERSION:
        raise ValueError(f"not a version {CHECKPOINT_VERSION} node checkpoint")
    return switched_from_checkpoint(document), boot_from_checkpoint(document)


def with_claim(
    claims: Mapping[str, PreparedClaim], claim: PreparedClaim
) -> dict[str, PreparedClaim]:
    return {**claims, claim.ref.uid: claim}


def without_claim(claims: Mapping[str, PreparedClaim], uid: str) -> dict[str, PreparedClaim]:
    return {k: v for k, v in claims.items() if k != uid}
