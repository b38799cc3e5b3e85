"""Command line, environment and config-file settings, resolved with flag > env > file > default."""

from __future__ import annotations

import argparse
import difflib
import functools
import math
import re
import socket
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from gpuagent.domain.containers import DeviceListStrategy
from gpuagent.domain.devices import IdStrategy
from gpuagent.domain.errors import SettingError
from gpuagent.domain.naming import resource_name
from gpuagent.domain.preferred import SharedAllocationPolicy
from gpuagent.domain.resources import MigStrategy
from gpuagent.domain.timeslicing import ReplicaRule, TimeSlicing

if TYPE_CHECKING:
    import yaml

__all__ = ["ConfigError", "Settings", "load_settings", "parse_sharing"]

T = TypeVar("T")
D = TypeVar("D")
E = TypeVar("E", bound=StrEnum)

CONFIG_VERSION = "v1"
LOG_FORMATS = ("json", "console")
LOG_LEVELS = ("debug", "info", "warning", "error")
MAX_SIMULATED_GPUS = 64
MAX_POLL_INTERVAL = 3600.0
MIN_NVML_TIMEOUT = 1.0
MIN_POD_RESOURCES_INTERVAL = 1.0
HOSTNAME_LABELS = ("Hostname", "hostname")
CDI_SPEC_TOOLKIT = "toolkit"
CDI_SPECS = ("write", CDI_SPEC_TOOLKIT)

_TRUE = frozenset({"true", "1", "yes"})
_FALSE = frozenset({"false", "0", "no"})
_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS_SUBDOMAIN_RE = re.compile(rf"{_DNS_LABEL}(\.{_DNS_LABEL})*")
_HOSTNAME_RE = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9.]*[A-Za-z0-9])?")


class ConfigError(SettingError):
    """An invalid setting; ``key`` names the flag, environment variable or config key at fault."""


@dataclass(frozen=True, slots=True)
class Settings:
    """The agent's effective configuration."""

    socket_dir: Path
    kubelet_socket: Path
    pod_resources_socket: Path
    metrics_host: str
    metrics_port: int
    config_file: Path | None
    simulate: int | None
    sim_config: Path | None
    resource_name: str
    device_list_strategy: tuple[DeviceListStrategy, ...]
    device_id_strategy: IdStrategy
    mig_strategy: MigStrategy
    fail_on_init_error: bool
    pass_device_specs: bool
    nvidia_driver_root: Path
    disable_healthchecks: str
    enable_healthchecks: str
    poll_interval: float
    log_format: str
    log_level: str
    web_config_file: Path | None
    hostname_label: str
    no_hostname: bool
    pod_resources_interval: float
    sharing: TimeSlicing
    shared_devices_allocation_policy: SharedAllocationPolicy
    cdi_annotation_prefix: str
    cdi_spec_dir: Path
    cdi_spec: str
    nvidia_cdi_hook_path: str
    driver_root_ctr_path: Path | None
    node_labels: bool
    node_labels_file: Path
    machine_type_file: Path
    dra_gpus: str = "none"
    dra_driver_name: str = "gpu.nvidia.com"
    plugins_registry_dir: Path = Path("/var/lib/kubelet/plugins_registry")
    plugins_dir: Path = Path("/var/lib/kubelet/plugins")
    kubeconfig: Path | None = None
    proc_root: Path = Path("/proc")
    cri_socket: Path | None = None
    dcgm_container_shares: bool = False
    kubernetes: bool = True
    # The node's name (the host label on every metric): NODE_NAME (the DaemonSet sets it from
    # spec.nodeName), else the host name.
    node_name: str = ""
    check_config: Path | None = None
    # Time limit for NVML work at start-up (seconds); None: scaled with the GPU count.
    nvml_timeout: float | None = None

    def as_dict(self) -> dict[str, object]:
        """Return the settings as JSON-friendly values: paths as strings, tuples as lists, the
        sharing block as NVIDIA's config file spells it."""
        out: dict[str, object] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Path):
                value = str(value)
            elif isinstance(value, StrEnum):
                value = value.value
            elif isinstance(value, tuple):
                value = [v.value if isinstance(v, StrEnum) else v for v in value]
            elif isinstance(value, TimeSlicing):
                value = sharing_block(value)
            out[f.name] = value
        return out


class _Invalid(Exception):
    """A raw value failed validation; the message is the reason."""


def _type_name(raw: object) -> str:
    return "null" if raw is None else type(raw).__name__


def _text(raw: object) -> str:
    if not isinstance(raw, str):
        raise _Invalid(f"expected a string, got {_type_name(raw)}")
    return raw


def _parse_path(raw: object) -> Path:
    text = _text(raw)
    if not text:
        raise _Invalid("must not be empty")
    if "\0" in text:
        raise _Invalid("must not contain a NUL character")
    return Path(text)


