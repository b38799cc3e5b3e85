"""Dynamic Resource Allocation's options: which GPUs, the driver name and the kubelet's plugin
folders."""

from __future__ import annotations

from gpuagent.config.option import Option
from gpuagent.config.values import parse_dra_gpus, parse_driver_name, parse_path

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
