"""``scripts/nvml-capture`` and ``capture: FILE``: a capture of a node becomes a simulated node.

No machine with an NVIDIA GPU was available: the committed capture
(``tests/data/captures/simulated-2xh100.json``) was taken from the simulator. A capture of a real
node goes beside it; :func:`test_differences_from_the_builtin_profile` then states, per capture,
how the real driver differs from the simulator's built-in profile.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.waiting import eventually

from gpuagent.gpu.monitor import GpuMonitor
from gpuagent.gpu.nvml import Nvml
from gpuagent.gpu.sim import SimDriver, installed, load_sim_config, node_from_mapping
from gpuagent.gpu.sim.capture import load_capture
from gpuagent.gpu.sim.spec import SimConfigError
from gpuagent.gpu.sim.state import SUPPORTED_EVENTS
from gpuagent.state.store import DeviceStore

ROOT = Path(__file__).resolve().parents[2]
CAPTURES = ROOT / "tests/data/captures"
SIMULATED = CAPTURES / "simulated-2xh100.json"
SCRIPT = ROOT / "scripts/nvml-capture"


def test_a_capture_becomes_a_node(tmp_path: Path) -> None:
    """``capture:`` gives the captured driver, GPUs, MIG layout and latencies."""
    config = tmp_path / "node.yaml"
    config.write_text(f"version: v1\ncapture: {SIMULATED}\n")
    node = load_sim_config(config)
    assert node.driver_version == "580.95.05"
    assert [g.name for g in node.gpus] == ["NVIDIA H100 80GB HBM3"] * 2
    assert [g.numa_node for g in node.gpus] == [0, 1]
    assert sorted(node.gpus[0].mig) == ["1g.10gb", "2g.20gb", "3g.40gb"]
    assert node.gpus[1].mig == ()
    assert node.supported_events == SUPPORTED_EVENTS
    assert node.absent_calls == frozenset()
    # Warm latencies as measured (positive), the capture's own; not the built-in defaults.
    assert node.latency.of("nvmlDeviceGetTemperature") > 0
    assert node.latency.cold_start_s >= 0


def test_keys_beside_a_capture_win(tmp_path: Path) -> None:
    """The config's own keys override what the capture says."""
    config = tmp_path / "node.yaml"
    config.write_text(
        "version: v1\ncapture: captures/simulated-2xh100.json\ndriver_version: 560.35.03\n"
        "gpus: [{}]\nlatency: {default_ms: 1}\n"
    )
    (tmp_path / "captures").mkdir()
    (tmp_path / "captures/simulated-2xh100.json").write_bytes(SIMULATED.read_bytes())
    node = load_sim_config(config)
    assert node.driver_version == "560.35.03"
    assert len(node.gpus) == 1
    assert node.latency.default_s == pytest.approx(0.001)


def test_not_a_capture(tmp_path: Path) -> None:
    path = tmp_path / "x.json"
    path.write_text(json.dumps({"format": "something else"}))
    with pytest.raises(SimConfigError) as caught:
        load_capture(path)
    assert caught.value.key == "capture"


async def test_the_capture_covers_every_call_the_agent_makes(tmp_path: Path) -> None:
    """Every driver entry point the agent's backend uses (start-up, events, probes with GPM) is
    one the capture script recorded, on the node it was taken from."""
    node = load_sim_config(CAPTURES / "simulated-2xh100.yaml")
    driver = SimDriver(node)
    store = DeviceStore()
    with installed(driver):
        monitor = GpuMonitor(store, Nvml(tmp_path), poll_interval=0.12, event_wait_ms=50)
        task = asyncio.create_task(monitor.run())
        try:
            await eventually(
                lambda: driver.calls["nvmlGpmMetricsGet"] and driver.calls["nvmlEventSetWait_v2"],
                what="GPM readings and an event wait",
            )
            driver.inject(1, "recovery_action", action="gpu_reset")
            await eventually(
                lambda: driver.calls["nvmlDeviceGetFieldValues"] > 20, what="21 field reads"
            )
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await monitor.close()
    captured = set(json.loads(SIMULATED.read_text())["simulator_symbols"])
    used = {symbol for symbol, count in driver.calls.items() if count}
    assert used - captured == set()


def test_script_runs_on_the_simulator(tmp_path: Path) -> None:
    """The script itself, on the simulator: a capture the simulator loads again."""
    out = tmp_path / "capture.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--simulate", "2", "--repeat", "2", "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    data = json.loads(out.read_text())
    assert data["format"] == "gpuagent-nvml-capture/1"
    assert data["source"] == "simulator"
    assert [p["apart_ms"] for p in data["gpus"][0]["gpm"]["pairs"]] == [0, 50, 120, 1000]
    # The driver refuses GPM pairs closer than 100 ms, and accepts the others.
    assert [p["return"] for p in data["gpus"][0]["gpm"]["pairs"]] == [2, 2, 0, 0]
    assert all(c["warm_ms"] >= 0 for c in data["gpus"][0]["calls"])
    node = load_capture(out)
    assert len(node.gpus) == 2


@pytest.mark.parametrize("capture", sorted(CAPTURES.glob("*.json")), ids=lambda p: p.stem)
def test_differences_from_the_builtin_profile(capture: Path) -> None:
    """What a captured driver does differently from the simulator's built-in profile.

    For the simulated capture: nothing but call latency. A real capture added here states its
    differences (absent calls and fields, event types, MIG privileges) as expectations of its own.
    """
    data = json.loads(capture.read_text())
    captured = load_capture(capture)
    layout = [{"name": g.name, "numa_node": g.numa_node, "mig": list(g.mig)} for g in captured.gpus]
    builtin = node_from_mapping({"version": "v1", "gpus": layout})
    assert [g.memory_mib for g in captured.gpus] == [g.memory_mib for g in builtin.gpus]
    assert captured.absent_calls == EXPECTED[capture.stem]["absent_calls"]
    assert captured.absent_fields == EXPECTED[capture.stem]["absent_fields"]
    assert captured.supported_events == EXPECTED[capture.stem]["supported_events"]
    without = data["mig"]["without_cap_sys_admin"]["gpus"]
    refused = {int(i) for i, g in without.items() if g["memory_return"] == 4}  # NO_PERMISSION
    assert refused == EXPECTED[capture.stem]["memory_refused_without_cap_sys_admin"]


EXPECTED: dict[str, dict[str, object]] = {
    "simulated-2xh100": {
        "absent_calls": frozenset(),
        "absent_fields": frozenset(),
        "supported_events": SUPPORTED_EVENTS,
        "memory_refused_without_cap_sys_admin": {0},  # the MIG GPU
    },
}
