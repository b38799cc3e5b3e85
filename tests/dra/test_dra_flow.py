"""DRA end to end, with no cluster: the agent as the kubelet's plugin watcher and DRA manager
(grpcio, own stubs) and the API server (aiohttp, every write validated) see it.

The agent runs in-process on 4 simulated GPUs; GPUs 2 and 3 are given to DRA, 0 and 1 stay with
the device plugin (a kubelet stand-in checks that side too).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import jsonschema
import structlog.testing
from e2e.agentrun import RunningAgent, running_agent
from referencing import Registry
from referencing.jsonschema import DRAFT7
from support.clock import ManualClock
from support.driverroot import LIBDIR, make_driver_root
from support.fake_apiserver import FakeApiServer, claim
from support.fake_kubelet import FakeKubelet
from support.fake_plugin_watcher import FakePluginWatcher, Registration
from support.grpcstubs import DraStubs
from support.kubehealth import settle as settle_writer
from support.waiting import eventually

from gpuagent.domain.devices import Gpu
from gpuagent.dra.endpoint import EndpointTiming
from gpuagent.dra.service import DraConfig
from gpuagent.gpu.mig import parse_mig_minors
from gpuagent.kube.slices import Backoff, Coalescing

T = 10.0
NODE = "test-node"
DRIVER = "gpu.nvidia.com"
FAST_DRA = {
    "endpoint_timing": EndpointTiming(watch_interval=0.02, retry_initial=0.01, retry_max=0.05),
    "backoff": Backoff(initial=0.01, maximum=0.05),
    # Every change out at once (the pacing of the writes is tests/kube/test_slices.py's).
    "coalescing": Coalescing(window=0.0, settle=0.0),
    "api_timeout": 2.0,
    "health_resend_s": 0.2,
}


class Dirs:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.plugins = root / "plugins"
        self.registry = root / "plugins_registry"
        self.cdi = root / "cdi"

    def checkpoint(self, driver: str = "gpu.nvidia.com") -> dict[str, Any]:
        """What the agent keeps of its claims, as one document: the node's facts (``bootId``,
        ``migSwitched``) and each claim's record by UID (``claims``)."""
        state = self.plugins / driver
        node = json.loads((state / "node.json").read_text())
        records = sorted((state / "claims").glob("*.json"))
        return {**node, "claims": {p.stem: json.loads(p.read_text()) for p in records}}

    def args(
        self, apiserver: FakeApiServer, dra_gpus: str = "2,3", extra: tuple[str, ...] = ()
    ) -> tuple[str, ...]:
        return (*extra,
            "--simulate", "4",
            "--dra-gpus", dra_gpus,
            "--kubeconfig", str(apiserver.kubeconfig(self.root / "kubeconfig")),
            "--plugins-dir", str(self.plugins),
            "--plugins-registry-dir", str(self.registry),
            "--cdi-spec-dir", str(self.cdi),
        )  # fmt: skip


DraAgent = Callable[..., AbstractAsyncContextManager[RunningAgent]]


async def registered(watcher: FakePluginWatcher) -> Registration:
    return await watcher.aregister(await watcher.afind())


async def serving(watcher: FakePluginWatcher, apiserver: FakeApiServer) -> Registration:
    """The plugin registered, and the pool's two devices published."""
    registration = await registered(watcher)
    await eventually(lambda: len(apiserver.devices()) == 2, what="two devices published")
    return registration


def device_of(apiserver: FakeApiServer, uuid: str) -> dict[str, Any]:
    (device,) = [
        d for d in apiserver.devices().values() if d["attributes"]["uuid"]["string"] == uuid
    ]
    return device


def gpu_of(run: RunningAgent, index: int) -> Gpu:
    """GPU ``index`` as the agent knows it."""
    gpu = run.agent.store.snapshot.gpu(index)
    assert gpu is not None
    return gpu


