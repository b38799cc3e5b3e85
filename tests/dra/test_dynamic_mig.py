"""MIG made on demand through DRA (``--dra-mig dynamic``), end to end with no cluster: the
kubelet's side on grpcio, the API server validating every write, one simulated H100 whose
driver makes MIG devices as a real one does (its latencies recorded, not slept).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pynvml
import pytest
from e2e.agentrun import RunningAgent, running_agent
from e2e.test_container_accounting import samples
from support.cgroups import Layout, cgroup_file, write_proc
from support.clock import Sleeps
from support.fake_apiserver import FakeApiServer, claim
from support.fake_cri import FakeCri, RuntimeContainer
from support.fake_plugin_watcher import FakePluginWatcher, Registration
from support.fake_podresources import Claimed, FakePodResources
from support.grpcstubs import CriStubs
from support.simnvml import nvml_on
from support.waiting import eventually

from dra.test_dra_flow import DRIVER, FAST_DRA, NODE, Dirs, cdi_validator, registered
from gpuagent.domain.migshapes import Placement
from gpuagent.gpu import migmake
from gpuagent.gpu.nvml import Nvml
from gpuagent.gpu.sim import SimDriver, node_from_mapping

H100_DEVICES = 26  # the whole GPU and 25 placements of its seven profiles
SMALL, LARGE = "gpu-0-mig-1g10gb-19-6", "gpu-0-mig-3g40gb-9-0"


def h100(sleeps: Sleeps) -> SimDriver:
    node = node_from_mapping({"version": "v1", "gpus": [{"name": "H100"}], "cap_sys_admin": True})
    return SimDriver(node, sleep=sleeps)


@asynccontextmanager
async def dynamic_agent(
    sim: SimDriver, dirs: Dirs, device_plugin_dir: Path, apiserver: FakeApiServer, *extra: str
) -> AsyncIterator[RunningAgent]:
    args = (*dirs.args(apiserver, dra_gpus="all", extra=extra), "--dra-mig", "dynamic")
    options = {"node_name": NODE, "dra_options": FAST_DRA}
    async with running_agent(device_plugin_dir, args, agent_options=options, simulator=sim) as run:
        yield run


async def published(watcher: FakePluginWatcher, apiserver: FakeApiServer) -> Kubelet:
    """The plugin registered and the H100's 26 devices published: the kubelet's calls."""
    reg = await registered(watcher)
    await eventually(lambda: len(apiserver.devices()) == H100_DEVICES, what="26 devices")
    return Kubelet(watcher, apiserver, reg)


class Kubelet:
    """The kubelet's DRA calls for claims ``ns/<name>`` (UID ``u-<name>``), each added to the
    API server allocated one device of this node's pool."""

    def __init__(self, watcher: FakePluginWatcher, apiserver: FakeApiServer, reg: Registration):
        self.watcher, self.apiserver, self.reg = watcher, apiserver, reg

    async def prepare(self, **devices: str) -> Any:
        """Prepare claims by name: the device each is allocated."""
        for name, device in devices.items():
            kind = "gpu" if device == "gpu-0" else "mig"
            self.apiserver.add_claim(claim("ns", name, f"u-{name}", [(kind, DRIVER, NODE, device)]))
        return await self.watcher.aprepare(self.reg, [("ns", n, f"u-{n}") for n in devices])

    async def unprepare(self, *names: str) -> Any:
        return await self.watcher.aunprepare(self.reg, [("ns", n, f"u-{n}") for n in names])


@dataclass
class Node:
    """One simulated H100 (its driver's sleeps recorded), the agent on it, the kubelet's calls."""

    sim: SimDriver
    sleeps: Sleeps
    run: RunningAgent
    kubelet: Kubelet


@pytest.fixture
async def h100_node(
    device_plugin_dir: Path, apiserver: FakeApiServer, dirs: Dirs, watcher: FakePluginWatcher
) -> AsyncIterator[Node]:
    sleeps = Sleeps()
    sim = h100(sleeps)
    async with dynamic_agent(sim, dirs, device_plugin_dir, apiserver) as run:
        yield Node(sim, sleeps, run, await published(watcher, apiserver))


