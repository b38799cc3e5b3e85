"""Settings resolved with flag > environment > config file > default."""

from __future__ import annotations

import socket
from collections.abc import Mapping, Sequence
from pathlib import Path

from gpuagent.config.cli import build_parser, normalize_bool_flags
from gpuagent.config.errors import ConfigError
from gpuagent.config.groups.accounting import (
    CONTAINER_ACCOUNTING,
    CONTAINER_LOGS_DIR,
    CRI_SOCKET,
    DCGM_CONTAINER_SHARES,
    DCGM_SERIES_PER_CONTAINER,
    PROC_ROOT,
)
from gpuagent.config.groups.agent import (
    CHECK_CONFIG,
    CONFIG,
    KUBERNETES,
    LOG_FORMAT,
    LOG_LEVEL,
)
from gpuagent.config.groups.apiserver import (
    EVENTS,
    KUBECONFIG,
    NODE_CONDITION,
    NODE_CONDITION_HEARTBEAT,
    TAINT_UNHEALTHY_NODE,
)
from gpuagent.config.groups.dra import (
    DRA_DRIVER_NAME,
    DRA_GPUS,
    DRA_MIG,
    PLUGINS_DIR,
    PLUGINS_REGISTRY_DIR,
)
from gpuagent.config.groups.driver import (
    DISABLE_HEALTHCHECKS,
    ENABLE_HEALTHCHECKS,
    FAIL_ON_INIT_ERROR,
    NVIDIA_DRIVER_ROOT,
    NVML_TIMEOUT,
    POLL_INTERVAL,
    SIM_CONFIG,
    SIMULATE,
)
from gpuagent.config.groups.kubelet import (
    DEVICE_ID_STRATEGY,
    DEVICE_LIST_STRATEGY,
    KUBELET_SOCKET,
    MIG_STRATEGY,
    PASS_DEVICE_SPECS,
    POD_RESOURCES_INTERVAL,
    POD_RESOURCES_SOCKET,
    RESOURCE_NAME,
    SHARED_DEVICES_ALLOCATION_POLICY,
    SHARING,
    SOCKET_DIR,
)
from gpuagent.config.groups.metrics import (
    DETAILED_AGENT_METRICS,
    HOSTNAME_LABEL,
    METRICS_ADDRESS,
    NO_HOSTNAME,
    WEB_CONFIG_FILE,
)
from gpuagent.config.groups.nodefiles import (
    CDI_ANNOTATION_PREFIX,
    CDI_SPEC,
    CDI_SPEC_DIR,
    DRIVER_ROOT_CTR_PATH,
    MACHINE_TYPE_FILE,
    NODE_LABELS,
    NODE_LABELS_FILE,
    NVIDIA_CDI_HOOK_PATH,
)
from gpuagent.config.options import OPTIONS
from gpuagent.config.settings import Settings
from gpuagent.config.sources import Sources, check_environment
from gpuagent.domain.containers import DeviceListStrategy
from gpuagent.domain.devices import IdStrategy
from gpuagent.domain.dra import DraMig
from gpuagent.domain.preferred import SharedAllocationPolicy
from gpuagent.domain.resources import MigStrategy
from gpuagent.domain.timeslicing import TimeSlicing

__all__ = ["load_settings"]