def _parse_absolute_path(raw: object) -> Path:
    path = _parse_path(raw)
    if not path.is_absolute():
        raise _Invalid(f"must be an absolute path, got {str(path)!r}")
    return path


def _text_nonempty(raw: object) -> str:
    text = _text(raw)
    if not text:
        raise _Invalid("must not be empty")
    return text


def _parse_bool(raw: object) -> bool:
    if isinstance(raw, bool):
        return raw
    if not isinstance(raw, str):
        raise _Invalid(f"expected true or false, got {_type_name(raw)}")
    text = raw
    if text.lower() in _TRUE:
        return True
    if text.lower() in _FALSE:
        return False
    raise _Invalid(f"expected true or false, got {text!r}")


def _parse_simulate(raw: object) -> int:
    if isinstance(raw, int) and not isinstance(raw, bool):
        count = raw
    elif isinstance(raw, str) and raw.isascii() and raw.strip().isdecimal():
        count = int(raw)
    else:
        raise _Invalid(f"expected a whole number of GPUs, got {raw!r}")
    if not 1 <= count <= MAX_SIMULATED_GPUS:
        raise _Invalid(f"must be between 1 and {MAX_SIMULATED_GPUS}, got {count}")
    return count


def _parse_poll_interval(raw: object) -> float:
    if isinstance(raw, (int, float)) and not isinstance(raw, bool):
        seconds = float(raw)
    elif isinstance(raw, str):
        try:
            seconds = float(raw)
        except ValueError:
            raise _Invalid(f"expected a number of seconds, got {raw!r}") from None
    else:
        raise _Invalid(f"expected a number of seconds, got {_type_name(raw)}")
    if not (math.isfinite(seconds) and 0 < seconds <= MAX_POLL_INTERVAL):
        raise _Invalid(f"must be > 0 and <= {MAX_POLL_INTERVAL:g} seconds, got {raw!r}")
    return seconds


def _parse_nvml_timeout(raw: object) -> float:
    seconds = _parse_poll_interval(raw)
    if seconds < MIN_NVML_TIMEOUT:
        raise _Invalid(f"must be at least {MIN_NVML_TIMEOUT:g} second, got {raw!r}")
    return seconds


def _parse_pod_resources_interval(raw: object) -> float:
    seconds = _parse_poll_interval(raw)
    if seconds < MIN_POD_RESOURCES_INTERVAL:
        raise _Invalid(f"must be at least {MIN_POD_RESOURCES_INTERVAL:g} second, got {raw!r}")
    return seconds


def _parse_sharing(raw: object) -> TimeSlicing:
    """NVIDIA's ``sharing`` block: a mapping in the file, YAML/JSON text in a flag or env."""
    value = raw
    if isinstance(raw, str):
        import yaml  # noqa: PLC0415 - only for sharing given as text

        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError as exc:
            raise _Invalid(f"not valid YAML or JSON: {exc}") from None
    if value is None:
        return TimeSlicing()
    if not isinstance(value, dict):
        raise _Invalid(f"expected a mapping such as {{timeSlicing: ...}}, got {_type_name(value)}")
    try:
        return parse_sharing(value)
    except SettingError as exc:
        raise _Invalid(str(exc)) from None


def parse_sharing(sharing: Mapping[str, object]) -> TimeSlicing:
    """NVIDIA's ``sharing`` block (``{timeSlicing: {...}}``) as the domain's :class:`TimeSlicing`.

    Raises :class:`SettingError` naming the key (``sharing.timeSlicing.resources[1].replicas``).
    """
    unknown = set(sharing) - {"timeSlicing"}
    if unknown:
        raise SettingError(
            "sharing", f"unknown keys {sorted(map(str, unknown))} (known: timeSlicing)"
        )
    block = sharing.get("timeSlicing")
    if block is None:
        block = {}
    key = "sharing.timeSlicing"
    if not isinstance(block, Mapping):
        raise SettingError(key, "expected a mapping")
    unknown = set(block) - {"renameByDefault", "failRequestsGreaterThanOne", "resources"}
    if unknown:
        raise SettingError(key, f"unknown keys {sorted(map(str, unknown))}")
    rules = []
    entries = block.get("resources")
    if entries is None:
        entries = []
    if not isinstance(entries, list):
        raise SettingError(f"{key}.resources", "expected a list")
    for i, entry in enumerate(entries):
        where = f"{key}.resources[{i}]"
        if not isinstance(entry, Mapping):
            raise SettingError(where, "expected a mapping {name, replicas, devices, rename}")
        extra = set(entry) - {"name", "replicas", "devices", "rename"}
        if extra:
            raise SettingError(where, f"unknown keys {sorted(map(str, extra))}")
        name, replicas = entry.get("name"), entry.get("replicas")
        rename, devices = entry.get("rename", ""), entry.get("devices", "all")
        if not isinstance(name, str):
            raise SettingError(f"{where}.name", "a resource name is required")
        if isinstance(replicas, bool) or not isinstance(replicas, int):
            raise SettingError(f"{where}.replicas", f"expected a whole number, got {replicas!r}")
        if not isinstance(rename, str):
            raise SettingError(f"{where}.rename", f"expected a resource name, got {rename!r}")
        if isinstance(devices, list):
            if not all(isinstance(d, str | int) and not isinstance(d, bool) for d in devices):
                raise SettingError(f"{where}.devices", "expected indexes or UUIDs")
            devices = tuple(str(d) for d in devices)
        elif isinstance(devices, bool) or not isinstance(devices, str | int):
            raise SettingError(f"{where}.devices", f"expected all, a count or a list: {devices!r}")
        rules.append(ReplicaRule(name=name, replicas=replicas, devices=devices, rename=rename))
    flags = {}
    for name in ("renameByDefault", "failRequestsGreaterThanOne"):
        value = block.get(name, False)
        if not isinstance(value, bool):
            raise SettingError(f"{key}.{name}", f"expected true or false, got {value!r}")
        flags[name] = value
    return TimeSlicing(
        resources=tuple(rules),
        rename_by_default=flags["renameByDefault"],
        fail_requests_greater_than_one=flags["failRequestsGreaterThanOne"],
    )