async def sim_instances(run: RunningAgent) -> list[tuple[int, int, int]]:
    """``(profile ID, placement start, size)`` of each instance ``/sim/gpus`` shows."""
    status, body = await run.get("/sim/gpus")
    assert status == 200
    (gpu,) = json.loads(body)
    return sorted(
        (m["profile_id"], m["placement"]["start"], m["placement"]["size"])
        for m in gpu["mig_devices"]
    )


async def mig_mode(run: RunningAgent) -> str:
    (gpu,) = json.loads((await run.get("/sim/gpus"))[1])
    return str(gpu["mig_mode"])


def spec_of(dirs: Dirs, uid: str) -> dict[str, Any]:
    return dict(json.loads((dirs.cdi / f"k8s.{DRIVER}-claim_{uid}.json").read_text()))


async def test_a_1g_and_a_3g_are_made_on_prepare_and_removed_on_unprepare(
    h100_node: Node, apiserver: FakeApiServer, dirs: Dirs
) -> None:
    run, kubelet, sleeps = h100_node.run, h100_node.kubelet, h100_node.sleeps
    assert {SMALL, LARGE} <= set(apiserver.devices())
    assert await mig_mode(run) == "disabled"
    response = await kubelet.prepare(small=SMALL, large=LARGE)
    for uid, name in (("u-small", SMALL), ("u-large", LARGE)):
        result = response.claims[uid]
        assert result.error == ""
        (device,) = result.devices
        assert device.device_name == name
        assert list(device.cdi_device_ids) == [f"k8s.{DRIVER}/claim={uid}-{name}"]

    # The driver holds exactly those two, at the allocated placements.
    assert await sim_instances(run) == [(9, 0, 4), (19, 6, 1)]
    assert await mig_mode(run) == "enabled"
    # Each creation spent the driver's latency (recorded, not slept).
    assert sleeps.seconds.count(0.25) == 2

    # The container specs name their MIG devices, with their nvidia-caps nodes.
    gpu = run.agent.store.snapshot.gpu(0)
    assert gpu is not None
    by_profile = {m.profile: m for m in gpu.mig_devices}
    assert set(by_profile) == {"1g.10gb", "3g.40gb"}
    for uid, profile in (("u-small", "1g.10gb"), ("u-large", "3g.40gb")):
        mig = by_profile[profile]
        spec = spec_of(dirs, uid)
        cdi_validator().validate(spec)
        (entry,) = spec["devices"]
        edits = entry["containerEdits"]
        nodes = [n["path"] for n in edits["deviceNodes"]]
        assert nodes[0] == f"/dev/nvidia{gpu.minor}"
        assert len(nodes) == 3
        assert all(n.startswith("/dev/nvidia-caps/") for n in nodes[1:])
        assert nodes[1:] == list(mig.device_nodes)
    checkpoint = dirs.checkpoint()
    assert checkpoint["migSwitched"] == [gpu.uuid]
    assert checkpoint["claims"]["u-small"]["devices"][0]["mig"]["start"] == 6

    # An overlapping placement (the 3g at 0 holds slices 0-3): refused, per claim.
    overlap = "gpu-0-mig-1g10gb-19-2"
    refused = await kubelet.prepare(clash=overlap)
    error = refused.claims["u-clash"].error
    assert "INSUFFICIENT_RESOURCES" in error
    assert overlap in error
    assert "overlaps" in error
    assert await sim_instances(run) == [(9, 0, 4), (19, 6, 1)]

    # Unprepared: both destroyed, MIG mode back off, the store forgets them.
    done = await kubelet.unprepare("small", "large")
    assert done.claims["u-small"].error == ""
    assert done.claims["u-large"].error == ""
    assert await sim_instances(run) == []
    assert await mig_mode(run) == "disabled"
    gpu = run.agent.store.snapshot.gpu(0)
    assert gpu is not None
    assert gpu.mig_devices == ()
    assert not gpu.mig_enabled
    again = await kubelet.unprepare("small")
    assert again.claims["u-small"].error == ""
    assert apiserver.invalid == []


