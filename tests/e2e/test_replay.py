"""A replayed node reads as the captured node: the real H200 (``tests/data/captures/``) replayed
with ``--sim-config``'s ``capture:`` against what NVIDIA's GPU feature discovery and the agent
wrote on that node (``../shared/reference/real-h200/``, copied into ``tests/data/real-h200/`` so
these tests run wherever the clone does; the copies are checked against the reference where it
is beside the clone).

At rest the replay reads what the capture recorded (expected values are computed here from the
capture file, in DCGM's units); simulated processes and faults move it as on any simulated GPU;
what the driver did not offer there (NVLink) is absent from the replay too.
"""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from e2e.agentrun import RunningAgent, running_agent

ROOT = Path(__file__).resolve().parents[2]
CAPTURE = ROOT / "tests/data/captures/real-1xh200.json"
COPIES = ROOT / "tests/data/real-h200"
REFERENCE = ROOT.parent / "shared/reference/real-h200"
MIB = 1024 * 1024
TIMESTAMP = "nvidia.com/gfd.timestamp"


def dcgm_values(text: str) -> dict[str, float]:
    """Each ``DCGM_FI_*`` family's value (the replay has one GPU and no pods: one series)."""
    return {
        line.split("{", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("DCGM_FI_")
    }


def reference_families() -> set[str]:
    text = (COPIES / "agent-metrics.txt").read_text()
    return {line.split("{", 1)[0].split(" ", 1)[0] for line in text.splitlines()
            if line.startswith("DCGM_FI_")}  # fmt: skip


def captured() -> dict[str, Any]:
    gpu: dict[str, Any] = json.loads(CAPTURE.read_text())["gpus"][0]
    return gpu


def call(gpu: dict[str, Any], name: str, args: list[object] | None = None) -> Any:
    return next(c["value"] for c in gpu["calls"] if c["call"] == name and c["args"] == (args or []))


def at_rest() -> dict[str, float]:
    """What the capture read, as the agent reports it (dcgm-exporter's names and units)."""
    gpu = captured()
    memory = call(gpu, "nvmlDeviceGetMemoryInfo_v2")
    util = call(gpu, "nvmlDeviceGetUtilizationRates")
    memory_temp = next(
        f["value"] for f in gpu["fields"] if f["field"] == 82
    )  # NVML_FI_DEV_MEMORY_TEMP
    gpm = {m["metric"]: m["value"] for m in gpu["gpm"]["pairs"][-1]["metrics"]}  # 1000 ms apart
    return {
        "DCGM_FI_DEV_SM_CLOCK": call(gpu, "nvmlDeviceGetClockInfo", [1]),
        "DCGM_FI_DEV_MEM_CLOCK": call(gpu, "nvmlDeviceGetClockInfo", [2]),
        "DCGM_FI_DEV_GPU_TEMP": call(gpu, "nvmlDeviceGetTemperature", [0]),
        "DCGM_FI_DEV_MEMORY_TEMP": memory_temp,
        "DCGM_FI_DEV_POWER_USAGE": call(gpu, "nvmlDeviceGetPowerUsage") / 1000,
        "DCGM_FI_DEV_GPU_UTIL": util["gpu"],
        "DCGM_FI_DEV_MEM_COPY_UTIL": util["memory"],
        "DCGM_FI_DEV_ENC_UTIL": call(gpu, "nvmlDeviceGetEncoderUtilization")[0],
        "DCGM_FI_DEV_DEC_UTIL": call(gpu, "nvmlDeviceGetDecoderUtilization")[0],
        "DCGM_FI_DEV_FB_USED": memory["used"] // MIB,
        "DCGM_FI_DEV_FB_RESERVED": memory["reserved"] // MIB,
        "DCGM_FI_DEV_FB_FREE": memory["free"] // MIB,
        "DCGM_FI_DEV_PCIE_REPLAY_COUNTER": call(gpu, "nvmlDeviceGetPcieReplayCounter"),
        "DCGM_FI_PROF_GR_ENGINE_ACTIVE": gpm[1] / 100,
        "DCGM_FI_PROF_SM_ACTIVE": gpm[2] / 100,
        "DCGM_FI_PROF_SM_OCCUPANCY": gpm[3] / 100,
        "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE": gpm[5] / 100,
        "DCGM_FI_PROF_DRAM_ACTIVE": gpm[10] / 100,
        "DCGM_FI_PROF_PCIE_TX_BYTES": gpm[20] * MIB,
        "DCGM_FI_PROF_PCIE_RX_BYTES": gpm[21] * MIB,
    }


@pytest.fixture
async def replay(
    device_plugin_dir: Path, short_tmp_path: Path
) -> AsyncIterator[tuple[RunningAgent, Path]]:
    """The agent on the replayed H200, without a kubelet, writing its node-label file; once its
    GPM readings (two samples apart) are on /metrics."""
    config = short_tmp_path / "node.yaml"
    config.write_text(f"version: v1\ncapture: {CAPTURE}\n")
    labels = short_tmp_path / "features.d" / "gpuagent"
    args = (
        "--sim-config", str(config), "--kubernetes=false", "--node-labels-file", str(labels),
        "--detailed-agent-metrics",  # as the agent ran on the real node (agent-metrics.txt)
    )  # fmt: skip
    async with running_agent(device_plugin_dir, args) as run:
        await run.metrics_until(lambda text: "DCGM_FI_PROF_SM_ACTIVE{" in text)
        yield run, labels


async def test_labels_are_gfds_on_the_captured_node(replay: tuple[RunningAgent, Path]) -> None:
    run, labels = replay
    await run.metrics_until(lambda _: labels.exists())
    gfd = [line for line in (COPIES / "gfd-labels.txt").read_text().splitlines()
           if line and not line.startswith(TIMESTAMP)]  # fmt: skip
    assert sorted(labels.read_text().splitlines()) == sorted(gfd)
    assert "nvidia.com/gpu.mode=compute" in gfd  # the capture's PCI class: a 3D controller
    assert "nvidia.com/gpu.machine=unknown" in gfd  # no DMI product name in that VM


async def test_families_are_the_real_agents_and_values_the_captured(
    replay: tuple[RunningAgent, Path],
) -> None:
    run, _ = replay
    _, text = await run.get("/metrics")
    values = dcgm_values(text)
    # No family the real node lacked (none of NVLink's), and none missing.
    assert set(values) == reference_families()
    for name, expected in at_rest().items():
        assert math.isclose(values[name], expected, rel_tol=1e-9, abs_tol=1e-12), name
    captured_energy = call(captured(), "nvmlDeviceGetTotalEnergyConsumption")
    assert values["DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"] >= captured_energy  # it only grows
    assert values["DCGM_FI_DEV_XID_ERRORS"] == 0


async def test_processes_and_faults_move_a_replay(replay: tuple[RunningAgent, Path]) -> None:
    """A process's memory and SM use show on the replayed GPU and go with it; an XID counts."""
    run, _ = replay
    run.sim.add_process(0, 4242, 20480, 99)
    text = await run.metrics_until(lambda t: dcgm_values(t).get("DCGM_FI_DEV_GPU_UTIL") == 99)
    assert dcgm_values(text)["DCGM_FI_DEV_FB_USED"] == 20480
    run.sim.remove_process(4242)
    text = await run.metrics_until(lambda t: dcgm_values(t).get("DCGM_FI_DEV_FB_USED") == 0)
    assert dcgm_values(text)["DCGM_FI_DEV_GPU_UTIL"] == 0
    status, _ = await run.fault({"gpu": 0, "fault": "xid", "xid": 43})
    assert status == 200
    await run.metrics_until(lambda t: dcgm_values(t).get("DCGM_FI_DEV_XID_ERRORS") == 43)


@pytest.mark.skipif(not REFERENCE.is_dir(), reason="../shared/reference is not beside the clone")
@pytest.mark.parametrize("name", sorted(p.name for p in COPIES.iterdir()))
def test_the_copies_are_the_reference(name: str) -> None:
    assert (COPIES / name).read_bytes() == (REFERENCE / name).read_bytes()


@pytest.mark.skipif(not REFERENCE.is_dir(), reason="../shared/reference is not beside the clone")
def test_the_capture_is_the_reference_with_host_facts() -> None:
    """The fixture is the reference capture plus the keys its ``added`` key names."""
    fixture = json.loads(CAPTURE.read_text())
    reference = json.loads((REFERENCE / "capture-h200.json").read_text())
    added = fixture.pop("added")
    assert added["keys"] == [
        "host.dmi_product_name",
        "gpus[0].pci_class",
        "gpus[0].sysfs_numa_node",
    ]
    del fixture["host"]["dmi_product_name"]
    del fixture["gpus"][0]["pci_class"]
    del fixture["gpus"][0]["sysfs_numa_node"]
    assert json.dumps(fixture, sort_keys=True) == json.dumps(reference, sort_keys=True)
