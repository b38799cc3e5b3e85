"""MPS sharing's options: where the control daemons keep their files, and the compute mode."""

from __future__ import annotations

from pathlib import Path

from gpuagent.config.option import Option
from gpuagent.config.values import one_of, parse_absolute_path
from gpuagent.domain.mps import ComputeModeChoice

MPS_ROOT = Option(
    "mps-root",
    parse_absolute_path,
    "with MPS sharing: where each control daemon's pipe and log directories and the shared "
    "memory directory are made; the same path on the host and in the agent's container "
    "(default /run/nvidia/mps)",
    "DIR",
    env_aliases=("MPS_ROOT",),
    default=Path("/run/nvidia/mps"),
)
MPS_COMPUTE_MODE = Option(
    "mps-compute-mode",
    one_of(ComputeModeChoice),
    "with MPS sharing: exclusive-process sets each shared GPU to EXCLUSIVE_PROCESS while its "
    "daemon runs, as NVIDIA's plugin does; unchanged leaves the mode as it is "
    "(default exclusive-process)",
    "MODE",
    default=ComputeModeChoice.EXCLUSIVE_PROCESS,
)
