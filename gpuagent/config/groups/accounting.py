"""Per-container GPU accounting's options: where processes' containers are found, and how
dcgm-exporter's series show them."""

from __future__ import annotations

from pathlib import Path

from gpuagent.config.option import Option
from gpuagent.config.values import parse_bool, parse_path

CONTAINER_ACCOUNTING = Option(
    "container-accounting",
    parse_bool,
    "per-container GPU accounting: the GPU's processes by container; needs the host's PID "
    "namespace (default true; the DaemonSet sets false unless the accounting component adds "
    "hostPID)",
    is_bool=True,
    default=True,
)
PROC_ROOT = Option(
    "proc-root",
    parse_path,
    "the /proc of the host's processes: PID/cgroup tells a GPU process's container, for "
    "per-container GPU accounting (default /proc)",
    "DIR",
    default=Path("/proc"),
)
CONTAINER_LOGS_DIR = Option(
    "container-logs-dir",
    parse_path,
    "the kubelet's container log links, whose names (<pod>_<namespace>_<container>-<id>.log) "
    "name the containers using GPUs; only the names are read (default /var/log/containers)",
    "DIR",
    default=Path("/var/log/containers"),
)
CRI_SOCKET = Option(
    "cri-socket",
    parse_path,
    "the container runtime's CRI socket, for the names of containers the log links do not name; "
    "optional (default containerd's or CRI-O's, whichever exists)",
    "PATH",
    default=None,
)
DCGM_SERIES_PER_CONTAINER = Option(
    "dcgm-series-per-container",
    parse_bool,
    "a GPU shared by several containers gets a copy of each dcgm-exporter series per "
    "container, with its pod labels; by default one series, with empty pod labels (default "
    "false)",
    is_bool=True,
    default=False,
)
DCGM_CONTAINER_SHARES = Option(
    "dcgm-container-shares",
    parse_bool,
    "the dcgm-exporter series of a shared GPU are per container and carry each container's own "
    "utilisation, memory and energy instead of the whole GPU's (implies "
    "--dcgm-series-per-container; default false)",
    env_aliases=("KUBERNETES_VIRTUAL_GPUS",),
    is_bool=True,
    default=False,
)