def load_settings(
    argv: Sequence[str], environ: Mapping[str, str], *, stderr_isatty: bool = False
) -> Settings:
    """Resolve settings from ``argv`` (without the program name), ``environ`` and the config file.

    Raises ConfigError for any invalid value; argparse exits 2 on usage errors and 0 for
    --help and --version.
    """
    flags = build_parser().parse_args(normalize_bool_flags(argv))
    check_environment(environ)
    sources = Sources(flags, environ)
    check_config = sources.get(CHECK_CONFIG, None)
    config_file = check_config or sources.get(CONFIG, None)
    if config_file is not None:
        sources.load_file(config_file, sources.label(CHECK_CONFIG if check_config else CONFIG))

    socket_dir = sources.get(SOCKET_DIR, Path("/var/lib/kubelet/device-plugins"))
    metrics_host, metrics_port = sources.get(METRICS_ADDRESS, ("", 9400))
    simulate = sources.get(SIMULATE, None)
    sim_config = sources.get(SIM_CONFIG, None)
    if simulate is not None and sim_config is not None:
        raise ConfigError(
            sources.label(SIM_CONFIG), f"cannot be combined with {sources.label(SIMULATE)}"
        )
    kubernetes = sources.get(KUBERNETES, True)
    dra_gpus, dra_mig = _dra(sources, kubernetes=kubernetes)
    node_health = _node_health(sources, kubernetes=kubernetes)
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
        dra_gpus=dra_gpus,
        dra_driver_name=sources.get(DRA_DRIVER_NAME, "gpu.nvidia.com"),
        dra_mig=dra_mig,
        plugins_registry_dir=sources.get(
            PLUGINS_REGISTRY_DIR, Path("/var/lib/kubelet/plugins_registry")
        ),
        plugins_dir=sources.get(PLUGINS_DIR, Path("/var/lib/kubelet/plugins")),
        kubeconfig=sources.get(KUBECONFIG, None),
        node_condition=node_health[0],
        events=node_health[1],
        taint_unhealthy_node=node_health[2],
        node_condition_heartbeat=sources.get(NODE_CONDITION_HEARTBEAT, 1800.0),
        container_accounting=sources.get(CONTAINER_ACCOUNTING, True),
        proc_root=sources.get(PROC_ROOT, Path("/proc")),
        container_logs_dir=sources.get(CONTAINER_LOGS_DIR, Path("/var/log/containers")),
        cri_socket=sources.get(CRI_SOCKET, None),
        dcgm_series_per_container=sources.get(DCGM_SERIES_PER_CONTAINER, False),
        dcgm_container_shares=sources.get(DCGM_CONTAINER_SHARES, False),
        detailed_agent_metrics=sources.get(DETAILED_AGENT_METRICS, False),
        kubernetes=kubernetes,
        node_name=environ.get("NODE_NAME", "").strip() or socket.gethostname(),
        check_config=check_config,
        origins={opt.dest: found[1] for opt in OPTIONS if (found := sources.find(opt))},
    )


def _dra(sources: Sources, *, kubernetes: bool) -> tuple[str, DraMig]:
    """``--dra-gpus`` and ``--dra-mig``; refused where they contradict the rest: a GPU for DRA
    would be offered nowhere without Kubernetes (DRA needs the kubelet and the API server), and
    MIG made on demand for no DRA GPU would only take CAP_SYS_ADMIN for nothing."""
    dra_gpus = sources.get(DRA_GPUS, "none")
    dra_mig = sources.get(DRA_MIG, DraMig.STATIC)
    no_dra = dra_gpus.strip().lower() == "none"
    if not kubernetes and not no_dra:
        raise ConfigError(
            sources.label(DRA_GPUS),
            f"cannot be combined with {sources.label(KUBERNETES)} false: DRA serves GPUs "
            "through the kubelet and the API server",
        )
    if dra_mig is DraMig.DYNAMIC and no_dra:
        raise ConfigError(
            sources.label(DRA_MIG),
            f"dynamic cannot be combined with {sources.label(DRA_GPUS)} none: MIG devices are "
            "made on demand only for GPUs served through DRA",
        )
    return dra_gpus, dra_mig


def _node_health(sources: Sources, *, kubernetes: bool) -> tuple[bool | None, bool | None, bool]:
    """``--node-condition``, ``--events`` (``None``: on where credentials exist, decided at
    start) and ``--taint-unhealthy-node``; ``--kubernetes=false`` turns the first two off, and
    cannot be combined with the taint (which needs the API server)."""
    condition: bool | None = sources.get(NODE_CONDITION, None)
    events: bool | None = sources.get(EVENTS, None)
    taint: bool = sources.get(TAINT_UNHEALTHY_NODE, False)
    if kubernetes:
        return condition, events, taint
    if taint:
        raise ConfigError(
            sources.label(TAINT_UNHEALTHY_NODE),
            f"cannot be combined with {sources.label(KUBERNETES)} false: the taint is written "
            "through the API server",
        )
    return False, False, False
