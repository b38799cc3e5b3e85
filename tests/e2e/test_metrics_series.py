"""A plain 8-GPU node's default /metrics page fits a fleet: at most 300 series (issues 24, 30).

A plain node: 8 simulated H100s on NVLink (every reading the simulator offers, the NVLink rate
and the GPM ratios included), per-container accounting on, no pods, no API server. Counts, not
timings: ``scripts/bench --only-series`` reports the same page's series and bytes.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from e2e.agentrun import running_agent

PLAIN_NODE_TARGET = 300
GPUS = 8


def series(text: str) -> Counter[str]:
    """Series per metric name (a histogram's buckets, sum and count apart)."""
    return Counter(
        line.split("{")[0].split(" ")[0]
        for line in text.splitlines()
        if line and not line.startswith("#")
    )


def complete(text: str) -> bool:
    """Every GPU's rates and ratios are in (two probes each), and an earlier scrape was timed."""
    found = series(text)
    return (
        found["DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL"] == GPUS
        and found["DCGM_FI_PROF_GR_ENGINE_ACTIVE"] == GPUS
        and found["gpuagent_scrape_duration_seconds_count"] == 1
    )


async def test_a_plain_8_gpu_page_is_at_most_300_series(device_plugin_dir: Path) -> None:
    args = ("--simulate", str(GPUS), "--container-accounting=true")
    async with running_agent(device_plugin_dir, args) as run:
        plain = series(await run.metrics_until(complete))
    async with running_agent(device_plugin_dir, (*args, "--detailed-agent-metrics")) as run:
        detailed = series(await run.metrics_until(complete))
    listing = "\n".join(f"{n:4} {name}" for name, n in sorted(plain.items()))
    assert plain.total() <= PLAIN_NODE_TARGET, listing
    # What the default leaves to --detailed-agent-metrics: the two SM ratios dcgm-exporter ships
    # off, and the agent's activity counters and breakdowns.
    assert detailed["DCGM_FI_PROF_SM_ACTIVE"] == detailed["DCGM_FI_PROF_SM_OCCUPANCY"] == GPUS
    assert plain["DCGM_FI_PROF_SM_ACTIVE"] == plain["DCGM_FI_PROF_SM_OCCUPANCY"] == 0
    assert detailed.total() > plain.total() + 2 * GPUS
