"""Every option: its flag, config key, environment names, parser and help, in ``--help`` order."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from gpuagent.config.values import (
    choice,
    one_of,
    parse_absolute_path,
    parse_bool,
    parse_device_list_strategy,
    parse_dra_gpus,
    parse_driver_name,
    parse_healthchecks,
    parse_heartbeat,
    parse_metrics_address,
    parse_nvml_timeout,
    parse_path,
    parse_pod_resources_interval,
    parse_poll_interval,
    parse_resource_name,
    parse_sharing_value,
    parse_simulate,
    text_nonempty,
)
from gpuagent.domain.containers import DeviceListStrategy
from gpuagent.domain.devices import IdStrategy
from gpuagent.domain.preferred import SharedAllocationPolicy
from gpuagent.domain.resources import MigStrategy

T = TypeVar("T")

CONFIG_VERSION = "v1"
LOG_FORMATS = ("json", "console")
LOG_LEVELS = ("debug", "info", "warning", "error")
HOSTNAME_LABELS = ("Hostname", "hostname")
CDI_SPEC_TOOLKIT = "toolkit"
CDI_SPECS = ("write", CDI_SPEC_TOOLKIT)


@dataclass(frozen=True, slots=True)
class Option(Generic[T]):
    """One setting: its flag spelling, config key, environment names and parser.

    ``live``: a reload applies it without a restart (the plan holds it: see
    :mod:`gpuagent.config.planning`); any other setting is read once, at start.
    """

    name: str
    parse: Callable[[object], T]
    help: str
    metavar: str | None = None
    aliases: tuple[str, ...] = ()
    env_aliases: tuple[str, ...] = ()
    is_bool: bool = False
    in_file: bool = True
    live: bool = False

    @property
    def dest(self) -> str:
        return self.name.replace("-", "_")

    @property
    def env_names(self) -> tuple[str, ...]:
        return (f"GPUAGENT_{self.dest.upper()}", *self.env_aliases)


SOCKET_DIR = Option(
    "socket-dir",
    parse_path,
    "where plugin sockets are created (default /var/lib/kubelet/device-plugins)",
    "DIR",
)
KUBELET_SOCKET = Option(
    "kubelet-socket",
    parse_path,
    "kubelet Registration socket (default <socket-dir>/kubelet.sock)",
    "PATH",
    env_aliases=("KUBELET_SOCKET",),
)
POD_RESOURCES_SOCKET = Option(
    "pod-resources-socket",
    parse_path,
    "kubelet pod-resources socket (default /var/lib/kubelet/pod-resources/kubelet.sock)",
    "PATH",
)
METRICS_ADDRESS = Option(
    "metrics-address", parse_metrics_address, "HTTP listen address (default :9400)", "HOST:PORT"
)
CONFIG = Option(
    "config",
    parse_path,
    "versioned YAML config file",
    "FILE",
    aliases=("--config-file",),
    env_aliases=("CONFIG_FILE",),
    in_file=False,
)
SIMULATE = Option("simulate", parse_simulate, "run on N simulated GPUs (1-64)", "N")
SIM_CONFIG = Option("sim-config", parse_path, "run on the simulated node described in FILE", "FILE")
RESOURCE_NAME = Option(
    "resource-name",
    parse_resource_name,
    "extended resource for full GPUs (default nvidia.com/gpu)",
    "NAME",
    live=True,
)
DEVICE_LIST_STRATEGY = Option(
    "device-list-strategy",
    parse_device_list_strategy,
    f"comma list of {', '.join(s.value for s in DeviceListStrategy)} (default envvar)",
    "LIST",
    env_aliases=("DEVICE_LIST_STRATEGY",),
    live=True,
)
DEVICE_ID_STRATEGY = Option(
    "device-id-strategy",
    one_of(IdStrategy),
    "uuid or index (default uuid)",
    "STRATEGY",
    env_aliases=("DEVICE_ID_STRATEGY",),
    live=True,
)
MIG_STRATEGY = Option(
    "mig-strategy",
    one_of(MigStrategy),
    "none, single or mixed (default none)",
    "STRATEGY",
    env_aliases=("MIG_STRATEGY",),
    live=True,
)
FAIL_ON_INIT_ERROR = Option(
    "fail-on-init-error",
    parse_bool,
    "exit when the driver is unusable; false: serve probes and metrics and wait (default true)",
    env_aliases=("FAIL_ON_INIT_ERROR",),
    is_bool=True,
)
PASS_DEVICE_SPECS = Option(
    "pass-device-specs",
    parse_bool,
    "return device nodes in Allocate responses, except with CDI strategies only, whose spec "
    "brings them (default false)",
    env_aliases=("PASS_DEVICE_SPECS",),
    is_bool=True,
    live=True,
)
NVIDIA_DRIVER_ROOT = Option(
    "nvidia-driver-root",
    parse_path,
    "root of the NVIDIA driver installation (default /)",
    "DIR",
    aliases=("--driver-root",),
    env_aliases=("NVIDIA_DRIVER_ROOT",),
)
DISABLE_HEALTHCHECKS = Option(
    "disable-healthchecks",
    parse_healthchecks,
    "XIDs to ignore, 'xids' or 'all' (comma list)",
    "LIST",
    env_aliases=("DP_DISABLE_HEALTHCHECKS",),
    live=True,
)
ENABLE_HEALTHCHECKS = Option(
    "enable-healthchecks",
    parse_healthchecks,
    "XIDs to check even if disabled, or 'all' (comma list)",
    "LIST",
    env_aliases=("DP_ENABLE_HEALTHCHECKS",),
    live=True,
)
POLL_INTERVAL = Option(
    "poll-interval",
    parse_poll_interval,
    "seconds between telemetry and liveness polls of each GPU (default 5)",
    "SECONDS",
)
NVML_TIMEOUT = Option(
    "nvml-timeout",
    parse_nvml_timeout,
    "time limit for NVML work at start-up, in seconds "
    "(default 10 plus 5 per GPU; each NVML call also has its own limit)",
    "SECONDS",
)
LOG_FORMAT = Option(
    "log-format",
    choice(LOG_FORMATS),
    "json or console (default console on a TTY, else json; console is in colour only on a TTY)",
    "FORMAT",
)
LOG_LEVEL = Option(
    "log-level",
    choice(LOG_LEVELS, fold_case=True),
    "debug, info, warning or error (default info)",
    "LEVEL",
)

WEB_CONFIG_FILE = Option(
    "web-config-file",
    parse_path,
    "TLS and basic auth for the HTTP server, in the Prometheus exporter-toolkit format",
    "FILE",
)
HOSTNAME_LABEL = Option(
    "hostname-label",
    choice(HOSTNAME_LABELS),
    "name of the host label on dcgm-exporter series: Hostname (before dcgm-exporter 4.5) or "
    "hostname (default Hostname)",
    "NAME",
)
NO_HOSTNAME = Option(
    "no-hostname",
    parse_bool,
    "leave the host label off dcgm-exporter series (default false)",
    is_bool=True,
)
POD_RESOURCES_INTERVAL = Option(
    "pod-resources-interval",
    parse_pod_resources_interval,
    "seconds between pod-resources List calls at rest; Allocate triggers one sooner (default 30)",
    "SECONDS",
)

SHARING = Option(
    "sharing",
    parse_sharing_value,
    "time-slicing as in NVIDIA's config file: {timeSlicing: {renameByDefault, "
    "failRequestsGreaterThanOne, resources: [{name, replicas, devices, rename}]}}",
    "YAML",
    live=True,
)
SHARED_DEVICES_ALLOCATION_POLICY = Option(
    "shared-devices-allocation-policy",
    one_of(SharedAllocationPolicy),
    "preferred placement of replicas and MIG devices: distributed or packed (default distributed)",
    "POLICY",
    env_aliases=("SHARED_DEVICES_ALLOCATION_POLICY",),
    live=True,
)
CDI_ANNOTATION_PREFIX = Option(
    "cdi-annotation-prefix",
    text_nonempty,
    "annotation prefix of the cdi-annotations strategy (default cdi.k8s.io/)",
    "PREFIX",
    env_aliases=("CDI_ANNOTATION_PREFIX",),
    live=True,
)
CDI_SPEC_DIR = Option(
    "cdi-spec-dir",
    parse_path,
    "where the node's CDI spec is written with a cdi-* strategy (default /var/run/cdi)",
    "DIR",
)
CDI_SPEC = Option(
    "cdi-spec",
    choice(CDI_SPECS),
    "with a cdi-* strategy: write the agent's own CDI spec (write), or hand out the NVIDIA "
    "container toolkit's devices nvidia.com/gpu=<id> and write none (toolkit) (default write)",
    "MODE",
)
NVIDIA_CDI_HOOK_PATH = Option(
    "nvidia-cdi-hook-path",
    parse_absolute_path,
    "host path of the container toolkit's hook binary, nvidia-ctk or nvidia-cdi-hook, that the "
    "CDI spec's hooks run (default /usr/bin/nvidia-ctk)",
    "PATH",
    aliases=("--nvidia-ctk-path",),
    env_aliases=("NVIDIA_CDI_HOOK_PATH", "NVIDIA_CTK_PATH"),
)
DRIVER_ROOT_CTR_PATH = Option(
    "driver-root-ctr-path",
    parse_absolute_path,
    "where the agent reads the driver root's files, e.g. a host mount in its container "
    "(default the driver root itself)",
    "DIR",
    aliases=("--container-driver-root",),
    env_aliases=("DRIVER_ROOT_CTR_PATH", "CONTAINER_DRIVER_ROOT"),
)
NODE_LABELS = Option(
    "node-labels",
    parse_bool,
    "write GPU feature labels for node-feature-discovery (default true)",
    is_bool=True,
)
KUBERNETES = Option(
    "kubernetes",
    parse_bool,
    "false: no kubelet registration and no pod-resources client, only metrics, health and node "
    "labels (a Docker host, bare metal); ready once the GPUs are discovered (default true)",
    is_bool=True,
)
CHECK_CONFIG = Option(
    "check-config",
    parse_path,
    "parse and validate FILE as the config file (with the flags and environment), print the "
    "effective settings and exit: 0 when valid, 2 when not; starts nothing",
    "FILE",
    in_file=False,
)
NODE_LABELS_FILE = Option(
    "node-labels-file",
    parse_path,
    "the node-feature-discovery feature file "
    "(default /etc/kubernetes/node-feature-discovery/features.d/gpuagent)",
    "FILE",
)
MACHINE_TYPE_FILE = Option(
    "machine-type-file",
    parse_path,
    "the machine's product name for the gpu.machine label (default /sys/class/dmi/id/product_name)",
    "FILE",
    env_aliases=("GFD_MACHINE_TYPE_FILE",),
)
CONTAINER_ACCOUNTING = Option(
    "container-accounting",
    parse_bool,
    "per-container GPU accounting: the GPU's processes by container; needs the host's PID "
    "namespace (default true; the DaemonSet sets false unless the accounting component adds "
    "hostPID)",
    is_bool=True,
)
PROC_ROOT = Option(
    "proc-root",
    parse_path,
    "the /proc of the host's processes: PID/cgroup tells a GPU process's container, for "
    "per-container GPU accounting (default /proc)",
    "DIR",
)
CONTAINER_LOGS_DIR = Option(
    "container-logs-dir",
    parse_path,
    "the kubelet's container log links, whose names (<pod>_<namespace>_<container>-<id>.log) "
    "name the containers using GPUs; only the names are read (default /var/log/containers)",
    "DIR",
)
CRI_SOCKET = Option(
    "cri-socket",
    parse_path,
    "the container runtime's CRI socket, for the names of containers the log links do not name; "
    "optional (default containerd's or CRI-O's, whichever exists)",
    "PATH",
)
DCGM_CONTAINER_SHARES = Option(
    "dcgm-container-shares",
    parse_bool,
    "the dcgm-exporter series of a shared GPU carry each container's own utilisation, memory "
    "and energy instead of the whole GPU's (default false)",
    is_bool=True,
)


DRA_GPUS = Option(
    "dra-gpus",
    parse_dra_gpus,
    "GPUs served through Dynamic Resource Allocation instead of the device plugin: none, all, "
    "or a comma list of GPU indexes and UUIDs (default none)",
    "none|all|LIST",
)
DRA_DRIVER_NAME = Option(
    "dra-driver-name",
    parse_driver_name,
    "the DRA driver name; NVIDIA's by default, so its DeviceClasses and claims select our "
    "devices (default gpu.nvidia.com)",
    "NAME",
)
PLUGINS_REGISTRY_DIR = Option(
    "plugins-registry-dir",
    parse_path,
    "where the DRA registration socket <driver>-reg.sock is created "
    "(default /var/lib/kubelet/plugins_registry)",
    "DIR",
)
PLUGINS_DIR = Option(
    "plugins-dir",
    parse_path,
    "the DRA service socket is <DIR>/<driver>/dra.sock, beside the claims' checkpoint "
    "(default /var/lib/kubelet/plugins)",
    "DIR",
)
KUBECONFIG = Option(
    "kubeconfig",
    parse_path,
    "API server access for DRA, the node condition and events (default: the pod's in-cluster "
    "service account)",
    "FILE",
)
NODE_CONDITION = Option(
    "node-condition",
    parse_bool,
    "write the Node condition GPUHealthy: True (AllGPUsHealthy), or False with the worst cause "
    "and each failing GPU (default true where the agent has API credentials)",
    is_bool=True,
)
EVENTS = Option(
    "events",
    parse_bool,
    "Events on the Node for each GPU that turns unhealthy or recovers, and on each pod holding "
    "a GPU that fails (default true where the agent has API credentials)",
    is_bool=True,
)
TAINT_UNHEALTHY_NODE = Option(
    "taint-unhealthy-node",
    parse_bool,
    "taint the Node nvidia.com/gpu-unhealthy:NoSchedule while every GPU of it is unhealthy; "
    "needs patch on nodes (manifests/components/taint-unhealthy-node) (default false)",
    is_bool=True,
)
NODE_CONDITION_HEARTBEAT = Option(
    "node-condition-heartbeat",
    parse_heartbeat,
    "seconds between writes of an unchanged GPUHealthy condition (its lastHeartbeatTime), 60 "
    "to 86400; at rest the condition costs two requests an hour (default 1800)",
    "SECONDS",
)

OPTIONS: tuple[Option[Any], ...] = (
    SOCKET_DIR,
    KUBELET_SOCKET,
    POD_RESOURCES_SOCKET,
    METRICS_ADDRESS,
    CONFIG,
    SIMULATE,
    SIM_CONFIG,
    RESOURCE_NAME,
    DEVICE_LIST_STRATEGY,
    DEVICE_ID_STRATEGY,
    MIG_STRATEGY,
    FAIL_ON_INIT_ERROR,
    PASS_DEVICE_SPECS,
    NVIDIA_DRIVER_ROOT,
    DISABLE_HEALTHCHECKS,
    ENABLE_HEALTHCHECKS,
    POLL_INTERVAL,
    NVML_TIMEOUT,
    LOG_FORMAT,
    LOG_LEVEL,
    WEB_CONFIG_FILE,
    HOSTNAME_LABEL,
    NO_HOSTNAME,
    POD_RESOURCES_INTERVAL,
    SHARING,
    SHARED_DEVICES_ALLOCATION_POLICY,
    CDI_ANNOTATION_PREFIX,
    CDI_SPEC_DIR,
    CDI_SPEC,
    NVIDIA_CDI_HOOK_PATH,
    DRIVER_ROOT_CTR_PATH,
    NODE_LABELS,
    NODE_LABELS_FILE,
    MACHINE_TYPE_FILE,
    DRA_GPUS,
    DRA_DRIVER_NAME,
    PLUGINS_REGISTRY_DIR,
    PLUGINS_DIR,
    KUBECONFIG,
    NODE_CONDITION,
    EVENTS,
    TAINT_UNHEALTHY_NODE,
    NODE_CONDITION_HEARTBEAT,
    CONTAINER_ACCOUNTING,
    PROC_ROOT,
    CONTAINER_LOGS_DIR,
    CRI_SOCKET,
    DCGM_CONTAINER_SHARES,
    KUBERNETES,
    CHECK_CONFIG,
)
FILE_KEYS = tuple(opt.name for opt in OPTIONS if opt.in_file)