async def test_plugin_watcher_registers_and_a_claim_is_prepared_and_unprepared(
    dra_agent: DraAgent,
    fake_kubelet: FakeKubelet,
    apiserver: FakeApiServer,
    dirs: Dirs,
    watcher: FakePluginWatcher,
) -> None:
    async with dra_agent() as run:
        reg = await registered(watcher)
        assert reg.socket == dirs.registry / f"{DRIVER}-reg.sock"
        assert reg.name == DRIVER
        assert reg.endpoint == str(dirs.plugins / DRIVER / "dra.sock")
        assert reg.versions[:2] == ("v1.DRAPlugin", "v1beta1.DRAPlugin")
        assert reg.service == "v1.DRAPlugin"
        assert not reg.error
        await eventually(lambda: run.dra.endpoint.registered, what="ok")

        # The pool: GPUs 2 and 3 only, every write valid.
        await eventually(lambda: len(apiserver.devices()) == 2, what="two devices published")
        assert apiserver.invalid == []
        uuid2, uuid3 = gpu_of(run, 2).uuid, gpu_of(run, 3).uuid
        assert {d["attributes"]["uuid"]["string"] for d in apiserver.devices().values()} == {
            uuid2,
            uuid3,
        }
        (slice_,) = apiserver.slices.values()
        assert slice_["spec"]["nodeName"] == NODE
        assert slice_["spec"]["pool"]["name"] == NODE
        assert slice_["metadata"]["ownerReferences"][0]["uid"] == apiserver.node_uid

        # Ownership: the device plugin advertises GPUs 0 and 1 only.
        (dp,) = await asyncio.to_thread(fake_kubelet.wait_for_registrations, 1, T)
        ids = {d.ID for d in (await asyncio.to_thread(dp.next_update, T)).devices}
        assert ids == {gpu_of(run, 0).uuid, gpu_of(run, 1).uuid}

        # Prepare a claim for GPU 2.
        name2 = device_of(apiserver, uuid2)["name"]
        apiserver.add_claim(claim("team-a", "train", "uid-1", [("gpu", DRIVER, NODE, name2)]))
        response = await watcher.aprepare(reg, [("team-a", "train", "uid-1")])
        result = response.claims["uid-1"]
        assert result.error == ""
        (device,) = result.devices
        assert (device.pool_name, device.device_name) == (NODE, name2)
        assert list(device.request_names) == ["gpu"]
        assert list(device.cdi_device_ids) == [f"k8s.{DRIVER}/claim=uid-1-{name2}"]
        spec_path = dirs.cdi / f"k8s.{DRIVER}-claim_uid-1.json"
        spec = json.loads(spec_path.read_text())
        assert spec["kind"] == f"k8s.{DRIVER}/claim"
        assert [d["name"] for d in spec["devices"]] == [f"uid-1-{name2}"]
        minor = gpu_of(run, 2).minor
        nodes = [n["path"] for n in spec["devices"][0]["containerEdits"]["deviceNodes"]]
        assert nodes == [f"/dev/nvidia{minor}"]
        cdi_validator().validate(spec)
        checkpoint = dirs.checkpoint()
        assert list(checkpoint["claims"]) == ["uid-1"]

        # Idempotent: asked again (v1beta1 this time), answered from memory, no API read.
        reads = sum(1 for verb, path in apiserver.requests if "resourceclaims" in path)
        again = await watcher.aprepare(
            reg, [("team-a", "train", "uid-1")], version="v1beta1.DRAPlugin"
        )
        assert list(again.claims["uid-1"].devices[0].cdi_device_ids) == list(device.cdi_device_ids)
        assert sum(1 for verb, path in apiserver.requests if "resourceclaims" in path) == reads

        # Unprepare: the spec and the checkpoint entry go; twice is fine.
        done = await watcher.aunprepare(reg, [("team-a", "train", "uid-1")])
        assert done.claims["uid-1"].error == ""
        assert not spec_path.exists()
        again_done = await watcher.aunprepare(reg, [("team-a", "train", "uid-1")])
        assert again_done.claims["uid-1"].error == ""
        checkpoint = dirs.checkpoint()
        assert checkpoint["claims"] == {}
        assert apiserver.invalid == []


async def test_a_claim_spec_carries_the_driver_like_the_node_spec(
    dra_agent: DraAgent, apiserver: FakeApiServer, dirs: Dirs, watcher: FakePluginWatcher
) -> None:
    """A DRA container gets a working CUDA: the claim's spec has the driver's libraries, tools
    and hooks found under --nvidia-driver-root, as the device plugin's CDI spec has them."""
    fake = make_driver_root(dirs.root / "driver", version="580.95.05")
    extra = ("--nvidia-driver-root", str(fake.root))
    async with dra_agent(extra=extra) as run:
        reg = await serving(watcher, apiserver)
        name2 = device_of(apiserver, gpu_of(run, 2).uuid)["name"]
        apiserver.add_claim(claim("team-a", "cuda", "u-drv", [("gpu", DRIVER, NODE, name2)]))
        response = await watcher.aprepare(reg, [("team-a", "cuda", "u-drv")])
        assert response.claims["u-drv"].error == ""
    spec = json.loads((dirs.cdi / f"k8s.{DRIVER}-claim_u-drv.json").read_text())
    edits = spec["containerEdits"]
    mounts = {m["containerPath"]: m["hostPath"] for m in edits["mounts"]}
    library = f"{LIBDIR}/libcuda.so.580.95.05"
    assert mounts[library] == f"{fake.root}{library}"
    assert "/usr/bin/nvidia-smi" in mounts
    assert {h["hookName"] for h in edits["hooks"]} == {"createContainer"}
    cdi_validator().validate(spec)


