"""pynvml's private API, as the agent and its simulated driver use it (see
:mod:`gpuagent.overrides`)."""

from __future__ import annotations

from typing import Any

import pynvml

__all__ = ["nvml_error_text", "nvml_function", "nvml_library_users", "use_nvml_library"]


def use_nvml_library(library: object | None) -> None:
    """Make pynvml call ``library`` as its NVML library; ``None``: load the real one (and count
    its users from nothing) at the next ``nvmlInit``."""
    with pynvml.libLoadLock:
        pynvml.nvmlLib = library
        pynvml._nvmlGetFunctionPointer_cache.clear()
        if library is None:
            pynvml._nvmlLib_refcount = 0


def nvml_error_text(code: int) -> str | None:
    """pynvml's text for NVML return code ``code``, if it has one."""
    text: str | None = pynvml.NVMLError._errcode_to_string.get(code)
    return text


def nvml_function(name: str) -> Any:
    """The C function ``name`` of the library pynvml uses, as pynvml finds it."""
    return pynvml._nvmlGetFunctionPointer(name)


def nvml_library_users() -> int:
    """How many ``nvmlInit`` calls pynvml counts without their ``nvmlShutdown``."""
    users: int = pynvml._nvmlLib_refcount
    return users
