"""``scripts/gpu-check`` without a GPU: its report from the real H200's files, its arguments,
its refusal on a machine without a driver, and its steps end to end on the simulator.

The real H200's files are ``tests/data/real-h200/`` (copies of ``../shared/reference/real-h200``)
and ``tests/data/captures/real-1xh200.json``; what the report must say is computed here from them.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"
REAL = ROOT / "tests/data/real-h200"
CAPTURE = ROOT / "tests/data/captures/real-1xh200.json"


def load(name: str) -> ModuleType:
    sys.path.insert(0, str(SCRIPTS))
    try:
        spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
        assert spec is not None
        assert spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(SCRIPTS))


check = load("gpu_check")
report_of = load("gpu_check_report")


@pytest.fixture
def real_node(tmp_path: Path) -> Path:
    """An output directory as gpu-check leaves it on the real H200 (its reference files)."""
    out = tmp_path / "out"
    out.mkdir()
    for name in ("agent-labels.txt", "gfd-labels.txt", "agent-metrics.txt", "samples.csv"):
        shutil.copy(REAL / name, out / name)
    shutil.copy(CAPTURE, out / "capture.json")
    (out / "contract.txt").write_text("......\n6 passed in 3.21s\n")
    steps = {name: {"rc": 0, "seconds": 1.0, "note": ""}
             for name in ("driver", "capture", "contract", "agent", "gfd")}  # fmt: skip
    (out / "steps.json").write_text(json.dumps(steps))
    return out


def probe_ms(metrics: str) -> float:
    total = re.search(
        r'^gpuagent_nvml_call_duration_seconds_sum\{call="probe"\} (\S+)$', metrics, re.M
    )
    count = re.search(
        r'^gpuagent_nvml_call_duration_seconds_count\{call="probe"\} (\S+)$', metrics, re.M
    )
    assert total is not None
    assert count is not None
    return 1000 * float(total[1]) / float(count[1])


def test_the_real_nodes_report(real_node: Path) -> None:
    text, agreed = report_of.report(real_node)
    labels = [line for line in (REAL / "gfd-labels.txt").read_text().splitlines() if line]
    assert f"{len(labels)} of {len(labels)} labels identical" in text
    assert "Within one sample, the agent agrees with nvidia-smi" in text
    assert "The real-driver cases pass: `6 passed in 3.21s`" in text
    ms = probe_ms((REAL / "agent-metrics.txt").read_text())
    assert f"A GPU's poll took {ms:.2f} ms of NVML time" in text
    assert "Calls answering NOT_SUPPORTED: nvmlDeviceGetNumaNodeId." in text
    assert "| 0 | NVIDIA H200 | 143771 | 00000000:00:06.0 | 0x030200 | None / -1 |" in text
    assert "Read-only: nothing on the GPU was changed" in text
    assert agreed


def test_a_label_that_differs_is_named(real_node: Path) -> None:
    gfd = real_node / "gfd-labels.txt"
    gfd.write_text(gfd.read_text().replace("gpu.mode=compute", "gpu.mode=graphics"))
    text, agreed = report_of.report(real_node)
    assert "- GFD only: `nvidia.com/gpu.mode=graphics`" in text
    assert "- agent only: `nvidia.com/gpu.mode=compute`" in text
    assert not agreed


def test_readings_that_disagree(real_node: Path) -> None:
    """nvidia-smi's power read 1 kW over the agent's throughout: a disagreement."""
    samples = real_node / "samples.csv"
    lines = samples.read_text().splitlines()
    column = lines[0].split(",").index("smi_power.draw")
    shifted = [lines[0]]
    for line in lines[1:]:
        cells = line.split(",")
        cells[column] = str(float(cells[column]) + 1000)
        shifted.append(",".join(cells))
    samples.write_text("\n".join(shifted) + "\n")
    text, agreed = report_of.report(real_node)
    assert "| 0 | DCGM_FI_DEV_POWER_USAGE | power.draw | 0 of 75 |" in text
    assert "the agent does not agree with nvidia-smi" in text
    assert not agreed


def test_failing_contract_tests_are_said(real_node: Path) -> None:
    (real_node / "contract.txt").write_text("F.....\n1 failed, 5 passed in 3.2s\n")
    steps = json.loads((real_node / "steps.json").read_text())
    steps["contract"]["rc"] = 1
    (real_node / "steps.json").write_text(json.dumps(steps))
    text, agreed = report_of.report(real_node)
    assert "do not all pass (see `contract.txt`): `1 failed, 5 passed in 3.2s`" in text
    assert not agreed


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--samples", "0"], "--samples must be from 1 to 3600"),
        (["--simulate", "0"], "--simulate must be from 1 to 64"),
        (["--gfd", "/nonexistent/gfd"], "not an executable file"),
        (["--colour"], "unrecognized arguments"),
    ],
)
def test_bad_arguments(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        check.main([*argv, "-o", str(tmp_path / "out")])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_used_output_directory_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "old-report.md").write_text("x")
    with pytest.raises(SystemExit) as exited:
        check.main(["-o", str(tmp_path)])
    assert exited.value.code == 2
    assert "not empty" in capsys.readouterr().err


def test_without_a_driver_nothing_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """No libnvidia-ml here: exit 3, the reason said, and nothing started (no capture)."""
    if check.driver_problem() is None:
        pytest.skip("this machine has a working NVIDIA driver")
    out = tmp_path / "out"
    assert check.main(["-o", str(out)]) == 3
    assert "no usable NVIDIA driver here" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["report.md", "steps.json"]
    assert "No usable NVIDIA driver" in (out / "report.md").read_text()


FAKE_SMI = """#!/bin/sh
# nvidia-smi --query-gpu=index,... --format=csv,noheader,nounits, for one GPU
echo "0, 12, 7, 300.5, 1500, 2619, 1024, 45, 51"
"""


def test_every_step_on_the_simulator(tmp_path: Path) -> None:
    """``--simulate``: capture, the agent sampled beside an nvidia-smi (a stand-in answering
    fixed readings, which the simulator's do not equal), labels, the report."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text(FAKE_SMI)
    (bin_dir / "nvidia-smi").chmod(0o755)
    out = tmp_path / "out"
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(
        [sys.executable, str(SCRIPTS / "gpu_check.py"), "--simulate", "1", "--samples", "2",
         "-o", str(out)],
        capture_output=True, text=True, timeout=180, check=False, env=env,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr  # the stand-in's readings are not the agent's
    steps = json.loads((out / "steps.json").read_text())
    assert [steps[s]["rc"] for s in ("driver", "capture", "contract", "agent", "gfd")] == [
        0, 0, None, 0, None,
    ]  # fmt: skip
    rows = (out / "samples.csv").read_text().splitlines()
    assert len(rows) == 3
    assert rows[1].endswith(",300.5,1500,2619,1024,45,51")
    assert "nvidia.com/gpu.count=1" in (out / "agent-labels.txt").read_text()
    report = (out / "report.md").read_text()
    assert "| 0 | DCGM_FI_DEV_POWER_USAGE | power.draw |" in report
    assert json.loads((out / "capture.json").read_text())["source"] == "simulator"
