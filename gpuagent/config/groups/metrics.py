"""The HTTP server's options: its address, TLS and basic auth, and dcgm-exporter's host label."""

from __future__ import annotations

from gpuagent.config.option import Option
from gpuagent.config.values import choice, parse_bool, parse_metrics_address, parse_path

HOSTNAME_LABELS = ("Hostname", "hostname")

METRICS_ADDRESS = Option(
    "metrics-address",
    parse_metrics_address,
    "HTTP listen address (default :9400)",
    "HOST:PORT",
    default=("", 9400),
)
WEB_CONFIG_FILE = Option(
    "web-config-file",
    parse_path,
    "TLS and basic auth for the HTTP server, in the Prometheus exporter-toolkit format",
    "FILE",
    default=None,
)
HOSTNAME_LABEL = Option(
    "hostname-label",
    choice(HOSTNAME_LABELS),
    "name of the host label on dcgm-exporter series: Hostname (dcgm-exporter before 4.8.3) or "
    "hostname (4.8.3 on; default Hostname)",
    "NAME",
    default="Hostname",
)
NO_HOSTNAME = Option(
    "no-hostname",
    parse_bool,
    "leave the host label off dcgm-exporter series (default false)",
    is_bool=True,
    default=False,
)
DETAILED_AGENT_METRICS = Option(
    "detailed-agent-metrics",
    parse_bool,
    "the agent's own metrics in full: each NVML function, API requests by object, request and "
    "event counts; by default what an operator acts on, in about 30 series. Also "
    "DCGM_FI_PROF_SM_ACTIVE and DCGM_FI_PROF_SM_OCCUPANCY, off in dcgm-exporter's default "
    "counters too (default false)",
    is_bool=True,
    default=False,
)
