"""The device plugin's options: the kubelet's sockets, the resources served and how a container
receives them."""

from __future__ import annotations

from pathlib import Path

from gpuagent.config.option import Option
from gpuagent.config.values import (
    one_of,
    parse_bool,
    parse_device_list_strategy,
    parse_path,
    parse_pod_resources_interval,
    parse_resource_name,
    parse_sharing_value,
)
from gpuagent.domain.containers import DeviceListStrategy
from gpuagent.domain.devices import IdStrategy
from gpuagent.domain.preferred import SharedAllocationPolicy
from gpuagent.domain.resources import MigStrategy
from gpuagent.domain.sharing import Sharing

SOCKET_DIR = Option(
    "socket-dir",
    parse_path,
    "where plugin sockets are created (default /var/lib/kubelet/device-plugins)",
    "DIR",
    default=Path("/var/lib/kubelet/device-plugins"),
)
KUBELET_SOCKET = Option(
    "kubelet-socket",
    parse_path,
    "kubelet Registration socket (default <socket-dir>/kubelet.sock)",
    "PATH",
    env_aliases=("KUBELET_SOCKET",),
    default=SOCKET_DIR.default / "kubelet.sock",
)
POD_RESOURCES_SOCKET = Option(
    "pod-resources-socket",
    parse_path,
    "kubelet pod-resources socket (default /var/lib/kubelet/pod-resources/kubelet.sock)",
    "PATH",
    default=Path("/var/lib/kubelet/pod-resources/kubelet.sock"),
)
RESOURCE_NAME = Option(
    "resource-name",
    parse_resource_name,
    "extended resource for full GPUs (default nvidia.com/gpu)",
    "NAME",
    live=True,
    default="nvidia.com/gpu",
)
DEVICE_LIST_STRATEGY: Option[tuple[DeviceListStrategy, ...]] = Option(
    "device-list-strategy",
    parse_device_list_strategy,
    f"comma list of {', '.join(s.value for s in DeviceListStrategy)} (default envvar)",
    "LIST",
    env_aliases=("DEVICE_LIST_STRATEGY",),
    live=True,
    default=(DeviceListStrategy.ENVVAR,),
)
DEVICE_ID_STRATEGY = Option(
    "device-id-strategy",
    one_of(IdStrategy),
    "uuid or index (default uuid)",
    "STRATEGY",
    env_aliases=("DEVICE_ID_STRATEGY",),
    live=True,
    default=IdStrategy.UUID,
)
MIG_STRATEGY = Option(
    "mig-strategy",
    one_of(MigStrategy),
    "none, single or mixed (default none)",
    "STRATEGY",
    env_aliases=("MIG_STRATEGY",),
    live=True,
    default=MigStrategy.NONE,
)
PASS_DEVICE_SPECS = Option(
    "pass-device-specs",
    parse_bool,
    "return device nodes in Allocate responses, except with CDI strategies only, whose spec "
    "brings them (default false)",
    env_aliases=("PASS_DEVICE_SPECS",),
    is_bool=True,
    live=True,
    default=False,
)
POD_RESOURCES_INTERVAL = Option(
    "pod-resources-interval",
    parse_pod_resources_interval,
    "seconds between pod-resources List calls at rest; Allocate triggers one sooner (default 30)",
    "SECONDS",
    default=30.0,
)
SHARING = Option(
    "sharing",
    parse_sharing_value,
    "time-slicing or MPS as in NVIDIA's config file: {timeSlicing: {renameByDefault, "
    "failRequestsGreaterThanOne, resources: [{name, replicas, devices, rename}]}} or "
    "{mps: {...}} of the same shape",
    "YAML",
    live=True,
    default=Sharing(),
)
SHARED_DEVICES_ALLOCATION_POLICY = Option(
    "shared-devices-allocation-policy",
    one_of(SharedAllocationPolicy),
    "preferred placement of replicas and MIG devices: distributed or packed (default distributed)",
    "POLICY",
    env_aliases=("SHARED_DEVICES_ALLOCATION_POLICY",),
    live=True,
    default=SharedAllocationPolicy.DISTRIBUTED,
)