async def test_claims_this_node_cannot_serve_get_their_own_error(
    dra_agent: DraAgent, apiserver: FakeApiServer, watcher: FakePluginWatcher
) -> None:
    async with dra_agent() as run:
        reg = await serving(watcher, apiserver)
        good = device_of(apiserver, gpu_of(run, 3).uuid)["name"]
        minor0 = gpu_of(run, 0).minor
        apiserver.add_claim(claim("ns", "ok", "u-ok", [("gpu", DRIVER, NODE, good)]))
        apiserver.add_claim(claim("ns", "pending", "u-pending", None))
        apiserver.add_claim(claim("ns", "elsewhere", "u-else", [("gpu", DRIVER, "other", good)]))
        apiserver.add_claim(claim("ns", "dp-gpu", "u-dp", [("gpu", DRIVER, NODE, f"gpu-{minor0}")]))
        apiserver.add_claim(claim("ns", "replaced", "u-new", [("gpu", DRIVER, NODE, good)]))
        opaque = {"driver": DRIVER, "parameters": {"sharing": "TimeSlicing"}}
        config = [{"source": "FromClaim", "requests": ["gpu"], "opaque": opaque}]
        apiserver.add_claim(
            claim("ns", "config", "u-cfg", [("gpu", DRIVER, NODE, good)], config=config)
        )
        response = await watcher.aprepare(
            reg,
            [
                ("ns", "pending", "u-pending"),
                ("ns", "elsewhere", "u-else"),
                ("ns", "dp-gpu", "u-dp"),
                ("ns", "replaced", "u-old"),
                ("ns", "missing", "u-missing"),
                ("ns", "config", "u-cfg"),
                ("ns", "ok", "u-ok"),
            ],
        )
        errors = {uid: r.error for uid, r in response.claims.items()}
        assert "not allocated" in errors["u-pending"]
        assert "pool 'other'" in errors["u-else"]
        assert "not served by DRA on this node" in errors["u-dp"]
        assert "replaced" in errors["u-old"]
        assert "404" in errors["u-missing"]
        assert "opaque configuration" in errors["u-cfg"]
        assert errors["u-ok"] == ""
        assert response.claims["u-ok"].devices[0].device_name == good
        assert run.dra.stats.prepare_errors == 6


async def test_a_restart_mid_claim_loses_nothing(
    dra_agent: DraAgent, apiserver: FakeApiServer, dirs: Dirs, watcher: FakePluginWatcher
) -> None:
    """Prepared, agent restarted, claim deleted from the API server: the new agent still answers
    a repeated prepare and unprepares (removing the spec) without the claim."""
    async with dra_agent() as run:
        reg = await serving(watcher, apiserver)
        name = device_of(apiserver, gpu_of(run, 2).uuid)["name"]
        apiserver.add_claim(claim("ns", "job", "u-1", [("gpu", DRIVER, NODE, name)]))
        first = await watcher.aprepare(reg, [("ns", "job", "u-1")])
        assert first.claims["u-1"].error == ""
        generation = apiserver.generation()
    spec_path = dirs.cdi / f"k8s.{DRIVER}-claim_u-1.json"
    assert spec_path.exists()
    del apiserver.claims[("ns", "job")]
    writes = len(apiserver.writes)
    async with dra_agent() as run:
        reg = await registered(watcher)
        again = await watcher.aprepare(reg, [("ns", "job", "u-1")])
        assert again.claims["u-1"].error == ""
        assert list(again.claims["u-1"].devices[0].cdi_device_ids) == list(
            first.claims["u-1"].devices[0].cdi_device_ids
        )
        done = await watcher.aunprepare(reg, [("ns", "job", "u-1")])
        assert done.claims["u-1"].error == ""
        assert not spec_path.exists()
        # The restarted agent found its slices as it left them: no new generation, no write.
        await eventually(lambda: run.dra.publisher.up, what="synced")
        assert apiserver.generation() == generation
        assert len(apiserver.writes) == writes


