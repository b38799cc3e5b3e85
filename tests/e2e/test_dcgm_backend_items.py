"""What dashboards read from the NVML backend, end to end on the simulated driver.

- MIG: each GPU instance's series carries its own framebuffer (``DCGM_FI_DEV_FB_*``) and
  profiling ratios (``DCGM_FI_PROF_*``, GPM per instance), as DCGM serves them and as NVIDIA
  recommends ``DCGM_FI_PROF_GR_ENGINE_ACTIVE`` for MIG.
- Per-call fallbacks: where the driver does not offer field values, the values that have a call
  of their own (``nvmlDeviceGetRemappedRows``, ``nvmlDeviceGetPcieReplayCounter``) are still
  exported, so e.g. ``DCGM_FI_DEV_ROW_REMAP_FAILURE`` and its alert do not vanish silently.

(These were strict expected failures until the NVML backend brought them: issue 12.)
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from e2e.agentrun import running_agent

MIG_NODE = """\
version: v1
gpus:
  - name: H100
    mig: [3g.40gb, 2g.20gb, 1g.10gb]
  - name: H100
"""
# The simulated H100's instance sizes (MiB), as nvidia-smi mig -lgip shows them.
INSTANCE_MIB = {"3g.40gb": 40448, "2g.20gb": 20096, "1g.10gb": 9984}


def series(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    # The parser names a counter's samples <name>_total (dcgm-exporter's counters have none).
    return [
        (dict(s.labels), s.value)
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name in (name, f"{name}_total")
    ]


def profiled(text: str) -> bool:
    """Whether every profiling ratio is in (GPM needs two samples): one per MIG instance of GPU 0,
    one for the whole of GPU 1."""
    wanted = {("0", profile) for profile in INSTANCE_MIB} | {("1", None)}
    return all(
        wanted <= {(labels["gpu"], labels.get("GPU_I_PROFILE")) for labels, _ in series(text, name)}
        for name in ("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE")
    )


async def mig_metrics(device_plugin_dir: Path, short_tmp_path: Path) -> str:
    node = short_tmp_path / "node.yaml"
    node.write_text(MIG_NODE)
    async with running_agent(device_plugin_dir, ("--sim-config", str(node))) as run:
        return await run.metrics_until(profiled)


@pytest.mark.asyncio(loop_factories=["asyncio"])
async def test_each_mig_instance_has_its_own_framebuffer(
    device_plugin_dir: Path, short_tmp_path: Path
) -> None:
    text = await mig_metrics(device_plugin_dir, short_tmp_path)
    per_instance: dict[str, dict[str, float]] = defaultdict(dict)
    for name in ("DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE"):
        for labels, value in series(text, name):
            if labels["gpu"] == "0":
                per_instance[labels["GPU_I_PROFILE"]][name] = value
    assert set(per_instance) == set(INSTANCE_MIB)
    for profile, values in per_instance.items():
        total = values["DCGM_FI_DEV_FB_USED"] + values["DCGM_FI_DEV_FB_FREE"]
        assert 0.9 * INSTANCE_MIB[profile] <= total <= INSTANCE_MIB[profile], (profile, values)


@pytest.mark.asyncio(loop_factories=["asyncio"])
async def test_each_mig_instance_has_its_own_profiling_ratios(
    device_plugin_dir: Path, short_tmp_path: Path
) -> None:
    text = await mig_metrics(device_plugin_dir, short_tmp_path)
    for name in ("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE"):
        profiles = {
            labels["GPU_I_PROFILE"]
            for labels, value in series(text, name)
            if labels["gpu"] == "0" and 0 <= value <= 1
        }
        assert profiles == set(INSTANCE_MIB), name


@pytest.mark.asyncio(loop_factories=["asyncio"])
async def test_a_full_gpu_beside_mig_ones_keeps_every_family(
    device_plugin_dir: Path, short_tmp_path: Path
) -> None:
    """GPU 1 is not in MIG mode: its one series has the framebuffer and the profiling ratios."""
    text = await mig_metrics(device_plugin_dir, short_tmp_path)
    for name in ("DCGM_FI_DEV_FB_USED", "DCGM_FI_PROF_GR_ENGINE_ACTIVE", "DCGM_FI_DEV_GPU_UTIL"):
        ((labels, _),) = [(lab, v) for lab, v in series(text, name) if lab["gpu"] == "1"]
        assert "GPU_I_ID" not in labels


@pytest.mark.asyncio(loop_factories=["asyncio"])
async def test_values_with_a_call_of_their_own_survive_without_field_values(
    device_plugin_dir: Path,
) -> None:
    async with running_agent(device_plugin_dir, ("--simulate", "2")) as run:
        status, _ = await run.fault(
            {"gpu": 0, "fault": "not_supported", "symbol": "nvmlDeviceGetFieldValues"}
        )
        assert status == 200
        await run.polls(3)  # polls that ran without field values
        _, text = await run.get("/metrics")
        for name in ("DCGM_FI_DEV_ROW_REMAP_FAILURE", "DCGM_FI_DEV_PCIE_REPLAY_COUNTER"):
            gpus = {labels["gpu"] for labels, _ in series(text, name)}
            assert gpus == {"0", "1"}, name
