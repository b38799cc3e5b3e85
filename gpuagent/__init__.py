"""gpuagent: one process per GPU node that advertises, health-checks and measures NVIDIA GPUs."""

from __future__ import annotations

__all__ = ["__version__"]


def __getattr__(name: str) -> str:
    """``__version__``, read from the installed metadata when first asked for: importing
    :mod:`importlib.metadata` costs start-up time the kubelet should not wait for."""
    if name != "__version__":
        raise AttributeError(f"module 'gpuagent' has no attribute {name!r}")
    from importlib import metadata  # noqa: PLC0415

    try:
        version = metadata.version("gpuagent")
    except metadata.PackageNotFoundError:  # running from a source tree that was never installed
        version = "0+unknown"
    globals()["__version__"] = version
    return version