def sharing_block(sharing: TimeSlicing) -> dict[str, object]:
    """:class:`TimeSlicing` as NVIDIA's ``sharing`` block (``{}`` when nothing is shared)."""
    if sharing == TimeSlicing():
        return {}
    rules = []
    for rule in sharing.resources:
        entry: dict[str, object] = {"name": rule.name, "replicas": rule.replicas}
        if rule.devices != "all":
            entry["devices"] = (
                list(rule.devices) if isinstance(rule.devices, tuple) else rule.devices
            )
        if rule.rename:
            entry["rename"] = rule.rename
        rules.append(entry)
    return {
        "timeSlicing": {
            "renameByDefault": sharing.rename_by_default,
            "failRequestsGreaterThanOne": sharing.fail_requests_greater_than_one,
            "resources": rules,
        }
    }


def _choice(allowed: tuple[str, ...], *, fold_case: bool = False) -> Callable[[object], str]:
    def parse(raw: object) -> str:
        text = _text(raw)
        value = text.lower() if fold_case else text
        if value not in allowed:
            raise _Invalid(f"must be one of {', '.join(allowed)}, got {text!r}")
        return value

    return parse


def _one_of(kind: type[E]) -> Callable[[object], E]:
    """A parser for one of the domain enum ``kind``'s values."""
    allowed = tuple(member.value for member in kind)

    def parse(raw: object) -> E:
        return kind(_choice(allowed)(raw))

    return parse


def _parse_device_list_strategy(raw: object) -> tuple[DeviceListStrategy, ...]:
    if isinstance(raw, list):
        items = [_text(item).strip() for item in raw]
    else:
        items = [item.strip() for item in _text(raw).split(",")]
    if not items or "" in items:
        raise _Invalid("expected a comma-separated list without empty entries")
    allowed = tuple(s.value for s in DeviceListStrategy)
    unknown = [item for item in items if item not in allowed]
    if unknown:
        raise _Invalid(f"unknown strategy {unknown[0]!r}; allowed: {', '.join(allowed)}")
    strategies = tuple(DeviceListStrategy(item) for item in dict.fromkeys(items))
    cdi = {DeviceListStrategy.CDI_ANNOTATIONS, DeviceListStrategy.CDI_CRI}
    if cdi <= set(strategies):
        raise _Invalid("cdi-annotations and cdi-cri cannot be combined")
    return strategies


def _parse_healthchecks(raw: object) -> str:
    if isinstance(raw, list):
        return ",".join(_parse_healthchecks(item) for item in raw)
    if isinstance(raw, int) and not isinstance(raw, bool):
        return str(raw)
    return _text(raw)


def _parse_resource_name(raw: object) -> str:
    try:
        return resource_name(_text(raw))
    except ValueError as exc:
        raise _Invalid(str(exc)) from None


