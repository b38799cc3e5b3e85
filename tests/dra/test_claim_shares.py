"""The DRA side's claims' shares (dra/shares.py) on a store: refused while the GPU's MPS daemon is
not up, waited for until it is (or the wait is over), put into the store, and the CDI edits."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
from support.fake_apiserver import claim
from support.nodes import gpu, gpu_uuid, node
from support.tasks import running
from support.waiting import eventually

from gpuagent.domain.claims import ClaimError, ClaimRef, PreparedClaim, PreparedDevice
from gpuagent.domain.dra import DraGpus, DraPlan
from gpuagent.domain.drashare import ClaimShare, DraSharing, Share, share_daemon
from gpuagent.domain.drasharing import served_devices
from gpuagent.domain.mps import MpsDirs, MpsStatus
from gpuagent.domain.plan import Plan
from gpuagent.dra.claims import claim_spec
from gpuagent.dra.shares import ClaimShares, DaemonDown
from gpuagent.state.store import DeviceStore

DRIVER = "gpu.nvidia.com"
POOL = "node-a"
REF = ClaimRef("ml", "small", "u-small")
PLAN = Plan(dra=DraPlan(gpus=DraGpus(all=True), sharing=DraSharing.MPS))
DAEMON = share_daemon(DRIVER, "gpu-0", 0, gpu_uuid(0))


def _store() -> DeviceStore:
    return DeviceStore(node(gpu(0), gpu(1)), plan=PLAN)


def _daemon_up(store: DeviceStore) -> None:
    up = MpsStatus(up=True, error="", daemon=DAEMON)
    store.update(lambda s: replace(s, mps=s.mps.with_status(DAEMON.name, up)))


def _of(shares: ClaimShares, store: DeviceStore, consumed: dict[str, str]) -> dict[str, Share]:
    obj = claim("ml", "small", "u-small", [("gpu", DRIVER, POOL, "gpu-0")], consumed=consumed)
    devices = {d.name: d for d in served_devices(store.snapshot, store.plan.dra)}
    return shares.of(obj, REF, ["gpu-0"], devices, POOL)


def test_a_share_is_refused_while_its_gpus_daemon_is_not_up() -> None:
    store = _store()
    shares = ClaimShares(store, DRIVER)
    with pytest.raises(DaemonDown) as down:
        _of(shares, store, {"memory": "4Gi", "compute": "25"})
    assert down.value.daemons == {DAEMON.name}
    assert str(down.value) == (
        f"MPS control daemon for {DAEMON.name}: not started; the kubelet tries again"
    )
    # The whole GPU needs no daemon: it is prepared as without sharing.
    assert _of(shares, store, {"memory": "81559Mi", "compute": "100"}) == {}
    _daemon_up(store)
    assert _of(shares, store, {"memory": "4Gi", "compute": "25"}) == {"gpu-0": Share(4096, 25)}
    with pytest.raises(ClaimError, match="claim ml/small: device gpu-0: consumed 0 bytes"):
        _of(shares, store, {"memory": "0", "compute": "25"})


async def test_a_prepare_waits_for_the_daemon_until_it_is_up_or_the_wait_is_over() -> None:
    store = _store()
    shares = ClaimShares(store, DRIVER, wait_s=30.0)
    async with running(shares.until_up(frozenset({DAEMON.name}))) as waiting:
        await asyncio.sleep(0)
        assert not waiting.done()
        _daemon_up(store)
        await eventually(waiting.done, what="the wait over once the daemon is up")
    brief = ClaimShares(_store(), DRIVER, wait_s=0.0)
    await brief.until_up(frozenset({DAEMON.name}))  # not up: returns once the wait is over


def test_the_shares_go_into_the_store_and_their_edits_into_the_spec() -> None:
    store = _store()
    shares = ClaimShares(store, DRIVER)
    device = PreparedDevice(("gpu",), POOL, "gpu-0", ("cdi",), gpu_uuid(0), share=Share(4096, 25))
    whole = PreparedDevice(("gpu",), POOL, "gpu-1", ("cdi",), gpu_uuid(1))
    prepared = PreparedClaim(REF, (device, whole))
    shares.publish({REF.uid: prepared})
    assert store.snapshot.shares == (
        ClaimShare(DRIVER, "ml", "small", "u-small", "gpu-0", gpu_uuid(0), Share(4096, 25)),
    )
    node_spec = {"cdiVersion": "0.6.0", "kind": "k8s.gpu.nvidia.com/gpu", "devices": [
        {"name": gpu_uuid(i), "containerEdits": {"deviceNodes": [{"path": f"/dev/nvidia{i}"}]}}
        for i in (0, 1)
    ]}  # fmt: skip
    dirs = MpsDirs("/run/nvidia/mps")
    spec = claim_spec(
        node_spec,
        REF.uid,
        [("gpu-0", gpu_uuid(0)), ("gpu-1", gpu_uuid(1))],
        driver=DRIVER,
        extra=shares.edits(prepared, dirs),
    )
    shared, other = spec["devices"]
    assert shared["containerEdits"]["env"] == [
        f"CUDA_MPS_PIPE_DIRECTORY=/mps/{DAEMON.name}/pipe",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=4096M",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25",
    ]
    assert shared["containerEdits"]["deviceNodes"] == [{"path": "/dev/nvidia0"}]
    assert [m["hostPath"] for m in shared["containerEdits"]["mounts"]] == [
        f"/run/nvidia/mps/{DAEMON.name}/pipe",
        "/run/nvidia/mps/shm",
    ]
    assert other["containerEdits"] == {"deviceNodes": [{"path": "/dev/nvidia1"}]}
    shares.publish({})
    assert len(store.snapshot.shares) == 0
