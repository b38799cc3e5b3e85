"""The claims a node holds, on disk (dra/claims.py under the preparer of dra/service.py): what a
prepare writes does not grow with the claims held, and after a crash at any point of a prepare
or an unprepare a restarted preparer remembers the claim with its spec, or has nothing of it
that an unprepare leaves behind."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import structlog.testing
from support.apiobjects import claim
from support.nodes import gpu, gpu_uuid, node
from support.required import unavailable

import gpuagent.dra.claims as claim_files
from gpuagent._proto.k8s.io.kubelet.pkg.apis.dra import v1 as dra_v1
from gpuagent.domain.claims import ClaimRef, claims_from_checkpoint, switched_from_checkpoint
from gpuagent.domain.dra import DraGpus, DraPlan
from gpuagent.domain.drasharing import served_devices
from gpuagent.domain.plan import Plan
from gpuagent.dra.claims import ClaimFiles
from gpuagent.dra.service import ClaimPreparer, DraConfig, DraPluginV1
from gpuagent.nodefiles import atomicfile
from gpuagent.state.store import DeviceStore

DRIVER = "gpu.nvidia.com"
POOL = "node-a"
NODE_SPEC = {
    "cdiVersion": "0.6.0",
    "kind": "nvidia.com/gpu",
    "devices": [
        {"name": gpu_uuid(i), "containerEdits": {"deviceNodes": [{"path": f"/dev/nvidia{i}"}]}}
        for i in (0, 1)
    ],
}


class Crash(BaseException):
    """The agent killed here (a BaseException: nothing of the preparer's catches it)."""


class Node:
    """A preparer on two GPUs over the files under ``root``, as a restarted agent has it; the
    API server's claims, and how many times one was read."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.api: dict[str, Mapping[str, Any]] = {}
        self.reads = 0

    async def started(self) -> ClaimPreparer:
        async def read(namespace: str, name: str) -> Mapping[str, Any]:
            self.reads += 1
            return self.api[name]

        store = DeviceStore(node(gpu(0), gpu(1)), plan=Plan(dra=DraPlan(gpus=DraGpus(all=True))))
        preparer = ClaimPreparer(
            store,
            lambda s: served_devices(s, s.plan.dra),
            read,
            ClaimFiles(self.root / "state", self.root / "cdi", DRIVER),
            DraConfig(driver=DRIVER, pool=POOL),
            node_spec=lambda s: NODE_SPEC,
            settle_s=0.0,
        )
        await preparer.load()
        return preparer

    def add(self, uid: str) -> ClaimRef:
        self.api[uid] = claim("ml", uid, uid, [("gpu", DRIVER, POOL, "gpu-0")])
        return ClaimRef("ml", uid, uid)

    def files_of(self, uid: str) -> list[Path]:
        """Every file under the agent's directories that names ``uid``."""
        return sorted(p for p in self.root.rglob(f"*{uid}*") if p.is_file())

    def spec(self, uid: str) -> Path:
        return self.root / "cdi" / f"k8s.{DRIVER}-claim_{uid}.json"


def _writes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Path, int]]:
    """The files the claims' writes replace, with their sizes, as they are written."""
    written: list[tuple[Path, int]] = []
    write = atomicfile.write_if_changed

    def counted(path: Path, data: bytes, *, mode: int = 0o644) -> bool:
        written.append((path, len(data)))
        return write(path, data, mode=mode)

    monkeypatch.setattr(claim_files, "write_if_changed", counted)
    return written


async def test_a_prepare_writes_as_much_whatever_the_node_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With 200 claims held, a prepare and an unprepare write what they write with one: the
    claim's own files (main rewrote the whole checkpoint: 73 kB at 200 claims)."""
    written = _writes(monkeypatch)
    node = Node(tmp_path)
    preparer = await node.started()
    await preparer.prepare(node.add("first"))
    costs = []
    for held, uid in ((1, "measured-a"), (200, "measured-b")):
        while len(preparer.claims) < held:
            await preparer.prepare(node.add(f"held-{len(preparer.claims)}"))
        written.clear()
        await preparer.prepare(node.add(uid))
        await preparer.unprepare(ClaimRef("ml", uid, uid))
        costs.append(sorted((path.parent.name, size) for path, size in written))
    assert costs[0] == costs[1]
    assert sum(size for _, size in costs[1]) < 2_000
    assert len(preparer.claims) == 200


def _crashing(monkeypatch: pytest.MonkeyPatch, at: int) -> None:
    """The file operations of dra/claims.py (a file replaced, one removed: each atomic) crash
    before the ``at``-th (0-based); from then on nothing is done, as in a killed agent."""
    seen = [0]
    write, remove = atomicfile.write_if_changed, atomicfile.remove_if_present

    def step(path: Path) -> None:
        seen[0] += 1
        if seen[0] > at:
            raise Crash(f"before operation {seen[0] - 1} ({path.name})")

    def crashing_write(path: Path, data: bytes, *, mode: int = 0o644) -> bool:
        step(path)
        return write(path, data, mode=mode)

    def crashing_remove(path: Path) -> bool:
        step(path)
        return remove(path)

    monkeypatch.setattr(claim_files, "write_if_changed", crashing_write)
    monkeypatch.setattr(claim_files, "remove_if_present", crashing_remove)