def _parse_metrics_address(raw: object) -> tuple[str, int]:
    text = _text(raw)
    host, colon, port_text = text.rpartition(":")
    if not colon:
        raise _Invalid(f"expected HOST:PORT (e.g. ':9400'), got {text!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        import ipaddress  # noqa: PLC0415 - only for a bracketed host

        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise _Invalid(f"{host!r} is not an IPv6 address") from None
    elif ":" in host:
        raise _Invalid(f"an IPv6 host must be in brackets, e.g. '[::1]:9400', got {text!r}")
    elif host and not _HOSTNAME_RE.fullmatch(host):
        raise _Invalid(f"{host!r} is not a valid host name or address")
    if not (port_text.isascii() and port_text.isdecimal()) or not 0 <= int(port_text) <= 65535:
        raise _Invalid(f"port must be a number from 0 to 65535, got {port_text!r}")
    return host, int(port_text)


@dataclass(frozen=True, slots=True)
class _Option(Generic[T]):
    """One setting: its flag spelling, config key, environment names and parser."""

    name: str
    parse: Callable[[object], T]
    help: str
    metavar: str | None = None
    aliases: tuple[str, ...] = ()
    env_aliases: tuple[str, ...] = ()
    is_bool: bool = False
    in_file: bool = True

    @property
    def dest(self) -> str:
        return self.name.replace("-", "_")

    @property
    def env_names(self) -> tuple[str, ...]:
        return (f"GPUAGENT_{self.dest.upper()}", *self.env_aliases)


SOCKET_DIR = _Option(
    "socket-dir",
    _parse_path,
    "where plugin sockets are created (default /var/lib/kubelet/device-plugins)",
    "DIR",
)
KUBELET_SOCKET = _Option(
    "kubelet-socket",
    _parse_path,
    "kubelet Registration socket (default <socket-dir>/kubelet.sock)",
    "PATH",
    env_aliases=("KUBELET_SOCKET",),
)
POD_RESOURCES_SOCKET = _Option(
    "pod-resources-socket",
    _parse_path,
    "kubelet pod-resources socket (default /var/lib/kubelet/pod-resources/kubelet.sock)",
    "PATH",
)
METRICS_ADDRESS = _Option(
    "metrics-address", _parse_metrics_address, "HTTP listen address (default :9400)", "HOST:PORT"
)
CONFIG = _Option(
    "config",
    _parse_path,
    "versioned YAML config file",
    "FILE",
    aliases=("--config-file",),
    env_aliases=("CONFIG_FILE",),
    in_file=False,
)
SIMULATE = _Option("simulate", _parse_simulate, "run on N simulated GPUs (1-64)", "N")
SIM_CONFIG = _Option(
    "sim-config", _parse_path, "run on the simulated node described in FILE", "FILE"
)
RESOURCE_NAME = _Option(
    "resource-name",
    _parse_resource_name,
    "extended resource for full GPUs (default nvidia.com/gpu)",
    "NAME",
)
DEVICE_LIST_STRATEGY = _Option(
    "device-list-strategy",
    _parse_device_list_strategy,
    f"comma list of {', '.join(s.value for s in DeviceListStrategy)} (default envvar)",
    "LIST",
    env_aliases=("DEVICE_LIST_STRATEGY",),
)
DEVICE_ID_STRATEGY = _Option(
    "device-id-strategy",
    _one_of(IdStrategy),
    "uuid or index (default uuid)",
    "STRATEGY",
    env_aliases=("DEVICE_ID_STRATEGY",),
)
MIG_STRATEGY = _Option(
    "mig-strategy",
    _one_of(MigStrategy),
    "none, single or mixed (default none)",
    "STRATEGY",
    env_aliases=("MIG_STRATEGY",),
)
FAIL_ON_INIT_ERROR = _Option(
    "fail-on-init-error",
    _parse_bool,
    "exit when the driver is unusable; false: serve probes and metrics and wait (default true)",
    env_aliases=("FAIL_ON_INIT_ERROR",),
    is_bool=True,
)
PASS_DEVICE_SPECS = _Option(
    "pass-device-specs",
    _parse_bool,
    "return device nodes in Allocate responses (default false)",
    env_aliases=("PASS_DEVICE_SPECS",),
    is_bool=True,
)
NVIDIA_DRIVER_ROOT = _Option(
    "nvidia-driver-root",
    _parse_path,
    "root of the NVIDIA driver installation (default /)",
    "DIR",
    aliases=("--driver-root",),
    env_aliases=("NVIDIA_DRIVER_ROOT",),
)
DISABLE_HEALTHCHECKS = _Option(
    "disable-healthchecks",
    _parse_healthchecks,
    "XIDs to ignore, 'xids' or 'all' (comma list)",
    "LIST",
    env_aliases=("DP_DISABLE_HEALTHCHECKS",),
)
ENABLE_HEALTHCHECKS = _Option(
    "enable-healthchecks",
    _parse_healthchecks,
    "XIDs to check even if disabled, or 'all' (comma list)",
    "LIST",
    env_aliases=("DP_ENABLE_HEALTHCHECKS",),
)
POLL_INTERVAL = _Option(
    "poll-interval",
    _parse_poll_interval,
    "seconds between telemetry and liveness polls of each GPU (default 5)",
    "SECONDS",
)
NVML_TIMEOUT = _Option(
    "nvml-timeout",
    _parse_nvml_timeout,
    "time limit for NVML work at start-up, in seconds "
    "(default 10 plus 5 per GPU; each NVML call also has its own limit)",
    "SECONDS",
)
LOG_FORMAT = _Option(
    "log-format",
    _choice(LOG_FORMATS),
    "json or console (default console on a TTY, else json)",
    "FORMAT",
)
LOG_LEVEL = _Option(
    "log-level",
    _choice(LOG_LEVELS, fold_case=True),
    "debug, info, warning or error (default info)",
    "LEVEL",
)

WEB_CONFIG_FILE = _Option(
    "web-config-file",
    _parse_path,
    "TLS and basic auth for the HTTP server, in the Prometheus exporter-toolkit format",
    "FILE",
)
HOSTNAME_LABEL = _Option(
    "hostname-label",
    _choice(HOSTNAME_LABELS),
    "name of the host label on dcgm-exporter series: Hostname (before dcgm-exporter 4.5) or "
    "hostname (default Hostname)",
    "NAME",
)
NO_HOSTNAME = _Option(
    "no-hostname",
    _parse_bool,
    "leave the host label off dcgm-exporter series (default false)",
    is_bool=True,
)
POD_RESOURCES_INTERVAL = _Option(
    "pod-resources-interval",
    _parse_pod_resources_interval,
    "seconds between pod-resources List calls at rest; Allocate triggers one sooner (default 30)",
    "SECONDS",
)

SHARING = _Option(
    "sharing",
    _parse_sharing,
    "time-slicing as in NVIDIA's config file: {timeSlicing: {renameByDefault, "
    "failRequestsGreaterThanOne, resources: [{name, replicas, devices, rename}]}}",
    "YAML",
)
SHARED_DEVICES_ALLOCATION_POLICY = _Option(
    "shared-devices-allocation-policy",
    _one_of(SharedAllocationPolicy),
    "preferred placement of replicas and MIG devices: distributed or packed (default distributed)",
    "POLICY",
    env_aliases=("SHARED_DEVICES_ALLOCATION_POLICY",),
)
CDI_ANNOTATION_PREFIX = _Option(
    "cdi-annotation-prefix",
    _text_nonempty,
    "annotation prefix of the cdi-annotations strategy (default cdi.k8s.io/)",
    "PREFIX",
    env_aliases=("CDI_ANNOTATION_PREFIX",),
)
CDI_SPEC_DIR = _Option(
    "cdi-spec-dir",
    _parse_path,
    "where the node's CDI spec is written with a cdi-* strategy (default /var/run/cdi)",
    "DIR",
)
CDI_SPEC = _Option(
    "cdi-spec",
    _choice(CDI_SPECS),
    "with a cdi-* strategy: write the agent's own CDI spec (write), or hand out the NVIDIA "
    "container toolkit's devices nvidia.com/gpu=<id> and write none (toolkit) (default write)",
    "MODE",
)
NVIDIA_CDI_HOOK_PATH = _Option(
    "nvidia-cdi-hook-path",
    _parse_absolute_path,
    "host path of the container toolkit's hook binary, nvidia-ctk or nvidia-cdi-hook, that the "
    "CDI spec's hooks run (default /usr/bin/nvidia-ctk)",
    "PATH",
    aliases=("--nvidia-ctk-path",),
    env_aliases=("NVIDIA_CDI_HOOK_PATH", "NVIDIA_CTK_PATH"),
)
DRIVER_ROOT_CTR_PATH = _Option(
    "driver-root-ctr-path",
    _parse_absolute_path,
    "where the agent reads the driver root's files, e.g. a host mount in its container "
    "(default the driver root itself)",
    "DIR",
    aliases=("--container-driver-root",),
    env_aliases=("DRIVER_ROOT_CTR_PATH", "CONTAINER_DRIVER_ROOT"),
)
NODE_LABELS = _Option(
    "node-labels",
    _parse_bool,
    "write GPU feature labels for node-feature-discovery (default true)",
    is_bool=True,
)
KUBERNETES = _Option(
    "kubernetes",
    _parse_bool,
    "false: no kubelet registration and no pod-resources client, only metrics, health and node "
    "labels (a Docker host, bare metal); ready once the GPUs are discovered (default true)",
    is_bool=True,
)
CHECK_CONFIG = _Option(
    "check-config",
    _parse_path,
    "parse and validate FILE as the config file (with the flags and environment), print the "
    "effective settings and exit: 0 when valid, 2 when not; starts nothing",
    "FILE",
    in_file=False,
)
NODE_LABELS_FILE = _Option(
    "node-labels-file",
    _parse_path,
    "the node-feature-discovery feature file "
    "(default /etc/kubernetes/node-feature-discovery/features.d/gpuagent)",
    "FILE",
)
MACHINE_TYPE_FILE = _Option(
    "machine-type-file",
    _parse_path,
    "the machine's product name for the gpu.machine label (default /sys/class/dmi/id/product_name)",
    "FILE",
    env_aliases=("GFD_MACHINE_TYPE_FILE",),
)
PROC_ROOT = _Option(
    "proc-root",
    _parse_path,
    "the /proc of the host's processes: PID/cgroup tells a GPU process's container, for "
    "per-container GPU accounting (default /proc)",
    "DIR",
)
CRI_SOCKET = _Option(
    "cri-socket",
    _parse_path,
    "the container runtime's CRI socket, for the names of containers using GPUs "
    "(default containerd's or CRI-O's, whichever exists)",
    "PATH",
)
DCGM_CONTAINER_SHARES = _Option(
    "dcgm-container-shares",
    _parse_bool,
    "the dcgm-exporter series of a shared GPU carry each container's own utilisation, memory "
    "and energy instead of the whole GPU's (default false)",
    is_bool=True,
)


def _parse_dra_gpus(raw: object) -> str:
    if isinstance(raw, list):
        items = [str(item) for item in raw if not isinstance(item, bool)]
        if len(items) != len(raw) or not items:
            raise _Invalid("expected none, all or a list of GPU indexes and UUIDs")
        return ",".join(items)
    if isinstance(raw, int) and not isinstance(raw, bool):
        return str(raw)
    text = _text(raw).strip()
    if not text:
        raise _Invalid("must not be empty (none, all, or GPU indexes and UUIDs)")
    return text


def _parse_driver_name(raw: object) -> str:
    name = _text(raw)
    if len(name) > 63 or not _DNS_SUBDOMAIN_RE.fullmatch(name):
        raise _Invalid(f"must be a lower-case DNS subdomain of at most 63 characters, got {name!r}")
    return name


DRA_GPUS = _Option(
    "dra-gpus",
    _parse_dra_gpus,
    "GPUs served through Dynamic Resource Allocation instead of the device plugin: none, all, "
    "or a comma list of GPU indexes and UUIDs (default none)",
    "none|all|LIST",
)
DRA_DRIVER_NAME = _Option(
    "dra-driver-name",
    _parse_driver_name,
    "the DRA driver name; NVIDIA's by default, so its DeviceClasses and claims select our "
    "devices (default gpu.nvidia.com)",
    "NAME",
)
PLUGINS_REGISTRY_DIR = _Option(
    "plugins-registry-dir",
    _parse_path,
    "where the DRA registration socket <driver>-reg.sock is created "
    "(default /var/lib/kubelet/plugins_registry)",
    "DIR",
)
PLUGINS_DIR = _Option(
    "plugins-dir",
    _parse_path,
    "the DRA service socket is <DIR>/<driver>/dra.sock, beside the claims' checkpoint "
    "(default /var/lib/kubelet/plugins)",
    "DIR",
)
KUBECONFIG = _Option(
    "kubeconfig",
    _parse_path,
    "API server access for DRA (default: the pod's in-cluster service account)",
    "FILE",
)

OPTIONS: tuple[_Option[Any], ...] = (
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
    PROC_ROOT,
    CRI_SOCKET,
    DCGM_CONTAINER_SHARES,
    KUBERNETES,
    CHECK_CONFIG,
)
FILE_KEYS = tuple(opt.name for opt in OPTIONS if opt.in_file)


class _StoreWithFlag(argparse.Action):
    """Store ``(option string as typed, value)`` so errors can name the spelling the user used."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, (option_string or self.option_strings[0], values))


class _Version(argparse.Action):
    """``--version``: the installed version, read only when asked for (importing
    :mod:`importlib.metadata` would cost every start)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        import importlib.metadata  # noqa: PLC0415

        try:
            version = importlib.metadata.version("gpuagent")
        except importlib.metadata.PackageNotFoundError:
            version = "0+unknown"
        sys.stdout.write(f"gpuagent {version}\n")
        parser.exit()


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpuagent",
        description="Kubernetes GPU node agent: device plugin, GPU health and metrics.",
        epilog="Every option is also settable as GPUAGENT_<OPTION> in the environment and, "
        f"except --config, as a key of the config file (version: {CONFIG_VERSION}). "
        "Precedence: flag > environment > config file > default. "
        "Boolean flags take --name or --name=true|false.",
        allow_abbrev=False,
    )
    parser.add_argument("--version", action=_Version, help="show program's version number and exit")
    for opt in OPTIONS:
        help_text = f"{opt.help} [env {', '.join(opt.env_names)}]"
        parser.add_argument(
            f"--{opt.name}",
            *opt.aliases,
            dest=opt.dest,
            action=_StoreWithFlag,
            nargs="?" if opt.is_bool else None,
            metavar="true|false" if opt.is_bool else opt.metavar,
            help=help_text,
        )
    return parser


