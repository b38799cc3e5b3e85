"""The agent's effective configuration, as resolved from flags, environment and config file."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from enum import StrEnum
from pathlib import Path

from gpuagent.config.sharing import sharing_block
from gpuagent.domain.containers import DeviceListStrategy
from gpuagent.domain.devices import IdStrategy
from gpuagent.domain.dra import DraMig
from gpuagent.domain.preferred import SharedAllocationPolicy
from gpuagent.domain.resources import MigStrategy
from gpuagent.domain.timeslicing import TimeSlicing

__all__ = ["Settings"]


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
    dra_mig: DraMig = DraMig.STATIC
    plugins_registry_dir: Path = Path("/var/lib/kubelet/plugins_registry")
    plugins_dir: Path = Path("/var/lib/kubelet/plugins")
    kubeconfig: Path | None = None
    # None: on where the agent has API credentials (decided at start); False/True: as set.
    node_condition: bool | None = None
    events: bool | None = None
    taint_unhealthy_node: bool = False
    node_condition_heartbeat: float = 1800.0
    container_accounting: bool = True
    proc_root: Path = Path("/proc")
    container_logs_dir: Path = Path("/var/log/containers")
    cri_socket: Path | None = None
    dcgm_series_per_container: bool = False
    dcgm_container_shares: bool = False
    detailed_agent_metrics: bool = False
    kubernetes: bool = True
    # The node's name (the host label on every metric): NODE_NAME (the DaemonSet sets it from
    # spec.nodeName), else the host name.
    node_name: str = ""
    check_config: Path | None = None
    # Time limit for NVML work at start-up (seconds); None: scaled with the GPU count.
    nvml_timeout: float | None = None
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
        out: dict[str, object] = {}
        for f in fields(self):
            if f.name == "origins":
                continue
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
