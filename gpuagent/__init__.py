"""gpuagent: one process per GPU node that advertises, health-checks and measures NVIDIA GPUs."""

from importlib import metadata as _metadata

try:
    __version__ = _metadata.version("gpuagent")
except _metadata.PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = ["__version__"]
