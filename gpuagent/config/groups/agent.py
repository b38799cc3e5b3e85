"""The agent's own options: the config file, logging, the Kubernetes switch and --check-config."""

from __future__ import annotations

from gpuagent.config.option import Option
from gpuagent.config.values import choice, parse_bool, parse_path

CONFIG = Option(
    "config",
    parse_path,
    "versioned YAML config file",
    "FILE",
    aliases=("--config-file",),
    env_aliases=("CONFIG_FILE",),
    in_file=False,
    default=None,
)

LOG_FORMATS = ("json", "console")
LOG_LEVELS = ("debug", "info", "warning", "error")

LOG_FORMAT = Option(
    "log-format",
    choice(LOG_FORMATS),
    "json or console (default console on a TTY, else json; console is in colour only on a TTY)",
    "FORMAT",
    default="json",
)
LOG_LEVEL = Option(
    "log-level",
    choice(LOG_LEVELS, fold_case=True),
    "debug, info, warning or error (default info)",
    "LEVEL",
    default="info",
)
KUBERNETES = Option(
    "kubernetes",
    parse_bool,
    "false: no kubelet registration and no pod-resources client, only metrics, health and node "
    "labels (a Docker host, bare metal); ready once the GPUs are discovered (default true)",
    is_bool=True,
    default=True,
)
CHECK_CONFIG = Option(
    "check-config",
    parse_path,
    "parse and validate FILE as the config file (with the flags and environment), print the "
    "effective settings and exit: 0 when valid, 2 when not; starts nothing",
    "FILE",
    in_file=False,
    default=None,
)
