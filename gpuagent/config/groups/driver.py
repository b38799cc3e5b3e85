"""The driver's options: where it is, simulated GPUs, start-up, polling and health checks."""

from __future__ import annotations

from pathlib import Path

from gpuagent.config.option import Option
from gpuagent.config.values import (
    parse_bool,
    parse_healthchecks,
    parse_nvml_timeout,
    parse_path,
    parse_poll_interval,
    parse_simulate,
)

SIMULATE = Option("simulate", parse_simulate, "run on N simulated GPUs (1-64)", "N", default=None)
SIM_CONFIG = Option(
    "sim-config", parse_path, "run on the simulated node described in FILE", "FILE", default=None
)
FAIL_ON_INIT_ERROR = Option(
    "fail-on-init-error",
    parse_bool,
    "exit when the driver is unusable; false: serve probes and metrics and wait (default true)",
    env_aliases=("FAIL_ON_INIT_ERROR",),
    is_bool=True,
    default=True,
)
NVIDIA_DRIVER_ROOT = Option(
    "nvidia-driver-root",
    parse_path,
    "root of the NVIDIA driver installation (default /)",
    "DIR",
    aliases=("--driver-root",),
    env_aliases=("NVIDIA_DRIVER_ROOT",),
    default=Path("/"),
)
DISABLE_HEALTHCHECKS = Option(
    "disable-healthchecks",
    parse_healthchecks,
    "XIDs to ignore, 'xids' or 'all' (comma list)",
    "LIST",
    env_aliases=("DP_DISABLE_HEALTHCHECKS",),
    live=True,
    default="",
)
ENABLE_HEALTHCHECKS = Option(
    "enable-healthchecks",
    parse_healthchecks,
    "XIDs to check even if disabled, or 'all' (comma list)",
    "LIST",
    env_aliases=("DP_ENABLE_HEALTHCHECKS",),
    live=True,
    default="",
)
POLL_INTERVAL = Option(
    "poll-interval",
    parse_poll_interval,
    "seconds between telemetry and liveness polls of each GPU (default 5)",
    "SECONDS",
    default=5.0,
)
NVML_TIMEOUT = Option(
    "nvml-timeout",
    parse_nvml_timeout,
    "time limit for NVML work at start-up, in seconds "
    "(default 10 plus 5 per GPU; each NVML call also has its own limit)",
    "SECONDS",
    default=None,
)