async def _remembers_or_has_nothing(node: Node, uid: str) -> None:
    """A restarted preparer remembers ``uid`` (answered without the API server, its spec on
    disk), or an unprepare of it leaves nothing of it on disk."""
    preparer = await node.started()
    if uid in preparer.claims:
        reads = node.reads
        await preparer.prepare(ClaimRef("ml", uid, uid))
        assert node.reads == reads
        assert node.spec(uid).is_file()
        return
    await preparer.unprepare(ClaimRef("ml", uid, uid))
    assert node.files_of(uid) == []


@pytest.mark.parametrize("at", range(3))
async def test_a_prepare_killed_at_any_point_is_remembered_or_left_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, at: int
) -> None:
    node = Node(tmp_path)
    preparer = await node.started()
    for held in range(3):  # claims held before: none of them lost
        await preparer.prepare(node.add(f"held-{held}"))
    _crashing(monkeypatch, at)
    ref = node.add("killed")
    with contextlib.suppress(Crash):  # (at 2: no crash, both files written)
        await preparer.prepare(ref)
    monkeypatch.undo()
    await _remembers_or_has_nothing(node, "killed")
    restarted = await node.started()
    assert {f"held-{i}" for i in range(3)} <= set(restarted.claims)


@pytest.mark.parametrize("at", range(3))
async def test_an_unprepare_killed_at_any_point_is_finished_by_the_kubelets_retry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, at: int
) -> None:
    node = Node(tmp_path)
    preparer = await node.started()
    ref = node.add("going")
    await preparer.prepare(ref)
    await preparer.prepare(node.add("staying"))
    _crashing(monkeypatch, at)
    with contextlib.suppress(Crash):
        await preparer.unprepare(ref)
    monkeypatch.undo()
    restarted = await node.started()
    await restarted.unprepare(ref)  # the kubelet asks again
    assert node.files_of("going") == []
    assert set((await node.started()).claims) == {"staying"}


async def test_a_record_that_cannot_be_read_sets_its_claim_aside_alone(tmp_path: Path) -> None:
    node = Node(tmp_path)
    preparer = await node.started()
    for uid in ("good", "torn", "alien"):
        await preparer.prepare(node.add(uid))
    records = tmp_path / "state" / "claims"
    torn = records / "torn.json"
    torn.write_bytes(torn.read_bytes()[:40])  # as a disk that lost the end of it
    (records / "alien.json").write_text(json.dumps({"version": 1, "uid": "someone-else"}))
    (records / ".good.json.x1y2.tmp").write_text("{")  # a write killed before its rename
    with structlog.testing.capture_logs() as logs:
        restarted = await node.started()
    assert set(restarted.claims) == {"good"}
    set_aside = [
        e["error"] for e in logs if e["event"] == "dra checkpoint file unreadable; set aside"
    ]
    assert [line.split(":")[0] for line in set_aside] == [
        str(records / n) for n in ("alien.json", "torn.json")
    ]
    # The set-aside claim is read again from the API server; its unprepare removes it.
    reads = node.reads
    prepared = await restarted.prepare(ClaimRef("ml", "torn", "torn"))
    assert node.reads == reads + 1
    assert prepared.devices[0].device == "gpu-0"
    assert set((await node.started()).claims) == {"good", "torn"}


async def test_a_claim_uid_that_is_no_file_name_is_refused(tmp_path: Path) -> None:
    """The UID names the claim's files: one that would name a path elsewhere is refused."""
    plugin = DraPluginV1(await Node(tmp_path).started())
    for uid in ("../../etc/cron.d/x", ".hidden", "a/b"):
        request = dra_v1.NodePrepareResourcesRequest(
            claims=[dra_v1.Claim(namespace="ml", name="x", uid=uid)]
        )
        answer = (await plugin.node_prepare_resources(request)).claims[uid]
        assert "is not a Kubernetes UID" in answer.error
    assert Node(tmp_path).files_of("") == []


