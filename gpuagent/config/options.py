"""Every option, in ``--help`` order (each is defined with its subsystem's, in
:mod:`gpuagent.config.groups`), and the config file's keys."""

from __future__ import annotations

from typing import Any

from gpuagent.config.groups import (
    accounting,
    agent,
    apiserver,
    dra,
    driver,
    kubelet,
    metrics,
    nodefiles,
)
from gpuagent.config.option import Option

OPTIONS: tuple[Option[Any], ...] = (
    kubelet.SOCKET_DIR,
    kubelet.KUBELET_SOCKET,
    kubelet.POD_RESOURCES_SOCKET,
    metrics.METRICS_ADDRESS,
    agent.CONFIG,
    driver.SIMULATE,
    driver.SIM_CONFIG,
    kubelet.RESOURCE_NAME,
    kubelet.DEVICE_LIST_STRATEGY,
    kubelet.DEVICE_ID_STRATEGY,
    kubelet.MIG_STRATEGY,
    driver.FAIL_ON_INIT_ERROR,
    kubelet.PASS_DEVICE_SPECS,
    driver.NVIDIA_DRIVER_ROOT,
    driver.DISABLE_HEALTHCHECKS,
    driver.ENABLE_HEALTHCHECKS,
    driver.POLL_INTERVAL,
    driver.NVML_TIMEOUT,
    agent.LOG_FORMAT,
    agent.LOG_LEVEL,
    metrics.WEB_CONFIG_FILE,
    metrics.HOSTNAME_LABEL,
    metrics.NO_HOSTNAME,
    kubelet.POD_RESOURCES_INTERVAL,
    kubelet.SHARING,
    kubelet.SHARED_DEVICES_ALLOCATION_POLICY,
    nodefiles.CDI_ANNOTATION_PREFIX,
    nodefiles.CDI_SPEC_DIR,
    nodefiles.CDI_SPEC,
    nodefiles.NVIDIA_CDI_HOOK_PATH,
    nodefiles.DRIVER_ROOT_CTR_PATH,
    nodefiles.NODE_LABELS,
    nodefiles.NODE_LABELS_FILE,
    nodefiles.MACHINE_TYPE_FILE,
    dra.DRA_GPUS,
    dra.DRA_DRIVER_NAME,
    dra.PLUGINS_REGISTRY_DIR,
    dra.PLUGINS_DIR,
    apiserver.KUBECONFIG,
    apiserver.NODE_CONDITION,
    apiserver.EVENTS,
    apiserver.TAINT_UNHEALTHY_NODE,
    apiserver.NODE_CONDITION_HEARTBEAT,
    accounting.CONTAINER_ACCOUNTING,
    accounting.PROC_ROOT,
    accounting.CONTAINER_LOGS_DIR,
    accounting.CRI_SOCKET,
    accounting.DCGM_SERIES_PER_CONTAINER,
    accounting.DCGM_CONTAINER_SHARES,
    metrics.DETAILED_AGENT_METRICS,
    agent.KUBERNETES,
    agent.CHECK_CONFIG,
)
FILE_KEYS = tuple(opt.name for opt in OPTIONS if opt.in_file)
