"""The node files' options: the CDI spec (and the driver files it names) and the node labels."""

from __future__ import annotations

from pathlib import Path

from gpuagent.config.option import Option
from gpuagent.config.values import (
    choice,
    parse_absolute_path,
    parse_bool,
    parse_path,
    text_nonempty,
)

CDI_SPEC_TOOLKIT = "toolkit"
CDI_SPECS = ("write", CDI_SPEC_TOOLKIT)

CDI_ANNOTATION_PREFIX = Option(
    "cdi-annotation-prefix",
    text_nonempty,
    "annotation prefix of the cdi-annotations strategy (default cdi.k8s.io/)",
    "PREFIX",
    env_aliases=("CDI_ANNOTATION_PREFIX",),
    live=True,
    default="cdi.k8s.io/",
)
CDI_SPEC_DIR = Option(
    "cdi-spec-dir",
    parse_path,
    "where the node's CDI spec is written with a cdi-* strategy (default /var/run/cdi)",
    "DIR",
    default=Path("/var/run/cdi"),
)
CDI_SPEC = Option(
    "cdi-spec",
    choice(CDI_SPECS),
    "with a cdi-* strategy: write the agent's own CDI spec (write), or hand out the NVIDIA "
    "container toolkit's devices nvidia.com/gpu=<id> and write none (toolkit) (default write)",
    "MODE",
    default="write",
)
NVIDIA_CDI_HOOK_PATH = Option(
    "nvidia-cdi-hook-path",
    parse_absolute_path,
    "host path of the container toolkit's hook binary, nvidia-ctk or nvidia-cdi-hook, that the "
    "CDI spec's hooks run (default /usr/bin/nvidia-ctk)",
    "PATH",
    aliases=("--nvidia-ctk-path",),
    env_aliases=("NVIDIA_CDI_HOOK_PATH", "NVIDIA_CTK_PATH"),
    default=Path("/usr/bin/nvidia-ctk"),
)
DRIVER_ROOT_CTR_PATH = Option(
    "driver-root-ctr-path",
    parse_absolute_path,
    "where the agent reads the driver root's files, e.g. a host mount in its container "
    "(default the driver root itself)",
    "DIR",
    aliases=("--container-driver-root",),
    env_aliases=("DRIVER_ROOT_CTR_PATH", "CONTAINER_DRIVER_ROOT"),
    default=None,
)
NODE_LABELS = Option(
    "node-labels",
    parse_bool,
    "write GPU feature labels for node-feature-discovery (default true)",
    is_bool=True,
    default=True,
)
NODE_LABELS_FILE = Option(
    "node-labels-file",
    parse_path,
    "the node-feature-discovery feature file "
    "(default /etc/kubernetes/node-feature-discovery/features.d/gpuagent)",
    "FILE",
    default=Path("/etc/kubernetes/node-feature-discovery/features.d/gpuagent"),
)
MACHINE_TYPE_FILE = Option(
    "machine-type-file",
    parse_path,
    "the machine's product name for the gpu.machine label (default /sys/class/dmi/id/product_name)",
    "FILE",
    env_aliases=("GFD_MACHINE_TYPE_FILE",),
    default=Path("/sys/class/dmi/id/product_name"),
)
