"""``report.md`` of ``scripts/gpu-check``, from the files its steps left in the output directory.

Pure reading and arithmetic over those files (``steps.json``, ``capture.json``, ``contract.txt``,
``samples.csv``, ``agent-metrics.txt``, ``agent-labels.txt``, ``gfd-labels.txt``): each missing
file leaves its section saying so. The checks it judges:

* readings: each agent value in ``samples.csv`` lies within nvidia-smi's over one sample either
  side (the row before, the same and the one after: the two read a moving value at different
  moments), give or take the pair's tolerance (nvidia-smi rounds memory to 1 MiB; power is an
  average over a window of its own), on at least 90 % of the rows;
* labels: the agent's node-label file equals GPU feature discovery's, line for line (its time
  stamp aside);
* the contract tests: passed, none skipped.
"""

from __future__ import annotations

import csv
import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

__all__ = ["AGENT_COLUMNS", "SMI_QUERY", "metric_values", "report", "write_report"]

#: The agent's values sampled (dcgm-exporter's names, and its own health of the GPU).
AGENT_COLUMNS = (
    "DCGM_FI_DEV_GPU_UTIL",
    "DCGM_FI_DEV_MEM_COPY_UTIL",
    "DCGM_FI_DEV_POWER_USAGE",
    "DCGM_FI_DEV_SM_CLOCK",
    "DCGM_FI_DEV_MEM_CLOCK",
    "DCGM_FI_DEV_FB_USED",
    "DCGM_FI_DEV_GPU_TEMP",
    "DCGM_FI_DEV_MEMORY_TEMP",
    "DCGM_FI_PROF_GR_ENGINE_ACTIVE",
    "DCGM_FI_PROF_SM_ACTIVE",
    "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE",
    "DCGM_FI_PROF_DRAM_ACTIVE",
    "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
    "DCGM_FI_DEV_XID_ERRORS",
    "gpuagent_gpu_healthy",
)
#: ``nvidia-smi --query-gpu`` fields sampled beside them.
SMI_QUERY = (
    "utilization.gpu",
    "utilization.memory",
    "power.draw",
    "clocks.sm",
    "clocks.mem",
    "memory.used",
    "temperature.gpu",
    "temperature.memory",
)
#: (agent column, nvidia-smi field, tolerance): the readings both report. Tolerances: a clock
#: step (15 MHz), a degree, nvidia-smi's power average, memory rounded to MiB both ways.
PAIRS = (
    ("DCGM_FI_DEV_GPU_UTIL", "utilization.gpu", 0.0),
    ("DCGM_FI_DEV_MEM_COPY_UTIL", "utilization.memory", 0.0),
    ("DCGM_FI_DEV_POWER_USAGE", "power.draw", 0.5),
    ("DCGM_FI_DEV_SM_CLOCK", "clocks.sm", 15.0),
    ("DCGM_FI_DEV_MEM_CLOCK", "clocks.mem", 0.0),
    ("DCGM_FI_DEV_FB_USED", "memory.used", 2.0),
    ("DCGM_FI_DEV_GPU_TEMP", "temperature.gpu", 1.0),
    ("DCGM_FI_DEV_MEMORY_TEMP", "temperature.memory", 1.0),
)
#: The share of rows that must agree, per reading: a value that jumps (a kernel starting, a
#: short fault) can be caught by one and not by the other for a row or two.
AGREEING_SHARE = 0.9
TIMESTAMP = "nvidia.com/gfd.timestamp"
_SERIES = re.compile(r"^(\w+)\{(.*)\} (\S+)$")
_GPU = re.compile(r'(?:^|,)gpu="(\d+)"')


def metric_values(text: str) -> dict[str, dict[str, str]]:
    """The first series of each :data:`AGENT_COLUMNS` family, by GPU index (``gpu`` label)."""
    found: dict[str, dict[str, str]] = {}
    wanted = set(AGENT_COLUMNS)
    for line in text.splitlines():
        match = _SERIES.match(line)
        if match is None or match[1] not in wanted:
            continue
        gpu = _GPU.search(match[2])
        if gpu is not None:
            found.setdefault(gpu[1], {}).setdefault(match[1], match[3])
    return found


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None


def _json(path: Path) -> Any:
    text = _read(path)
    try:
        return None if text is None else json.loads(text)
    except ValueError:
        return None


def _number(text: str | None) -> float | None:
    try:
        return None if text in (None, "", "[N/A]", "N/A") else float(str(text))
    except ValueError:
        return None


def steps_section(steps: Mapping[str, Any] | None) -> list[str]:
    lines = ["## Steps", "", "| step | exit status | seconds | note |", "|---|---|---|---|"]
    for name, step in (steps or {}).items():
        rc = "not run" if step.get("rc") is None else step["rc"]
        lines.append(f"| {name} | {rc} | {step.get('seconds', '')} | {step.get('note', '')} |")
    return [*lines, ""]