def _old_checkpoint(node: Node) -> Path:
    """``checkpoint.json`` as an agent before per-claim records left it: claim ``plain`` of
    gpu-0 and ``made``, whose MIG device was made in the checkpoint's boot; GPU-9 switched to
    MIG mode by the agent."""
    node.add("plain")
    device = {"requests": ["gpu"], "pool": POOL, "device": "gpu-0", "uuid": gpu_uuid(0),
              "cdi": [f"k8s.{DRIVER}/claim=plain-gpu-0"]}  # fmt: skip
    mig = {"gpu": "GPU-9", "profileId": 19, "start": 3, "gpuInstance": 5}
    made = {**device, "device": "gpu-9-mig-1g10gb-19-3", "uuid": "MIG-1", "mig": mig,
            "cdi": [f"k8s.{DRIVER}/claim=made-gpu-9-mig-1g10gb-19-3"]}  # fmt: skip
    document = {
        "version": 1,
        "bootId": "boot-old",
        "migSwitched": ["GPU-9"],
        "claims": {
            "made": {"namespace": "ml", "name": "made", "devices": [made]},
            "plain": {"namespace": "ml", "name": "plain", "devices": [device]},
        },
    }
    path = node.root / "state" / "checkpoint.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=1) + "\n")
    return path


def _carried_files(node: Node, old: Path) -> None:
    assert not old.exists()
    state = node.root / "state"
    assert sorted(p.name for p in (state / "claims").iterdir()) == ["made.json", "plain.json"]
    node_facts = json.loads((state / "node.json").read_text())
    assert node_facts["migSwitched"] == ["GPU-9"]


async def _carried_over(node: Node, old: Path) -> None:
    """The old checkpoint's claims kept, as records, and the file gone."""
    preparer = await node.started()
    assert set(preparer.claims) == {"plain", "made"}
    _carried_files(node, old)
    (made,) = preparer.claims["made"].devices
    assert made.made is not None
    assert (made.made.gpu_instance_id, made.made.boot) == (5, "boot-old")
    # Answered from what was carried over, without the API server.
    (plain,) = (await preparer.prepare(ClaimRef("ml", "plain", "plain"))).devices
    assert (plain.device, plain.uuid, node.reads) == ("gpu-0", gpu_uuid(0), 0)


async def test_an_upgraded_agent_keeps_the_claims_of_the_old_checkpoint(tmp_path: Path) -> None:
    node = Node(tmp_path)
    old = _old_checkpoint(node)
    # A record from before a downgrade: the old agent unprepared that claim since.
    stale = tmp_path / "state" / "claims" / "unprepared-since.json"
    stale.parent.mkdir()
    stale.write_text(json.dumps({"version": 1, "uid": "unprepared-since", "namespace": "ml",
                                 "name": "u", "devices": []}))  # fmt: skip
    await _carried_over(node, old)
    assert not stale.exists()
    await _carried_over(node, old)  # and again at the next start, from the records


@pytest.mark.parametrize("at", range(4))
async def test_a_carry_over_killed_at_any_point_is_finished_at_the_next_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, at: int
) -> None:
    """Two records, the node's facts, the old file removed: killed before any of them."""
    node = Node(tmp_path)
    old = _old_checkpoint(node)
    _crashing(monkeypatch, at)
    with pytest.raises(Crash):
        await node.started()
    monkeypatch.undo()
    await _carried_over(node, old)


async def test_an_old_checkpoint_that_cannot_be_read_is_kept_aside(tmp_path: Path) -> None:
    node = Node(tmp_path)
    preparer = await node.started()
    await preparer.prepare(node.add("kept"))
    old = tmp_path / "state" / "checkpoint.json"
    old.write_text('{"version": 1, "claims": {')
    with structlog.testing.capture_logs() as logs:
        restarted = await node.started()
    assert set(restarted.claims) == {"kept"}
    assert (tmp_path / "state" / "checkpoint.json.unreadable").read_text().startswith("{")
    assert not old.exists()
    (problem,) = [e["error"] for e in logs if e["event"].startswith("dra checkpoint file")]
    assert problem.startswith(f"{old}: ")
    assert problem.endswith("(kept as checkpoint.json.unreadable)")


def _downgrade_command() -> str:
    """docs/dra.md's command that writes an older agent's checkpoint from the records (after
    its ``cd`` to the production directory)."""
    text = (Path(__file__).parents[2] / "docs" / "dra.md").read_text()
    block = text[text.index("**Downgrading**") :].split("```sh\n", 1)[1].split("```", 1)[0]
    lines = block.splitlines()
    assert lines[0].startswith("cd /var/lib/kubelet/plugins/")
    return "\n".join(lines[1:])


async def test_the_documented_downgrade_writes_the_checkpoint_an_older_agent_reads(
    tmp_path: Path,
) -> None:
    if shutil.which("jq") is None:
        unavailable("jq runs the documented downgrade command")
    node = Node(tmp_path)
    preparer = await node.started()
    for uid in ("one", "two"):
        await preparer.prepare(node.add(uid))
    state = tmp_path / "state"
    await asyncio.to_thread(
        subprocess.run, ["bash", "-ec", _downgrade_command()], cwd=state, check=True
    )
    document = json.loads((state / "checkpoint.json").read_text())
    assert claims_from_checkpoint(document) == preparer.claims
    assert switched_from_checkpoint(document) == frozenset()
