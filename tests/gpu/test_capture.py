"""``scripts/nvml-capture`` (``scripts/nvml_capture.py``) and ``capture: FILE``: a capture of a
node becomes a simulated node.

``tests/data/captures/`` holds one capture of a real node (``real-1xh200.json``: an H200 in a VM,
driver 580.159.04) and one of the simulator (``simulated-2xh100.json``);
:func:`test_differences_from_the_builtin_profile` states, per capture, how its driver answers
differently from the simulator's built-in profiles.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, cast

import pynvml
import pytest
from support.clock import FakeClock
from support.simnvml import nvml_on
from support.waiting import eventually

from gpuagent.gpu.monitor import GpuMonitor
from gpuagent.gpu.nvml import Nvml
from gpuagent.gpu.sim import SimDriver, installed, load_sim_config, node_from_mapping
from gpuagent.gpu.sim.capture import load_capture
from gpuagent.gpu.sim.host import SimHost
from gpuagent.gpu.sim.spec import SimConfigError
from gpuagent.gpu.sim.state import SUPPORTED_EVENTS
from gpuagent.state.store import DeviceStore

ROOT = Path(__file__).resolve().parents[2]
CAPTURES = ROOT / "tests/data/captures"
SIMULATED = CAPTURES / "simulated-2xh100.json"
SCRIPT = ROOT / "scripts/nvml_capture.py"
LAUNCHER = ROOT / "scripts/nvml-capture"


def test_a_capture_becomes_a_node(tmp_path: Path) -> None:
    """``capture:`` gives the captured driver, GPUs, MIG layout and latencies."""
    config = tmp_path / "node.yaml"
    config.write_text(f"version: v1\ncapture: {SIMULATED}\n")
    node = load_sim_config(config)
    assert node.driver_version == "580.95.05"
    assert [g.name for g in node.gpus] == ["NVIDIA H100 80GB HBM3"] * 2
    # NVML gives no NUMA node on an x86 board; the capture read the host's sysfs.
    assert [g.numa_node for g in node.gpus] == [0, 1]
    assert not node.numa_from_nvml
    assert node.host == SimHost(product_name=None, numa=True)
    assert [g.pci_class for g in node.gpus] == ["0x030200"] * 2
    assert sorted(node.gpus[0].mig) == ["1g.10gb", "2g.20gb", "3g.40gb"]
    assert node.gpus[1].mig == ()
    assert node.supported_events == SUPPORTED_EVENTS
    assert node.absent_calls == frozenset({"nvmlDeviceGetNumaNodeId"})
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
    """The script itself as an operator runs it (the launcher, ``-o`` relative to where it is
    run), on the simulator: a capture the simulator loads again."""
    out = tmp_path / "capture.json"
    done = subprocess.run(
        [str(LAUNCHER), "--simulate", "2", "--repeat", "2", "-o", out.name],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=tmp_path,
        env={**os.environ, "PYTHON": sys.executable},
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


def answers(capture: dict[str, Any]) -> dict[str, int]:
    """Every answer (return code) a capture records, by what was asked: calls with their
    arguments, field values with their scope, NVLink states, event types, MIG memory reads."""
    found: dict[str, int] = {}
    for record in capture["system"]["calls"]:
        found[f"{record['call']}{record['args']}"] = record["return"]
    for gpu in capture["gpus"]:
        i = gpu["index"]
        for record in gpu["calls"]:
            if record["call"] != "nvmlDeviceGetHandleByIndex":  # its value is a pointer
                found[f"gpu{i} {record['call']}{record['args']}"] = record["return"]
        for slot in gpu["fields"]:
            found[f"gpu{i} field {slot['field']} scope {slot['scope']}"] = slot["return"]
        for link in gpu["nvlinks"]:
            found[f"gpu{i} nvmlDeviceGetNvLinkState({link['link']})"] = link["return"]
        found[f"gpu{i} supported event types"] = gpu["events"]["supported"]
    for mode, section in capture["mig"].items():
        for i, gpu in section.get("gpus", {}).items():
            found[f"gpu{i} memory {mode}"] = gpu["memory_return"]
    return found


def builtin_capture(capture: Path, tmp_path: Path) -> dict[str, Any]:
    """The script's capture of the built-in profiles laid out as ``capture``'s GPUs are."""
    captured = load_capture(capture)
    layout = [{"name": g.name, "mig": list(g.mig)} for g in captured.gpus]
    config = tmp_path / "builtin.yaml"
    config.write_text(json.dumps({"version": "v1", "gpus": layout, "cap_sys_admin": True}))
    out = tmp_path / "builtin.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--sim-config", str(config), "--repeat", "1", "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return cast("dict[str, Any]", json.loads(out.read_text()))


@pytest.mark.parametrize("capture", sorted(CAPTURES.glob("*.json")), ids=lambda p: p.stem)
def test_differences_from_the_builtin_profile(capture: Path, tmp_path: Path) -> None:
    """What a captured driver answers differently from the simulator's built-in profiles.

    The script captures the built-in profiles laid out as the capture's GPUs are; every answer
    both captures hold is compared. For the simulated capture: nothing (latency aside). A real
    capture states its differences, ``captured answer, built-in answer``, in :data:`EXPECTED`.
    """
    captured = answers(json.loads(capture.read_text()))
    builtin = answers(builtin_capture(capture, tmp_path))
    differences = {
        asked: (code, builtin[asked])
        for asked, code in captured.items()
        if asked in builtin and builtin[asked] != code
    }
    assert differences == EXPECTED[capture.stem]
    assert (
        load_capture(capture).gpus[0].memory_mib
        == node_from_mapping(
            {"version": "v1", "gpus": [{"name": load_capture(capture).gpus[0].name}]}
        )
        .gpus[0]
        .memory_mib
    )


NOT_SUPPORTED, SUCCESS = 3, 0
#: Per capture: what its driver answered differently from the built-in profiles (NVML return
#: codes, or the event mask), ``(captured, built-in)``.
EXPECTED: dict[str, dict[str, tuple[int, int]]] = {
    "simulated-2xh100": {},
    # One H200 in a Firecracker VM (driver 580.159.04): the built-in H200 is an HGX board's, with
    # 18 NVLinks (none active unless nvlinks: says so); the VM's driver shows none, so every
    # NVLink field and call answers NOT_SUPPORTED there ("nvlink: false" in a --sim-config).
    "real-1xh200": {
        "gpu0 field 138 scope 4294967295": (NOT_SUPPORTED, SUCCESS),
        "gpu0 field 139 scope 4294967295": (NOT_SUPPORTED, SUCCESS),
        "gpu0 field 91 scope 0": (NOT_SUPPORTED, SUCCESS),
        **{f"gpu0 field 165 scope {link}": (NOT_SUPPORTED, SUCCESS) for link in range(18)},
        "gpu0 nvmlDeviceGetNvLinkState(0)": (NOT_SUPPORTED, SUCCESS),
    },
}


def test_a_replayed_gpu_rests_at_its_captured_readings() -> None:
    """The real H200 replayed: what the capture read, held still; the energy counter grows at
    the captured power; a process moves utilisation and memory (values from the capture file)."""
    node = load_capture(CAPTURES / "real-1xh200.json")
    clock = FakeClock()
    with nvml_on(SimDriver(node, clock=clock)) as driver:
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        assert pynvml.nvmlDeviceGetUUID(handle) == "GPU-478fc258-4291-405e-5b75-97335f24df1f"
        assert pynvml.nvmlDeviceGetPowerUsage(handle) == 76925
        assert pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM) == 345
        assert pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_MEM) == 3201
        assert pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU) == 38
        util = pynvml.nvmlDeviceGetUtilizationRates(handle)
        assert (util.gpu, util.memory) == (0, 0)
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
        assert (memory.used, memory.reserved) == (0, 644939776)
        energy = pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
        clock.now += 10.0
        assert pynvml.nvmlDeviceGetTotalEnergyConsumption(handle) == energy + 769250
        assert pynvml.nvmlDeviceGetPowerUsage(handle) == 76925  # still at rest
        driver.add_process(0, 7, 1024, 40)
        assert pynvml.nvmlDeviceGetUtilizationRates(handle).gpu == 40
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
        assert memory.used == 1024 * 1024 * 1024
