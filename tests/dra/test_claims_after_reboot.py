"""Claims prepared before a reboot, a driver reload or a MIG device destroyed behind the agent's
back, prepared again by the kubelet: end to end through the kubelet's DRA calls (grpcio) and the
API server stand-in, on simulated H100s. A fresh simulated driver is a reboot: a boot of its own
(``/proc/sys/kernel/random/boot_id`` under its proc root), its MIG devices gone, MIG mode off.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from e2e.agentrun import RunningAgent, running_agent
from support.clock import Sleeps
from support.fake_apiserver import FakeApiServer, claim
from support.fake_plugin_watcher import FakePluginWatcher
from support.simnvml import nvml_on

from dra.test_dra_flow import DRIVER, FAST_DRA, NODE, Dirs, registered
from dra.test_dynamic_mig import (
    SMALL,
    Kubelet,
    dynamic_agent,
    h100,
    published,
    sim_instances,
    spec_of,
)
from gpuagent.domain.devices import MigDevice
from gpuagent.domain.migshapes import Placement
from gpuagent.gpu import migmake
from gpuagent.gpu.nvml import Nvml
from gpuagent.gpu.sim import SimDriver, node_from_mapping

DETAILED = "--detailed-agent-metrics"
FIRST_SLICE = "gpu-0-mig-1g10gb-19-0"  # clear of SMALL (slice 6)
OVER_SMALL = "gpu-0-mig-1g20gb-15-6"  # a 1g.20gb over slices 6-7: SMALL's placement and the next


def checkpoint(dirs: Dirs) -> dict[str, Any]:
    return dirs.checkpoint()


def made_at(run: RunningAgent, start: int) -> MigDevice:
    gpu = run.agent.store.snapshot.gpu(0)
    assert gpu is not None
    (found,) = [
        m for m in gpu.mig_devices if m.placement is not None and m.placement.start == start
    ]
    return found


async def again(kubelet: Kubelet, *names: str) -> Any:
    """The kubelet asks again for claims it had prepared (after a restart, a reboot)."""
    return await kubelet.watcher.aprepare(kubelet.reg, [("ns", n, f"u-{n}") for n in names])


async def prepared_small(
    sim: SimDriver, dirs: Dirs, device_plugin_dir: Path, apiserver: FakeApiServer,
    watcher: FakePluginWatcher,
) -> tuple[list[str], MigDevice]:  # fmt: skip
    """Claim ``small`` prepared on ``sim`` by an agent that then stops: its CDI IDs and MIG
    device."""
    async with dynamic_agent(sim, dirs, device_plugin_dir, apiserver) as run:
        kubelet = await published(watcher, apiserver)
        first = await kubelet.prepare(small=SMALL)
        assert first.claims["u-small"].error == ""
        return list(first.claims["u-small"].devices[0].cdi_device_ids), made_at(run, 6)


async def test_after_a_reboot_a_claims_mig_device_is_made_again_at_its_placement(
    device_plugin_dir: Path, apiserver: FakeApiServer, dirs: Dirs, watcher: FakePluginWatcher
) -> None:
    first_boot = h100(Sleeps())
    ids, before = await prepared_small(first_boot, dirs, device_plugin_dir, apiserver, watcher)
    written = checkpoint(dirs)
    rebooted = h100(Sleeps())
    async with dynamic_agent(rebooted, dirs, device_plugin_dir, apiserver, DETAILED) as run:
        kubelet = await published(watcher, apiserver)
        assert await sim_instances(run) == []
        # A new claim first: it takes the driver's next MIG UUID.
        assert (await kubelet.prepare(first=FIRST_SLICE)).claims["u-first"].error == ""
        result = (await again(kubelet, "small")).claims["u-small"]
        assert result.error == ""
        assert list(result.devices[0].cdi_device_ids) == ids
        # Made again where the claim was allocated, a new MIG device.
        assert await sim_instances(run) == [(19, 0, 1), (19, 6, 1)]
        after = made_at(run, 6)
        assert after.uuid != before.uuid
        # The CDI spec and the checkpoint name the new one, made in this boot.
        spec = spec_of(dirs, "u-small")
        nodes = [n["path"] for n in spec["devices"][0]["containerEdits"]["deviceNodes"]]
        assert nodes == ["/dev/nvidia0", *after.device_nodes]
        assert len(after.device_nodes) == 2
        entry = checkpoint(dirs)["claims"]["u-small"]["devices"][0]
        assert entry["uuid"] == after.uuid
        assert entry["mig"] == {
            "gpu": run.uuids[0], "profileId": 19, "start": 6,
            "gpuInstance": after.gpu_instance_id, "boot": rebooted.boot_id,
        }  # fmt: skip
        assert checkpoint(dirs)["bootId"] == rebooted.boot_id
        # (As the first boot had recorded its own.)
        assert written["bootId"] == first_boot.boot_id
        assert written["claims"]["u-small"]["devices"][0]["mig"]["boot"] == first_boot.boot_id
        metrics = (await run.get("/metrics"))[1]
        assert 'gpuagent_dra_gone_devices_total{result="prepared_again"} 1' in metrics
        # Asked again in the same boot: kept as it is.
        assert (await again(kubelet, "small")).claims["u-small"].error == ""
        assert await sim_instances(run) == [(19, 0, 1), (19, 6, 1)]
        assert made_at(run, 6).uuid == after.uuid
        # And unprepared as any claim: destroyed.
        done = await kubelet.unprepare("small", "first")
        assert all(r.error == "" for r in done.claims.values())
        assert await sim_instances(run) == []
        assert apiserver.invalid == []


async def test_after_a_reboot_a_claim_whose_placement_is_taken_is_refused(
    device_plugin_dir: Path, apiserver: FakeApiServer, dirs: Dirs, watcher: FakePluginWatcher
) -> None:
    await prepared_small(h100(Sleeps()), dirs, device_plugin_dir, apiserver, watcher)
    async with dynamic_agent(h100(Sleeps()), dirs, device_plugin_dir, apiserver, DETAILED) as run:
        kubelet = await published(watcher, apiserver)
        assert OVER_SMALL in apiserver.devices()
        assert (await kubelet.prepare(over=OVER_SMALL)).claims["u-over"].error == ""
        result = (await again(kubelet, "small")).claims["u-small"]
        assert SMALL in result.error
        assert "placement is taken by GPU instance" in result.error
        assert "profile 15 at memory slice 6" in result.error
        assert list(result.devices) == []
        # Nothing made for it; the other claim's instance untouched.
        assert await sim_instances(run) == [(15, 6, 2)]
        metrics = (await run.get("/metrics"))[1]
        assert 'gpuagent_dra_gone_devices_total{result="refused"} 1' in metrics
        # The claim's checkpoint entry stays as it was: unprepared, nothing of others destroyed.
        assert checkpoint(dirs)["claims"]["u-small"]["devices"][0]["mig"]["start"] == 6
        done = await kubelet.unprepare("small")
        assert done.claims["u-small"].error == ""
        assert await sim_instances(run) == [(15, 6, 2)]


def destroy_every_instance(sim: SimDriver) -> None:
    """Destroy GPU 0's MIG devices behind the agent's back (an operator, a driver reload)."""
    with nvml_on(sim):
        nvml = Nvml(mig_shapes=True)
        described = nvml.describe(0)
        assert described.mig_partitions is not None
        handle = nvml.mig_handle(0)
        shapes = described.mig_partitions.shapes
        for instance in migmake.instances(0, handle, nvml.calls, shapes):
            migmake.destroy_instance(0, handle, nvml.calls, instance.gpu_instance_id)


async def test_a_mig_device_destroyed_in_the_same_boot_is_made_again(
    device_plugin_dir: Path, apiserver: FakeApiServer, dirs: Dirs, watcher: FakePluginWatcher
) -> None:
    """The boot alone does not tell: the instance is checked against the driver."""
    sim = h100(Sleeps())
    ids, _ = await prepared_small(sim, dirs, device_plugin_dir, apiserver, watcher)
    destroy_every_instance(sim)
    async with dynamic_agent(sim, dirs, device_plugin_dir, apiserver) as run:
        kubelet = await published(watcher, apiserver)
        assert await sim_instances(run) == []
        result = (await again(kubelet, "small")).claims["u-small"]
        assert result.error == ""
        assert list(result.devices[0].cdi_device_ids) == ids
        assert await sim_instances(run) == [(19, 6, 1)]
        after = made_at(run, 6)
        assert after.placement == Placement(6, 1)
        entry = checkpoint(dirs)["claims"]["u-small"]["devices"][0]
        assert entry["uuid"] == after.uuid
        assert entry["mig"]["boot"] == sim.boot_id


STATIC_MIG = {"version": "v1", "gpus": [{"name": "H100", "mig": ["3g.40gb", "1g.10gb"]}]}


@pytest.mark.parametrize("mig_after", [["3g.40gb"], []], ids=["other-layout", "mig-off"])
async def test_a_static_mig_claim_whose_device_vanished_is_refused(
    device_plugin_dir: Path,
    apiserver: FakeApiServer,
    dirs: Dirs,
    watcher: FakePluginWatcher,
    mig_after: list[str],
) -> None:
    """MIG devices the operator made (``--mig-strategy mixed``, not made on demand): one gone
    after a reboot (MIG reconfigured without it, or MIG mode off) refuses its claim."""
    args = (*dirs.args(apiserver, dra_gpus="all"), "--mig-strategy", "mixed")
    options = {"node_name": NODE, "dra_options": FAST_DRA}

    def agent(sim: SimDriver) -> Any:
        return running_agent(device_plugin_dir, args, agent_options=options, simulator=sim)

    async with agent(SimDriver(node_from_mapping(STATIC_MIG))) as run:
        reg = await registered(watcher)
        gpu = run.agent.store.snapshot.gpu(0)
        assert gpu is not None
        (small,) = [m for m in gpu.mig_devices if m.profile == "1g.10gb"]
        (name,) = [
            n
            for n, d in apiserver.devices().items()
            if d["attributes"]["uuid"]["string"] == small.uuid
        ]
        apiserver.add_claim(claim("ns", "m", "u-m", [("mig", DRIVER, NODE, name)]))
        assert (await watcher.aprepare(reg, [("ns", "m", "u-m")])).claims["u-m"].error == ""
    rebooted = {"version": "v1", "gpus": [{"name": "H100", "mig": mig_after}]}
    async with agent(SimDriver(node_from_mapping(rebooted))):
        reg = await registered(watcher)
        result = (await watcher.aprepare(reg, [("ns", "m", "u-m")])).claims["u-m"]
        assert f"device {name}: its MIG device {small.uuid} is gone" in result.error
        assert list(result.devices) == []