def node_section(capture: Mapping[str, Any] | None) -> list[str]:
    """The node as ``capture.json`` saw it, and what its driver did not offer."""
    if not isinstance(capture, Mapping):
        return ["## The node", "", "No capture (`capture.json`): see the steps.", ""]
    driver, host = capture.get("driver", {}), capture.get("host", {})
    lines = [
        "## The node",
        "",
        f"Driver {driver.get('version')} (CUDA {driver.get('cuda_version')}, NVML "
        f"{driver.get('nvml_version')}), captured from {capture.get('source')} at "
        f"{capture.get('taken')}; DMI product name: {host.get('dmi_product_name')}.",
        "",
        "| GPU | name | memory (MiB) | PCI bus ID | PCI class | NUMA (NVML / sysfs) |",
        "|---|---|---|---|---|---|",
    ]
    absent: set[str] = set()
    slow: dict[str, float] = {}
    for gpu in capture.get("gpus", []):
        lines.append(
            f"| {gpu.get('index')} | {gpu.get('name')} | {gpu.get('memory_mib')} | "
            f"{gpu.get('pci_bus_id')} | {gpu.get('pci_class')} | "
            f"{gpu.get('numa_node')} / {gpu.get('sysfs_numa_node')} |"
        )
        for call in gpu.get("calls", []):
            if call.get("return") == 3:  # NOT_SUPPORTED
                absent.add(call["call"])
            slow[call["call"]] = max(slow.get(call["call"], 0.0), call.get("warm_ms") or 0.0)
    costly = sorted(((ms, c) for c, ms in slow.items() if ms >= 0.1), reverse=True)
    slowest = ", ".join(f"{c} {ms:.2f} ms" for ms, c in costly) or "none"
    lines += [
        "",
        f"Calls answering NOT_SUPPORTED: {', '.join(sorted(absent)) or 'none'}.",
        f"Calls taking 0.1 ms or more warm: {slowest}.",
        "",
    ]
    return lines


def contract_section(text: str | None, steps: Mapping[str, Any]) -> tuple[list[str], bool]:
    step = steps.get("contract", {})
    if step.get("rc") is None:
        return ["## Contract tests", "", f"Not run: {step.get('note', 'no record')}.", ""], True
    summary = (text or "").strip().splitlines()[-1:] or ["no output"]
    ok = step.get("rc") == 0 and "passed" in summary[0] and "skipped" not in summary[0]
    verdict = "pass" if ok else "do not all pass (see `contract.txt`)"
    return ["## Contract tests", "", f"The real-driver cases {verdict}: `{summary[0]}`.", ""], ok


def _rows(text: str | None) -> dict[str, list[dict[str, str]]]:
    """``samples.csv``'s rows by GPU (a file without a ``gpu`` column is GPU 0's)."""
    by_gpu: dict[str, list[dict[str, str]]] = {}
    for row in csv.DictReader((text or "").splitlines()):
        by_gpu.setdefault(row.get("gpu") or "0", []).append(row)
    return by_gpu


def _gap(rows: list[dict[str, str]], i: int, agent: str, smi: str) -> float | None:
    """How far the agent's value at row ``i`` lies outside nvidia-smi's over rows ``i-1`` to
    ``i+1`` (the two read a moving value at different moments); 0 within; None: not both read."""
    value = _number(rows[i].get(agent))
    near = [_number(rows[j].get(f"smi_{smi}")) for j in (i - 1, i, i + 1) if 0 <= j < len(rows)]
    seen = [v for v in near if v is not None]
    if value is None or _number(rows[i].get(f"smi_{smi}")) is None:
        return None
    return max(0.0, min(seen) - value, value - max(seen))


def readings_section(text: str | None) -> tuple[list[str], bool]:
    """Each reading both report: rows that agree within one sample, and the largest gap."""
    lines = ["## Readings beside nvidia-smi", ""]
    by_gpu = _rows(text)
    if not by_gpu:
        return [*lines, "No samples (`samples.csv`).", ""], False
    if not any(_number(r.get(f"smi_{smi}")) is not None
               for rows in by_gpu.values() for r in rows for _, smi, _ in PAIRS):  # fmt: skip
        return [*lines, "nvidia-smi gave no readings (is it on PATH?): nothing compared.", ""], True
    lines += [
        "| GPU | agent | nvidia-smi | rows agreeing | largest gap within one sample |",
        "|---|---|---|---|---|",
    ]
    agreed = True
    for gpu, rows in sorted(by_gpu.items()):
        for agent, smi, tolerance in PAIRS:
            gaps = [g for i in range(len(rows)) if (g := _gap(rows, i, agent, smi)) is not None]
            good = sum(gap <= tolerance for gap in gaps)
            agreed &= bool(gaps) and good >= AGREEING_SHARE * len(gaps)
            largest = max(gaps, default=0.0)
            lines.append(f"| {gpu} | {agent} | {smi} | {good} of {len(gaps)} | {largest:g} |")
    verdict = "agrees" if agreed else "does not agree"
    share = f"{AGREEING_SHARE:.0%}"
    summary = f"Within one sample, the agent {verdict} with nvidia-smi (on {share} of rows)."
    return [*lines, "", summary, ""], agreed