def _normalize_bool_flags(argv: Sequence[str]) -> list[str]:
    """Rewrite a bare boolean flag to ``--name=true`` so it never consumes the next argument."""
    bare = {
        spelling for opt in OPTIONS if opt.is_bool for spelling in (f"--{opt.name}", *opt.aliases)
    }
    out: list[str] = []
    for i, arg in enumerate(argv):
        if arg == "--":
            return [*out, *argv[i:]]
        out.append(f"{arg}=true" if arg in bare else arg)
    return out


@functools.cache
def _yaml_loader() -> type[yaml.SafeLoader]:
    """A safe YAML loader that rejects duplicate mapping keys (built when a file is read)."""
    import yaml  # noqa: PLC0415 - a config file is optional; the import costs start-up time

    class SafeLoaderNoDuplicates(yaml.SafeLoader):
        pass

    def construct_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict[Any, Any]:
        mapping = loader.construct_mapping(node)
        seen: set[object] = set()
        for key_node, _ in node.value:
            key = loader.construct_object(key_node)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return mapping

    SafeLoaderNoDuplicates.add_constructor(
        yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, construct_mapping
    )
    return SafeLoaderNoDuplicates


def _read_config_file(path: Path) -> dict[str, object]:
    """Read and check the config file; return its settings keyed by option name."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError("config", f"cannot read {path}: {reason}") from None
    import yaml  # noqa: PLC0415

    loader = _yaml_loader()

    try:
        document = yaml.load(text, Loader=loader)
    except yaml.YAMLError as exc:
        raise ConfigError("config", f"invalid YAML in {path}: {exc}") from None
    if not isinstance(document, dict):
        raise ConfigError(
            "config", f"{path} must hold a mapping of settings, got {_type_name(document)}"
        )
    version = document.pop("version", None)
    if version is None:
        raise ConfigError("version", f"{path} must declare 'version: {CONFIG_VERSION}'")
    if version != CONFIG_VERSION:
        raise ConfigError(
            "version", f"unsupported version {version!r} in {path}; expected {CONFIG_VERSION!r}"
        )
    for key in document:
        if key not in FILE_KEYS:
            raise ConfigError("config file", _unknown_key_reason(key))
    return document


def _unknown_key_reason(key: object) -> str:
    if key == "config":
        return "unknown key 'config' (the config file is chosen by --config or GPUAGENT_CONFIG)"
    close = difflib.get_close_matches(str(key), FILE_KEYS, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown key {key!r}{hint}"


class _Sources:
    """Finds each option's raw value and where it came from, by precedence."""

    def __init__(self, flags: argparse.Namespace, environ: Mapping[str, str]) -> None:
        self._flags = flags
        self._environ = environ
        self._file: dict[str, object] = {}

    def load_file(self, path: Path) -> None:
        self._file = _read_config_file(path)

    def find(self, opt: _Option[Any]) -> tuple[object, str] | None:
        given = getattr(self._flags, opt.dest, None)
        if given is not None:
            spelling, value = given
            return value, spelling
        for env_name in opt.env_names:
            if self._environ.get(env_name):
                return self._environ[env_name], env_name
        if opt.name in self._file:
            return self._file[opt.name], f"config file key {opt.name!r}"
        return None

    def get(self, opt: _Option[T], default: D) -> T | D:
        found = self.find(opt)
        if found is None:
            return default
        raw, label = found
        try:
            return opt.parse(raw)
        except _Invalid as exc:
            raise ConfigError(label, str(exc)) from None

    def label(self, opt: _Option[Any]) -> str:
        found = self.find(opt)
        return found[1] if found else f"--{opt.name}"