async def test_unreachable_api_server_leaves_the_device_plugin_working(
    dra_agent: DraAgent,
    fake_kubelet: FakeKubelet,
    apiserver: FakeApiServer,
    watcher: FakePluginWatcher,
) -> None:
    await apiserver.stop()  # down before the agent starts (the port stays in the kubeconfig)
    with structlog.testing.capture_logs() as logs:
        async with dra_agent() as run:
            (dp,) = await asyncio.to_thread(fake_kubelet.wait_for_registrations, 1, T)
            assert len((await asyncio.to_thread(dp.next_update, T)).devices) == 2
            await registered(watcher)
            await eventually(
                lambda: run.dra.publisher.failures >= 3,
                what="retries",
            )
            # The unreachable API server is said once, not once per retry.
            assert [e["log_level"] for e in logs if e["event"].startswith("resource slices not")][
                :3
            ] == ["warning", "debug", "debug"]
            status, body = await run.get("/readyz")
            assert status == 503
            # GPUs 2 and 3 left the device plugin and are in no slice: offered through neither API.
            assert body.startswith(
                "DRA: GPUs 2, 3 offered through neither API: ResourceSlices not published: "
                "API server"
            )
            _, metrics = await run.get("/metrics")
            assert "gpuagent_dra_api_up 0" in metrics
            assert "gpuagent_dra_unpublished_gpus 2" in metrics
            assert "gpuagent_kubelet_registered 1" in metrics

            # A claim cannot be read meanwhile: a clear per-claim error, and the agent stays up.
            reg = watcher.registrations[-1]
            response = await watcher.aprepare(reg, [("ns", "job", "u-1")])
            assert "reading claim ns/job" in response.claims["u-1"].error

            await apiserver.start()  # back, same port
            await eventually(
                lambda: len(apiserver.devices()) == 2, what="published after the outage"
            )
            await eventually(lambda: run.agent.readiness() is None, what="ready")
            status, _ = await run.get("/readyz")
            assert status == 200
            _, metrics = await run.get("/metrics")
            assert "gpuagent_dra_api_up 1" in metrics
            assert "gpuagent_dra_unpublished_gpus 0" in metrics
            assert apiserver.invalid == []

            # Down again: the slices stay in the API server and their GPUs offered; no GPU named.
            await apiserver.stop()
            await run.fault({"gpu": 2, "fault": "xid", "xid": 79})  # a change to publish: a taint
            await eventually(lambda: "API server" in (run.agent.readiness() or ""), what="retrying")
            status, body = await run.get("/readyz")
            assert (status, body.split(":")[:2]) == (503, ["DRA", " ResourceSlices not published"])
            _, metrics = await run.get("/metrics")
            assert "gpuagent_dra_unpublished_gpus 0" in metrics


async def test_both_health_apis_send_every_device_of_the_pool(
    dra_agent: DraAgent, apiserver: FakeApiServer, watcher: FakePluginWatcher, dra_stubs: DraStubs
) -> None:
    """The kubelet reads ``v1`` or ``v1alpha1`` DRAResourceHealth, whichever it knows: the same
    full list from both, in each API's own messages."""
    async with dra_agent() as run:
        reg = await serving(watcher, apiserver)
        names = {device_of(apiserver, gpu_of(run, i).uuid)["name"] for i in (2, 3)}
        for alpha, api in ((False, dra_stubs.health), (True, dra_stubs.health_alpha)):
            stream = watcher.watch_health(reg, alpha=alpha)
            try:
                first = await asyncio.to_thread(next, stream)
            finally:
                stream.close()
            assert type(first).DESCRIPTOR.full_name == (
                f"{'v1alpha1' if alpha else 'v1'}.NodeWatchResourcesResponse"
            )
            assert {(d.device.pool_name, d.device.device_name) for d in first.devices} == {
                (NODE, name) for name in names
            }
            assert {d.health for d in first.devices} == {api.HEALTHY}
            assert {d.health_check_timeout_seconds for d in first.devices} == {
                DraConfig(DRIVER, NODE).health_timeout_s
            }
            assert all(d.last_updated_time > 0 and d.message == "" for d in first.devices)