def _labels(text: str | None) -> set[str]:
    return {
        line.strip()
        for line in (text or "").splitlines()
        if line.strip() and not line.startswith(TIMESTAMP)
    }


def labels_section(agent: str | None, gfd: str | None) -> tuple[list[str], bool]:
    lines = ["## Node labels", ""]
    if agent is None:
        return [*lines, "The agent wrote no label file (`agent-labels.txt`).", ""], False
    ours = _labels(agent)
    if gfd is None:
        return [
            *lines,
            f"The agent's {len(ours)} labels (`agent-labels.txt`); no GPU "
            "feature discovery to compare (`--gfd`).",
            "",
        ], True
    theirs = _labels(gfd)
    same = ours & theirs
    lines.append(
        f"{len(same)} of {len(theirs | ours)} labels identical to GPU feature discovery's."
    )
    for line in sorted(theirs - ours):
        lines.append(f"- GFD only: `{line}`")
    for line in sorted(ours - theirs):
        lines.append(f"- agent only: `{line}`")
    return [*lines, ""], ours == theirs


def _summaries(text: str, family: str) -> dict[str, tuple[float, float]]:
    """``{call: (sum, count)}`` of a summary family's series labelled ``call``."""
    found: dict[str, list[float]] = {}
    for line in text.splitlines():
        match = _SERIES.match(line)
        if match is None or match[1] not in (f"{family}_sum", f"{family}_count"):
            continue
        call = re.search(r'call="([^"]*)"', match[2])
        if call is not None:
            slot = 0 if match[1].endswith("_sum") else 1
            found.setdefault(call[1], [0.0, 0.0])[slot] = float(match[3])
    return {call: (v[0], v[1]) for call, v in found.items()}


def nvml_section(text: str | None) -> list[str]:
    """NVML time a GPU poll costs (the probe), and the calls that cost most, from /metrics."""
    calls = _summaries(text or "", "gpuagent_nvml_call_duration_seconds")
    probe = calls.pop("probe", (0.0, 0.0))
    if not probe[1]:
        return ["## NVML time", "", "No probe timings in `agent-metrics.txt`.", ""]
    mean_ms = 1000 * probe[0] / probe[1]
    lines = [
        "## NVML time",
        "",
        f"A GPU's poll took {mean_ms:.2f} ms of NVML time (mean of {probe[1]:g} probes).",
        "",
        "| call | calls | mean ms |",
        "|---|---|---|",
    ]
    timed = [(s, c, n) for c, (s, n) in calls.items() if c.startswith("nvml") and n]
    ranked = sorted((t for t in timed if t[1] != "nvmlEventSetWait_v2"), reverse=True)
    for total, call, count in ranked[:8]:
        lines.append(f"| {call} | {count:g} | {1000 * total / count:.3f} |")
    return [*lines, ""]


def report(out: Path) -> tuple[str, bool]:
    """The report's markdown, and whether every check that ran agreed."""
    steps = _json(out / "steps.json") or {}
    lines = [
        "# gpu-check report",
        "",
        "Read-only: nothing on the GPU was changed (MIG mode, compute mode, clocks, power "
        "limit) and it was not reset.",
        "",
    ]
    lines += steps_section(steps)
    driver = steps.get("driver", {})
    if driver.get("rc"):
        lines += ["No usable NVIDIA driver: " + str(driver.get("note")) + ". Nothing else ran.", ""]
        return "\n".join(lines), False
    lines += node_section(_json(out / "capture.json"))
    parts = [
        contract_section(_read(out / "contract.txt"), steps),
        readings_section(_read(out / "samples.csv")),
        labels_section(_read(out / "agent-labels.txt"), _read(out / "gfd-labels.txt")),
    ]
    for section, _ in parts:
        lines += section
    lines += nvml_section(_read(out / "agent-metrics.txt"))
    lines += ["## Files", "", *_files(out), ""]
    return "\n".join(lines), all(ok for _, ok in parts)


def _files(out: Path) -> Iterable[str]:
    for path in sorted(out.iterdir()):
        if path.is_file() and path.name != "report.md":
            yield f"- `{path.name}` ({path.stat().st_size:,} bytes)"


def write_report(out: Path) -> bool:
    """Write ``report.md`` into ``out``; whether every check agreed."""
    text, agreed = report(out)
    (out / "report.md").write_text(text + "\n")
    return agreed
