"""The agent's effective configuration, as resolved from flags, environment and config file.

Each field takes its value from one option (:func:`~gpuagent.config.option.setting`), and the
fields' order is the option table's: ``--help``, docs/configuration.md and ``--check-config``
list the options in it. A setting is its option (in its group, :mod:`gpuagent.config.groups`:
parser, default, environment names, help) and its field here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from enum import StrEnum
from pathlib import Path

from gpuagent.config.groups import (
    accounting,
    agent,
    apiserver,
    dra,
    driver,
    kubelet,
    metrics,
    mps,
    nodefiles,
)
from gpuagent.config.option import setting
from gpuagent.config.sharing import sharing_block
from gpuagent.domain.containers import DeviceListStrategy
from gpuagent.domain.devices import IdStrategy
from gpuagent.domain.dra import DraMig
from gpuagent.domain.drashare import DraSharing
from gpuagent.domain.mps import ComputeModeChoice
from gpuagent.domain.preferred import SharedAllocationPolicy
from gpuagent.domain.resources import MigStrategy
from gpuagent.domain.sharing import Sharing

__all__ = ["Settings"]

# Shown after the others by as_dict() (--check-config, the "running with config" log), where
# they were when the output's order was the fields' (they were added last); kept there so that
# the output does not change. A new setting is shown at its field's place.
_SHOWN_LAST = ("nvml_timeout",)


def _host(address: tuple[str, int]) -> str:
    return address[0]


def _port(address: tuple[str, int]) -> int:
    return address[1]


@dataclass(frozen=True, slots=True)
class Settings:
    """The agent's effective configuration: one field per option, in the option table's order."""

    socket_dir: Path = setting(kubelet.SOCKET_DIR)
    kubelet_socket: Path = setting(kubelet.KUBELET_SOCKET)
    pod_resources_socket: Path = setting(kubelet.POD_RESOURCES_SOCKET)
    metrics_host: str = setting(metrics.METRICS_ADDRESS, _host)
    metrics_port: int = setting(metrics.METRICS_ADDRESS, _port)
    # The config file read: --check-config's when given, else --config's.
    config_file: Path | None = setting(agent.CONFIG)
    simulate: int | None = setting(driver.SIMULATE)
    sim_config: Path | None = setting(driver.SIM_CONFIG)
    resource_name: str = setting(kubelet.RESOURCE_NAME)
    device_list_strategy: tuple[DeviceListStrategy, ...] = setting(kubelet.DEVICE_LIST_STRATEGY)
    device_id_strategy: IdStrategy = setting(kubelet.DEVICE_ID_STRATEGY)
    mig_strategy: MigStrategy = setting(kubelet.MIG_STRATEGY)
    fail_on_init_error: bool = setting(driver.FAIL_ON_INIT_ERROR)
    pass_device_specs: bool = setting(kubelet.PASS_DEVICE_SPECS)
    nvidia_driver_root: Path = setting(driver.NVIDIA_DRIVER_ROOT)
    disable_healthchecks: str = setting(driver.DISABLE_HEALTHCHECKS)
    enable_healthchecks: str = setting(driver.ENABLE_HEALTHCHECKS)
    poll_interval: float = setting(driver.POLL_INTERVAL)
    # Time limit for NVML work at start-up (seconds); None: scaled with the GPU count.
    nvml_timeout: float | None = setting(driver.NVML_TIMEOUT)
    log_format: str = setting(agent.LOG_FORMAT)
    log_level: str = setting(agent.LOG_LEVEL)
    web_config_file: Path | None = setting(metrics.WEB_CONFIG_FILE)
    hostname_label: str = setting(metrics.HOSTNAME_LABEL)
    no_hostname: bool = setting(metrics.NO_HOSTNAME)
    pod_resources_interval: float = setting(kubelet.POD_RESOURCES_INTERVAL)
    sharing: Sharing = setting(kubelet.SHARING)
    shared_devices_allocation_policy: SharedAllocationPolicy = setting(
        kubelet.SHARED_DEVICES_ALLOCATION_POLICY
    )
    # MPS sharing: the daemons' directories (a host path the agent sees at the same path), and
    # what is done to a shared GPU's compute mode.
    mps_root: Path = setting(mps.MPS_ROOT)
    mps_compute_mode: ComputeModeChoice = setting(mps.MPS_COMPUTE_MODE)
    cdi_annotation_prefix: str = setting(nodefiles.CDI_ANNOTATION_PREFIX)
    cdi_spec_dir: Path = setting(nodefiles.CDI_SPEC_DIR)
    cdi_spec: str = setting(nodefiles.CDI_SPEC)
    nvidia_cdi_hook_path: str = setting(nodefiles.NVIDIA_CDI_HOOK_PATH, str)
    driver_root_ctr_path: Path | None = setting(nodefiles.DRIVER_ROOT_CTR_PATH)
    node_labels: bool = setting(nodefiles.NODE_LABELS)
    node_labels_file: Path = setting(nodefiles.NODE_LABELS_FILE)
    machine_type_file: Path = setting(nodefiles.MACHINE_TYPE_FILE)
    dra_gpus: str = setting(dra.DRA_GPUS)
    dra_driver_name: str = setting(dra.DRA_DRIVER_NAME)
    dra_mig: DraMig = setting(dra.DRA_MIG)
    dra_sharing: DraSharing = setting(dra.DRA_SHARING)
    plugins_registry_dir: Path = setting(dra.PLUGINS_REGISTRY_DIR)
    plugins_dir: Path = setting(dra.PLUGINS_DIR)
    kubeconfig: Path | None = setting(apiserver.KUBECONFIG)
    # None: on where the agent has API credentials (decided at start); False/True: as set.
    node_condition: bool | None = setting(apiserver.NODE_CONDITION)
    events: bool | None = setting(apiserver.EVENTS)
    taint_unhealthy_node: bool = setting(apiserver.TAINT_UNHEALTHY_NODE)
    node_condition_heartbeat: float = setting(apiserver.NODE_CONDITION_HEARTBEAT)
    container_accounting: bool = setting(accounting.CONTAINER_ACCOUNTING)
    proc_root: Path = setting(accounting.PROC_ROOT)
    container_logs_dir: Path = setting(accounting.CONTAINER_LOGS_DIR)
    cri_socket: Path | None = setting(accounting.CRI_SOCKET)
    dcgm_series_per_container: bool = setting(accounting.DCGM_SERIES_PER_CONTAINER)
    dcgm_container_shares: bool = setting(accounting.DCGM_CONTAINER_SHARES)
    detailed_agent_metrics: bool = setting(metrics.DETAILED_AGENT_METRICS)
    kubernetes: bool = setting(agent.KUBERNETES)
    # The node's name (the host label on every metric): NODE_NAME (the DaemonSet sets it from
    # spec.nodeName), else the host name. Not an option.
    node_name: str = ""
    check_config: Path | None = setting(agent.CHECK_CONFIG)
    # Where each setting the operator gave came from, by option (``disable_healthchecks``): the
    # flag as typed, the variable as set, or the config file's key. Not a setting: a restart with
    # the same values from elsewhere is the same configuration.
    origins: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)

    def named(self, option: str) -> str:
        """Option ``option`` (its dest, ``dra_gpus``) as the operator gave it, for an error to
        name: ``--dra-gpus``, ``GPUAGENT_DRA_GPUS`` or ``config file key 'dra-gpus'``; its
        flag when it was not given."""
        return self.origins.get(option) or f"--{option.replace('_', '-')}"

    def as_dict(self) -> dict[str, object]:
        """Return the settings as JSON-friendly values: paths as strings, tuples as lists, the
        sharing block as NVIDIA's config file spells it."""
        names = [f.name for f in fields(self) if f.name != "origins"]
        shown = [n for n in names if n not in _SHOWN_LAST] + list(_SHOWN_LAST)
        return {name: _shown(getattr(self, name)) for name in shown}


def _shown(value: object) -> object:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, StrEnum):
        return value.value
    if isinstance(value, tuple):
        return [v.value if isinstance(v, StrEnum) else v for v in value]
    if isinstance(value, Sharing):
        return sharing_block(value)
    return value