def load_settings(
    argv: Sequence[str], environ: Mapping[str, str], *, stderr_isatty: bool = False
) -> Settings:
    """Resolve settings from ``argv`` (without the program name), ``environ`` and the config file.

    Raises ConfigError for any invalid value; argparse exits 2 on usage errors and 0 for
    --help and --version.
    """
    flags = _build_parser().parse_args(_normalize_bool_flags(argv))
    _check_environment(environ)
    sources = _Sources(flags, environ)
    check_config = sources.get(CHECK_CONFIG, None)
    config_file = check_config or sources.get(CONFIG, None)
    if config_file is not None:
        sources.load_file(config_file)

    socket_dir = sources.get(SOCKET_DIR, Path("/var/lib/kubelet/device-plugins"))
    metrics_host, metrics_port = sources.get(METRICS_ADDRESS, ("", 9400))
    simulate = sources.get(SIMULATE, None)
    sim_config = sources.get(SIM_CONFIG, None)
    if simulate is not None and sim_config is not None:
        raise ConfigError(
            sources.label(SIM_CONFIG), f"cannot be combined with {sources.label(SIMULATE)}"
        )
    return Settings(
        socket_dir=socket_dir,
        kubelet_socket=sources.get(KUBELET_SOCKET, socket_dir / "kubelet.sock"),
        pod_resources_socket=sources.get(
            POD_RESOURCES_SOCKET, Path("/var/lib/kubelet/pod-resources/kubelet.sock")
        ),
        metrics_host=metrics_host,
        metrics_port=metrics_port,
        config_file=config_file,
        simulate=simulate,
        sim_config=sim_config,
        resource_name=sources.get(RESOURCE_NAME, "nvidia.com/gpu"),
        device_list_strategy=sources.get(DEVICE_LIST_STRATEGY, (DeviceListStrategy.ENVVAR,)),
        device_id_strategy=sources.get(DEVICE_ID_STRATEGY, IdStrategy.UUID),
        mig_strategy=sources.get(MIG_STRATEGY, MigStrategy.NONE),
        fail_on_init_error=sources.get(FAIL_ON_INIT_ERROR, True),
        pass_device_specs=sources.get(PASS_DEVICE_SPECS, False),
        nvidia_driver_root=sources.get(NVIDIA_DRIVER_ROOT, Path("/")),
        disable_healthchecks=sources.get(DISABLE_HEALTHCHECKS, ""),
        enable_healthchecks=sources.get(ENABLE_HEALTHCHECKS, ""),
        poll_interval=sources.get(POLL_INTERVAL, 5.0),
        nvml_timeout=sources.get(NVML_TIMEOUT, None),
        log_format=sources.get(LOG_FORMAT, "console" if stderr_isatty else "json"),
        log_level=sources.get(LOG_LEVEL, "info"),
        web_config_file=sources.get(WEB_CONFIG_FILE, None),
        hostname_label=sources.get(HOSTNAME_LABEL, "Hostname"),
        no_hostname=sources.get(NO_HOSTNAME, False),
        pod_resources_interval=sources.get(POD_RESOURCES_INTERVAL, 30.0),
        sharing=sources.get(SHARING, TimeSlicing()),
        shared_devices_allocation_policy=sources.get(
            SHARED_DEVICES_ALLOCATION_POLICY, SharedAllocationPolicy.DISTRIBUTED
        ),
        cdi_annotation_prefix=sources.get(CDI_ANNOTATION_PREFIX, "cdi.k8s.io/"),
        cdi_spec_dir=sources.get(CDI_SPEC_DIR, Path("/var/run/cdi")),
        cdi_spec=sources.get(CDI_SPEC, "write"),
        nvidia_cdi_hook_path=str(sources.get(NVIDIA_CDI_HOOK_PATH, Path("/usr/bin/nvidia-ctk"))),
        driver_root_ctr_path=sources.get(DRIVER_ROOT_CTR_PATH, None),
        node_labels=sources.get(NODE_LABELS, True),
        node_labels_file=sources.get(
            NODE_LABELS_FILE,
            Path("/etc/kubernetes/node-feature-discovery/features.d/gpuagent"),
        ),
        machine_type_file=sources.get(MACHINE_TYPE_FILE, Path("/sys/class/dmi/id/product_name")),
        dra_gpus=sources.get(DRA_GPUS, "none"),
        dra_driver_name=sources.get(DRA_DRIVER_NAME, "gpu.nvidia.com"),
        plugins_registry_dir=sources.get(
            PLUGINS_REGISTRY_DIR, Path("/var/lib/kubelet/plugins_registry")
        ),
        plugins_dir=sources.get(PLUGINS_DIR, Path("/var/lib/kubelet/plugins")),
        kubeconfig=sources.get(KUBECONFIG, None),
        proc_root=sources.get(PROC_ROOT, Path("/proc")),
        cri_socket=sources.get(CRI_SOCKET, None),
        dcgm_container_shares=sources.get(DCGM_CONTAINER_SHARES, False),
        kubernetes=sources.get(KUBERNETES, True),
        node_name=environ.get("NODE_NAME", "").strip() or socket.gethostname(),
        check_config=check_config,
    )


# Kubernetes' service links for a Service named "gpuagent" (when enableServiceLinks is on).
_SERVICE_LINK = re.compile(
    r"GPUAGENT_(SERVICE_HOST|SERVICE_PORT(_\w+)?|PORT(_\d+_(TCP|UDP|SCTP)\w*)?)"
)


def _check_environment(environ: Mapping[str, str]) -> None:
    """Refuse a ``GPUAGENT_*`` variable that names no option: a typo must not pass silently."""
    known = {name for opt in OPTIONS for name in opt.env_names}
    for name in sorted(environ):
        if not name.startswith("GPUAGENT_") or name in known or _SERVICE_LINK.fullmatch(name):
            continue
        close = difflib.get_close_matches(name, sorted(known), n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ConfigError(name, f"no such setting{hint}; see gpuagent --help")
