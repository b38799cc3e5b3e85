"""A simulated NVIDIA driver, injected below pynvml.

:class:`SimDriver` answers NVML's C entry points the way ``libnvidia-ml.so.1`` does, so the real
pynvml wrappers (and the agent's NVML backend above them) run unchanged on simulated GPUs.
Faults are state changes inside the driver that surface only through NVML.
"""

from gpuagent.gpu.sim.config import load_sim_config, node_from_mapping
from gpuagent.gpu.sim.driver import SimDriver, install, installed, uninstall
from gpuagent.gpu.sim.profiles import PROFILES, GpuProfile, find_profile
from gpuagent.gpu.sim.spec import SimConfigError, SimGpuSpec, SimNode, node_from_count

__all__ = [
    "SimConfigError",
    "SimGpuSpec",
    "SimNode",
    "node_from_count",
    "node_from_mapping",
    "load_sim_config",
    "SimDriver",
    "install",
    "uninstall",
    "installed",
    "GpuProfile",
    "PROFILES",
    "find_profile",
]