async def test_paced_as_in_production_a_fault_is_in_the_slice_at_once_and_so_is_an_outage(
    dirs: Dirs,
    device_plugin_dir: Path,
    fake_kubelet: FakeKubelet,
    apiserver: FakeApiServer,
    watcher: FakePluginWatcher,
) -> None:
    """The publisher paced as in production (30 s windows) by a clock the test moves: a fault
    5 s after the slices were written taints its device 0.2 s later; with the API server gone,
    the next fault's write fails as soon, and /readyz and /metrics say so at once."""
    clock = ManualClock()
    options = {**FAST_DRA, "coalescing": Coalescing(), "backoff": Backoff(), "clock": clock}
    agent_options = {"node_name": NODE, "dra_options": options}
    args = dirs.args(apiserver)
    async with running_agent(device_plugin_dir, args, agent_options=agent_options) as run:
        publisher, store = run.dra.publisher, run.agent.store

        async def settle(seconds: float = 0.0) -> None:
            await settle_writer(clock, publisher, store, seconds)

        async def fail(gpu: int) -> None:
            """XID 48 on ``gpu``, in the store whole: the driver's two events (the XID, then
            the recovery action it sets) before the clock moves, so they go out together."""
            await run.fault({"gpu": gpu, "fault": "xid", "xid": 48})

            def whole() -> bool:
                kinds = {c.kind for c in gpu_of(run, gpu).health.conditions}
                return kinds >= {"xid", "recovery_action"}

            await eventually(whole, what="unhealthy, with its recovery action")

        await registered(watcher)
        await eventually(lambda: store.snapshot.registered, what="registered with the kubelet")
        await settle(0.2)  # the first publication
        await eventually(lambda: run.agent.readiness() is None, what="ready")
        assert len(apiserver.devices()) == 2
        await settle(5.0)
        await fail(2)
        await settle(1.0)
        taints = device_of(apiserver, gpu_of(run, 2).uuid)["taints"]
        assert f"{DRIVER}/xid" in [t["key"] for t in taints]
        _, metrics = await run.get("/metrics")
        assert "gpuagent_dra_api_up 1" in metrics

        await settle(5.0)
        await apiserver.stop()
        await fail(3)
        await settle(1.0)
        status, body = await run.get("/readyz")
        assert status == 503
        assert body.startswith("DRA: ResourceSlices not published: API server unreachable: ")
        _, metrics = await run.get("/metrics")
        assert "gpuagent_dra_api_up 0" in metrics


async def test_a_fault_taints_the_device_in_its_slice_and_recovery_clears_it(
    dra_agent: DraAgent, apiserver: FakeApiServer, watcher: FakePluginWatcher, dra_stubs: DraStubs
) -> None:
    async with dra_agent() as run:
        reg = await serving(watcher, apiserver)
        uuid = gpu_of(run, 2).uuid
        generation = apiserver.generation()
        health = watcher.watch_health(reg)
        first = await asyncio.to_thread(next, health)
        assert {d.health for d in first.devices} == {dra_stubs.health.HEALTHY}

        status, _ = await run.fault({"gpu": 2, "fault": "xid", "xid": 79})
        assert status == 200
        # XID 79 (fallen off the bus): the simulated driver also asks for a GPU reset, as a real
        # one does, so the device gets the XID's NoSchedule and the reset's NoExecute.
        await eventually(
            lambda: len(device_of(apiserver, uuid).get("taints", [])) == 2, what="taints"
        )
        taints = {
            (t["key"], t.get("value", ""), t["effect"])
            for t in device_of(apiserver, uuid)["taints"]
        }
        assert taints == {
            (f"{DRIVER}/xid", "", "NoSchedule"),  # one per cause: the next XID changes nothing
            (f"{DRIVER}/recovery-action", "gpu_reset", "NoExecute"),
        }
        assert apiserver.generation() > generation
        assert "taints" not in device_of(apiserver, gpu_of(run, 3).uuid)

        # The kubelet's health stream says so too (full list per message). The stream sends every
        # change: a probe may read the reset request before the XID event is taken from the
        # driver, so the first unhealthy message can name the reset alone. Wait for the message
        # with the state the slice has now (the stream resends at least every 0.2 s).
        def reasons(message: Any) -> set[str]:
            return {
                reason
                for d in message.devices
                if d.health == dra_stubs.health.UNHEALTHY
                for reason in d.message.split(", ")
            }

        def current() -> Any:
            deadline = time.monotonic() + T
            for message in health:
                if reasons(message) == {"xid 79", "recovery_action gpu_reset"}:
                    return message
                if time.monotonic() > deadline:
                    raise AssertionError(f"the health stream still says {reasons(message)}")
            raise AssertionError("the health stream ended")

        try:
            message = await asyncio.to_thread(current)
        finally:
            health.close()
        assert len(message.devices) == 2
        (bad,) = [d for d in message.devices if d.health == dra_stubs.health.UNHEALTHY]
        assert bad.device.device_name == device_of(apiserver, uuid)["name"]

        await run.fault({"gpu": 2, "fault": "recover"})
        await eventually(lambda: "taints" not in device_of(apiserver, uuid), what="taints cleared")
        assert apiserver.invalid == []


