"""Dynamic Resource Allocation's options: which GPUs, the driver name, whether MIG is made on
demand, whether whole GPUs are shared, and the kubelet's plugin folders."""

from __future__ import annotations

from pathlib import Path

from gpuagent.config.option import Option
from gpuagent.config.values import one_of, parse_dra_gpus, parse_driver_name, parse_path
from gpuagent.domain.dra import DraMig
from gpuagent.domain.drashare import DraSharing

DRA_GPUS = Option(
    "dra-gpus",
    parse_dra_gpus,
    "GPUs served through Dynamic Resource Allocation instead of the device plugin: none, all, "
    "or a comma list of GPU indexes and UUIDs (default none)",
    "none|all|LIST",
    default="none",
)
DRA_DRIVER_NAME = Option(
    "dra-driver-name",
    parse_driver_name,
    "the DRA driver name; NVIDIA's by default, so its DeviceClasses and claims select our "
    "devices (default gpu.nvidia.com)",
    "NAME",
    default="gpu.nvidia.com",
)
DRA_MIG = Option(
    "dra-mig",
    one_of(DraMig),
    "static: DRA publishes a GPU's MIG devices as they are (under mig-strategy); dynamic: "
    "every MIG profile at every placement as partitionable devices, each made when a claim is "
    "prepared and destroyed when it is unprepared (needs CAP_SYS_ADMIN) (default static)",
    "static|dynamic",
    default=DraMig.STATIC,
)
DRA_SHARING = Option(
    "dra-sharing",
    one_of(DraSharing),
    "none: each DRA GPU goes to one claim at a time; mps: each whole DRA GPU is published with "
    "consumable memory and compute (KEP-5075) for claims to share, each claim held to its share "
    "by the GPU's MPS control daemon (under mps-root) (default none)",
    "none|mps",
    default=DraSharing.NONE,
)
PLUGINS_REGISTRY_DIR = Option(
    "plugins-registry-dir",
    parse_path,
    "where the DRA registration socket <driver>-reg.sock is created "
    "(default /var/lib/kubelet/plugins_registry)",
    "DIR",
    default=Path("/var/lib/kubelet/plugins_registry"),
)
PLUGINS_DIR = Option(
    "plugins-dir",
    parse_path,
    "the DRA service socket is <DIR>/<driver>/dra.sock, beside the claims' checkpoint "
    "(default /var/lib/kubelet/plugins)",
    "DIR",
    default=Path("/var/lib/kubelet/plugins"),
)
