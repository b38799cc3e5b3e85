"""How the fake driver reads and writes the ctypes arguments pynvml passes to C entry points."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import pynvml

Target = Literal["handle", "index", "uuid", "pci", "none"]


class BadArgument(Exception):
    """An argument is not what the C signature expects; the entry point returns INVALID_ARGUMENT."""


@dataclass(frozen=True)
class Symbol:
    """One C entry point: its implementation and how the dispatcher prepares its call.

    ``impl(state, *args)`` receives the first ``handles`` arguments already resolved from
    ``nvmlDevice_t`` to :class:`~gpuagent.gpu.sim.state.GpuState`. ``target`` says which argument
    names the GPU a per-GPU injected failure applies to; ``lost_ok`` lets the call through on a
    lost GPU; ``needs_init`` makes it fail with UNINITIALIZED before ``nvmlInit``.
    """

    impl: Callable[..., int | bytes]
    handles: int = 0
    target: Target = "none"
    lost_ok: bool = False
    needs_init: bool = True


def device(impl: Callable[..., int], handles: int = 1) -> Symbol:
    """A per-device entry point whose first ``handles`` arguments are ``nvmlDevice_t``."""
    return Symbol(impl=impl, handles=handles, target="handle")


def out(ref: object) -> Any:
    """The object behind an out-parameter (``byref(x)`` or ``pointer(x)``)."""
    obj = getattr(ref, "_obj", None)
    if obj is not None:
        return obj
    if isinstance(ref, ctypes._Pointer):
        try:
            return ref.contents
        except ValueError:
            pass
    raise BadArgument(f"expected a reference, got {type(ref).__name__}")


def as_int(value: object) -> int:
    """A C integer argument: a Python int or a ctypes integer."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    inner = getattr(value, "value", None)
    if isinstance(inner, int) and not isinstance(inner, bool):
        return inner
    raise BadArgument(f"expected an integer, got {type(value).__name__}")


def as_bytes(value: object) -> bytes:
    """A ``const char *`` argument: bytes, or a ``c_char_p``/char array."""
    if isinstance(value, bytes):
        return value
    inner = getattr(value, "value", None)
    if isinstance(inner, bytes):
        return inner
    raise BadArgument(f"expected a string, got {type(value).__name__}")


def write_str(buffer: object, length: object, text: str) -> int:
    """Copy ``text`` into a caller's ``char[length]`` buffer as NVML does."""
    data = text.encode()
    if len(data) + 1 > as_int(length):
        return int(pynvml.NVML_ERROR_INSUFFICIENT_SIZE)
    try:
        buffer.value = data  # type: ignore[attr-defined]
    except (AttributeError, TypeError, ValueError) as exc:
        raise BadArgument(f"expected a char buffer, got {type(buffer).__name__}") from exc
    return int(pynvml.NVML_SUCCESS)
