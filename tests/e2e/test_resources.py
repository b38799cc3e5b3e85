"""Several resources from one agent: MIG mixed strategy, every device-list strategy end to end."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import grpc
from support.fake_kubelet import FakeKubelet
from support.waiting import eventually

from e2e.agentrun import registered_agent, running_agent
from gpuagent.nodefiles.cdi import SPEC_FILE_NAME

T = 10.0
NODE = """\
version: v1
gpus:
  - name: H100
    mig: [3g.40gb, 3g.40gb]
  - name: H100
    mig: [1g.10gb, 1g.10gb, 1g.10gb]
  - name: H100
"""


async def test_mig_mixed_registers_one_resource_per_profile_and_survives_restart(
    fake_kubelet: FakeKubelet, device_plugin_dir: Path, short_tmp_path: Path
) -> None:
    node = short_tmp_path / "node.yaml"
    node.write_text(NODE)
    cdi_dir = short_tmp_path / "cdi"
    args = ("--sim-config", str(node), "--mig-strategy", "mixed",
            "--device-list-strategy", "cdi-cri", "--cdi-spec-dir", str(cdi_dir))  # fmt: skip
    async with running_agent(device_plugin_dir, args) as run:
        regs = await asyncio.to_thread(fake_kubelet.wait_for_registrations, 3, T)
        by_name = {r.resource_name: r for r in regs}
        assert set(by_name) == {
            "nvidia.com/gpu",
            "nvidia.com/mig-3g.40gb",
            "nvidia.com/mig-1g.10gb",
        }
        assert len({r.endpoint for r in regs}) == 3
        full = await asyncio.to_thread(by_name["nvidia.com/gpu"].next_update, T)
        assert [d.ID for d in full.devices] == [run.uuids[2]]
        small = await asyncio.to_thread(by_name["nvidia.com/mig-1g.10gb"].next_update, T)
        assert len(small.devices) == 3
        assert all(d.ID.startswith("MIG-") for d in small.devices)

        chosen = small.devices[0].ID
        response = await asyncio.to_thread(
            fake_kubelet.allocate, [chosen], resource="nvidia.com/mig-1g.10gb"
        )
        (container,) = response.container_responses
        assert [c.name for c in container.cdi_devices] == [
            f"k8s.device-plugin.nvidia.com/gpu={chosen}"
        ]
        assert dict(container.envs) == {}
        # The node's CDI spec gives each MIG device the GPU's node and its own two capability
        # nodes (the simulated node's mig-minors): the three 1g.10gb of GPU 1 differ.
        spec = json.loads((cdi_dir / SPEC_FILE_NAME).read_text())
        edits = {d["name"]: d["containerEdits"]["deviceNodes"] for d in spec["devices"]}
        nodes = [[n["path"] for n in edits[d.ID]] for d in small.devices]
        assert all(len(n) == 3 and n[0] == "/dev/nvidia1" for n in nodes), nodes
        assert all(p.startswith("/dev/nvidia-caps/nvidia-cap") for n in nodes for p in n[1:])
        assert len({tuple(n) for n in nodes}) == 3
        # A MIG ID is unknown to the full-GPU resource.
        code, _ = await asyncio.to_thread(
            fake_kubelet.allocate_error, [chosen], resource="nvidia.com/gpu"
        )
        assert code == grpc.StatusCode.INVALID_ARGUMENT

        await asyncio.to_thread(fake_kubelet.restart)
        regs = await asyncio.to_thread(fake_kubelet.wait_for_registrations, 6, T)
        assert {r.resource_name for r in regs[3:]} == set(by_name)
        await run.ready()


async def test_volume_mounts_and_device_specs(
    fake_kubelet: FakeKubelet, device_plugin_dir: Path
) -> None:
    args = ("--simulate", "2", "--device-list-strategy", "volume-mounts",
            "--pass-device-specs")  # fmt: skip
    async with registered_agent(fake_kubelet, device_plugin_dir, args) as run:
        uuid = run.uuids[1]
        response = await asyncio.to_thread(fake_kubelet.allocate, [uuid])
        (container,) = response.container_responses
        assert dict(container.envs) == {
            "NVIDIA_VISIBLE_DEVICES": "/var/run/nvidia-container-devices"
        }
        assert [(m.container_path, m.host_path) for m in container.mounts] == [
            (f"/var/run/nvidia-container-devices/{uuid}", "/dev/null")
        ]
        assert "/dev/nvidia1" in [d.container_path for d in container.devices]
        assert all(d.permissions == "rw" for d in container.devices)


async def test_cdi_annotations(fake_kubelet: FakeKubelet, device_plugin_dir: Path) -> None:
    args = ("--simulate", "2", "--device-list-strategy", "cdi-annotations")
    async with registered_agent(fake_kubelet, device_plugin_dir, args) as run:
        uuids = run.uuids
        response = await asyncio.to_thread(fake_kubelet.allocate, uuids)
        (container,) = response.container_responses
        ((key, value),) = dict(container.annotations).items()
        assert key.startswith("cdi.k8s.io/nvidia-device-plugin_")
        assert value == ",".join(f"k8s.device-plugin.nvidia.com/gpu={u}" for u in uuids)


async def test_cdi_spec_and_node_labels_are_written(
    fake_kubelet: FakeKubelet, device_plugin_dir: Path, short_tmp_path: Path
) -> None:
    cdi_dir = short_tmp_path / "cdi"
    labels = short_tmp_path / "features.d" / "gpuagent"
    args = ("--simulate", "2", "--device-list-strategy", "cdi-cri",
            "--cdi-spec-dir", str(cdi_dir), "--node-labels-file", str(labels))  # fmt: skip
    async with registered_agent(fake_kubelet, device_plugin_dir, args) as run:
        spec_file = cdi_dir / "k8s.device-plugin.nvidia.com-gpu.json"
        await eventually(
            lambda: spec_file.exists() and labels.exists(), what="the CDI spec and the labels"
        )
        spec = json.loads(spec_file.read_text())
        names = {d["name"] for d in spec["devices"]}
        uuids = set(run.uuids)
        assert uuids | {"0", "1", "all"} <= names
        lines = dict(line.split("=", 1) for line in labels.read_text().splitlines())
        assert lines["nvidia.com/gpu.count"] == "2"
        assert lines["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"
        # What the kubelet hands the runtime resolves in the spec.
        uuid = sorted(uuids)[0]
        response = await asyncio.to_thread(fake_kubelet.allocate, [uuid])
        (name,) = [c.name for c in response.container_responses[0].cdi_devices]
        assert name.split("=", 1)[1] in names


async def test_time_slicing_replicas(fake_kubelet: FakeKubelet, device_plugin_dir: Path) -> None:
    sharing = (
        '{"timeSlicing": {"renameByDefault": true,'
        ' "resources": [{"name": "nvidia.com/gpu", "replicas": 3}]}}'
    )
    args = ("--simulate", "2", "--sharing", sharing)
    async with registered_agent(fake_kubelet, device_plugin_dir, args) as run:
        reg = fake_kubelet.latest()
        assert reg.resource_name == "nvidia.com/gpu.shared"
        first = await asyncio.to_thread(reg.next_update, T)
        uuids = run.uuids
        assert sorted(d.ID for d in first.devices) == sorted(
            f"{u}::{n}" for u in uuids for n in range(3)
        )
        response = await asyncio.to_thread(
            fake_kubelet.allocate, [f"{uuids[0]}::1"], resource="nvidia.com/gpu.shared"
        )
        assert dict(response.container_responses[0].envs) == {"NVIDIA_VISIBLE_DEVICES": uuids[0]}