async def test_unprepare_is_refused_while_a_process_runs_on_the_instance(
    h100_node: Node, dirs: Dirs
) -> None:
    sim, run, kubelet = h100_node.sim, h100_node.run, h100_node.kubelet
    prepared = await kubelet.prepare(large=LARGE)
    assert prepared.claims["u-large"].error == ""
    gpu = run.agent.store.snapshot.gpu(0)
    assert gpu is not None
    (mig,) = gpu.mig_devices
    sim.add_process(0, 4242, 1024, 50, gpu_instance=mig.gpu_instance_id, compute_instance=0)
    busy = await kubelet.unprepare("large")
    assert "IN_USE" in busy.claims["u-large"].error
    assert await sim_instances(run) == [(9, 0, 4)]
    assert (dirs.cdi / f"k8s.{DRIVER}-claim_u-large.json").exists()
    # The whole GPU cannot be had while it is in MIG mode (the scheduler's counters keep
    # it from being allocated beside an instance; the agent refuses it too).
    whole = await kubelet.prepare(whole="gpu-0")
    assert "is in MIG mode" in whole.claims["u-whole"].error
    sim.remove_process(4242)
    done = await kubelet.unprepare("large")
    assert done.claims["u-large"].error == ""
    assert await sim_instances(run) == []
    assert await mig_mode(run) == "disabled"
    whole = await kubelet.prepare(whole="gpu-0")
    assert whole.claims["u-whole"].error == ""
    spec = spec_of(dirs, "u-whole")
    assert [n["path"] for n in spec["devices"][0]["containerEdits"]["deviceNodes"]] == [
        "/dev/nvidia0"
    ]


def make_orphan(sim: SimDriver) -> None:
    """A 1g.10gb made at slice 5 behind the agent's back (as by a crash before its checkpoint)."""
    with nvml_on(sim):
        nvml = Nvml(mig_shapes=True)
        gpu = nvml.describe(0)
        assert gpu.mig_partitions is not None
        shape = next(s for s in gpu.mig_partitions.shapes if s.profile_id == 19)
        migmake.make_instance(0, nvml.mig_handle(0), nvml.calls, shape, Placement(5, 1))
        assert pynvml.nvmlDeviceGetMigMode(pynvml.nvmlDeviceGetHandleByIndex(0))[0] == 1


async def test_a_restart_between_prepare_and_unprepare_leaves_no_orphan(
    device_plugin_dir: Path, apiserver: FakeApiServer, dirs: Dirs, watcher: FakePluginWatcher
) -> None:
    sim = h100(Sleeps())
    async with dynamic_agent(sim, dirs, device_plugin_dir, apiserver) as run:
        first = await (await published(watcher, apiserver)).prepare(small=SMALL)
        assert first.claims["u-small"].error == ""
    make_orphan(sim)
    async with dynamic_agent(sim, dirs, device_plugin_dir, apiserver) as run:
        kubelet = await published(watcher, apiserver)
        # The orphan is destroyed; the prepared claim's instance is kept (and the claim is
        # answered from the checkpoint, the API server's copy being gone).
        del apiserver.claims[("ns", "small")]
        again = await kubelet.watcher.aprepare(kubelet.reg, [("ns", "small", "u-small")])
        assert list(again.claims["u-small"].devices[0].cdi_device_ids) == list(
            first.claims["u-small"].devices[0].cdi_device_ids
        )
        assert await sim_instances(run) == [(19, 6, 1)]
        done = await kubelet.unprepare("small")
        assert done.claims["u-small"].error == ""
        assert await sim_instances(run) == []
        assert await mig_mode(run) == "disabled"
        assert apiserver.invalid == []


def mig_series(text: str, uuid: str) -> list[str]:
    return [line for line in text.splitlines() if f'mig_uuid="{uuid}"' in line]


async def test_a_made_instance_is_in_metrics_and_health_at_once_and_leaves_them(
    h100_node: Node, apiserver: FakeApiServer
) -> None:
    run, kubelet = h100_node.run, h100_node.kubelet
    prepared = await kubelet.prepare(small=SMALL, large=LARGE)
    assert {r.error for r in prepared.claims.values()} == {""}
    gpu = run.agent.store.snapshot.gpu(0)
    assert gpu is not None
    small = next(m for m in gpu.mig_devices if m.profile == "1g.10gb")
    large = next(m for m in gpu.mig_devices if m.profile == "3g.40gb")
    # /metrics has both, with their GPU-instance IDs, as soon as the prepare answered.
    _, text = await run.get("/metrics")
    (info,) = [s for s in mig_series(text, small.uuid) if s.startswith("gpuagent_mig_device_info")]
    assert f'gpu_instance="{small.gpu_instance_id}"' in info
    assert mig_series(text, large.uuid)
    # Its own telemetry follows with the next probe (dcgm-exporter's GPU_I_ID series).
    await run.metrics_until(lambda t: f'GPU_I_ID="{small.gpu_instance_id}"' in t)
    # An XID on the small instance taints its placement alone.
    await run.fault(
        {"gpu": 0, "fault": "xid", "xid": 46, "gpu_instance": small.gpu_instance_id,
         "compute_instance": 0}
    )  # fmt: skip
    await eventually(lambda: "taints" in apiserver.devices()[SMALL], what="small tainted")
    assert "taints" not in apiserver.devices()[LARGE]
    assert "taints" not in apiserver.devices()["gpu-0"]
    # Unprepared: gone from /metrics at once.
    await kubelet.unprepare("small", "large")
    _, text = await run.get("/metrics")
    assert mig_series(text, small.uuid) == []
    assert mig_series(text, large.uuid) == []
    await run.metrics_until(lambda t: f'GPU_I_ID="{small.gpu_instance_id}"' not in t)
    assert apiserver.invalid == []