MIG_NODE = """\
version: v1
gpus:
  - name: H100
  - name: H100
    mig: [3g.40gb, 1g.10gb]
"""


async def test_mig_devices_are_published_and_prepared_with_their_caps(
    device_plugin_dir: Path, apiserver: FakeApiServer, dirs: Dirs, watcher: FakePluginWatcher
) -> None:
    node = dirs.root / "node.yaml"
    node.write_text(MIG_NODE)
    args = (
        "--sim-config", str(node), "--mig-strategy", "mixed", "--dra-gpus", "1",
        "--kubeconfig", str(apiserver.kubeconfig(dirs.root / "kubeconfig")),
        "--plugins-dir", str(dirs.plugins), "--plugins-registry-dir", str(dirs.registry),
        "--cdi-spec-dir", str(dirs.cdi),
    )  # fmt: skip
    options = {"node_name": NODE, "dra_options": FAST_DRA}
    async with running_agent(device_plugin_dir, args, agent_options=options) as run:
        reg = await registered(watcher)
        await eventually(lambda: len(apiserver.devices()) == 2, what="two MIG devices published")
        assert apiserver.invalid == []
        gpu = run.agent.store.snapshot.gpu(1)
        assert gpu is not None
        profiles = {d["attributes"]["profile"]["string"]: d for d in apiserver.devices().values()}
        assert set(profiles) == {"3g.40gb", "1g.10gb"}
        small = profiles["1g.10gb"]
        assert small["attributes"]["type"] == {"string": "mig"}
        assert small["attributes"]["parentUUID"] == {"string": gpu.uuid}
        (mig,) = [m for m in gpu.mig_devices if m.profile == "1g.10gb"]
        assert small["attributes"]["uuid"] == {"string": mig.uuid}
        # Each MIG device's claim names the GPU's node and the device's own GPU-instance and
        # compute-instance capability nodes, from the simulated node's own mig-minors (the
        # host's is not read), so two claims on one GPU differ.
        sim = run.agent.simulator
        assert sim is not None
        minors = parse_mig_minors((sim.proc_root / "driver/nvidia-caps/mig-minors").read_text())
        specs = []
        for profile, uid in (("1g.10gb", "u-small"), ("3g.40gb", "u-large")):
            device = profiles[profile]
            apiserver.add_claim(claim("ns", uid, uid, [("mig", DRIVER, NODE, device["name"])]))
            response = await watcher.aprepare(reg, [("ns", uid, uid)])
            assert response.claims[uid].error == ""
            spec = json.loads((dirs.cdi / f"k8s.{DRIVER}-claim_{uid}.json").read_text())
            cdi_validator().validate(spec)
            (mig,) = [m for m in gpu.mig_devices if m.profile == profile]
            where = f"gpu{gpu.minor}/gi{mig.gpu_instance_id}"
            caps = (
                minors[f"{where}/access"],
                minors[f"{where}/ci{mig.compute_instance_id}/access"],
            )
            nodes = [n["path"] for n in spec["devices"][0]["containerEdits"]["deviceNodes"]]
            assert nodes == [
                f"/dev/nvidia{gpu.minor}",
                *(f"/dev/nvidia-caps/nvidia-cap{c}" for c in caps),
            ]
            specs.append(spec["devices"][0]["containerEdits"])
        assert specs[0] != specs[1]


def cdi_validator() -> Any:
    """The CDI project's JSON schema (tests/data/cdi-schema), as the node spec's tests use it."""
    schema_dir = Path(__file__).resolve().parents[1] / "data" / "cdi-schema"
    schema = json.loads((schema_dir / "schema.json").read_text())
    defs = json.loads((schema_dir / "defs.json").read_text())
    registry: Registry[Any] = Registry().with_resource("defs.json", DRAFT7.create_resource(defs))
    return jsonschema.Draft7Validator(schema, registry=registry)