async def test_a_made_instance_is_attributed_to_the_pod_claiming_it(
    device_plugin_dir: Path,
    apiserver: FakeApiServer,
    dirs: Dirs,
    watcher: FakePluginWatcher,
    pod_resources: FakePodResources,
    cri_stubs: CriStubs,
    tmp_path: Path,
) -> None:
    """A 1g.10gb made for a claim, a process of the claiming pod on it: pod-resources names the
    claim's device (its placement's name), and /metrics attributes the made GPU instance to the
    pod — never as work on a device nobody was allocated."""
    uid, pid = "5a11c1a1-0000-4000-8000-000000005005", 5005
    cid = f"{pid:064x}"
    layout = Layout("containerd", "systemd", 2, "guaranteed")
    proc = write_proc(tmp_path / "proc", {pid: cgroup_file(layout, uid, cid)})
    sim = h100(Sleeps())
    with FakeCri(dirs.root / "cri" / "containerd.sock", cri_stubs) as cri:
        cri.set([RuntimeContainer(cid, "ns", "trainer", "main", pod_uid=uid)])
        extra = ("--pod-resources-socket", str(pod_resources.socket_path),
                 "--cri-socket", str(cri.socket_path), "--proc-root", str(proc),
                 "--container-logs-dir", str(proc / "none"), "--container-accounting=true",
                 "--poll-interval", "0.3")  # fmt: skip
        async with dynamic_agent(sim, dirs, device_plugin_dir, apiserver, *extra) as run:
            kubelet = await published(watcher, apiserver)
            pod_resources.set([Claimed("ns", "trainer", "main", "small", DRIVER, NODE, SMALL)])
            prepared = await kubelet.prepare(small=SMALL)
            assert prepared.claims["u-small"].error == ""
            store = run.agent.store
            # The prepare has pod-resources asked again (its answer lists the claim's device).
            await eventually(
                lambda: any(a.pod == "trainer" for a in store.snapshot.pods.allocated),
                what="the claim listed",
            )
            gpu = store.snapshot.gpu(0)
            assert gpu is not None
            (made,) = gpu.mig_devices
            gi = str(made.gpu_instance_id)
            sim.add_process(0, pid, 1024, 50, gpu_instance=made.gpu_instance_id, compute_instance=0)

            def seen(text: str) -> bool:
                rows = samples(text, "gpuagent_container_gpu_processes")
                return any(lbl["pod"] == "trainer" and v == 1 for lbl, v in rows)

            text = await run.metrics_until(seen)
            allocated = [lbl for lbl, _ in samples(text, "gpuagent_device_allocated")]
            assert [(a["gpu_instance"], a["pod"]) for a in allocated] == [(gi, "trainer")]
            usage = [
                lbl for lbl, _ in samples(text, "gpuagent_container_gpu_processes")
                if lbl["pod"] == "trainer"
            ]  # fmt: skip
            assert [u["GPU_I_ID"] for u in usage] == [gi]
            unallocated = samples(text, "gpuagent_gpu_unallocated_use")
            assert {(lbl["GPU_I_ID"], lbl["pod"], v) for lbl, v in unallocated} == {(gi, "", 0)}
            await run.metrics_until(
                lambda t: any(
                    lbl.get("GPU_I_ID") == gi and lbl["pod"] == "trainer"
                    for lbl, _ in samples(t, "DCGM_FI_DEV_FB_USED")
                )
            )
            assert apiserver.invalid == []
