"""betterproto2's version, read without :mod:`importlib.metadata` (see :mod:`gpuagent.overrides`).

betterproto2 reads its own version at import (``betterproto2._version``) with
:mod:`importlib.metadata`, which imports ``email``, ``zipfile``, ``csv`` and more: ~11 ms of a start
the kubelet waits for, and nothing else in the agent's start needs it. :func:`install` puts a
module of the same two names in its place, reading the version from the distribution's metadata
file beside the package; the generated protos' compiler check is betterproto2's rule.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from importlib.machinery import PathFinder
from pathlib import Path

__all__ = ["MODULE", "compiler_check", "install", "installed_version"]

MODULE = "betterproto2._version"


def install() -> None:
    """Put betterproto2's version module in place, before betterproto2 is first imported.

    Nothing is done when betterproto2 is imported already, or when its version cannot be read
    from one metadata file beside it (betterproto2 then reads it as it does).
    """
    if "betterproto2" in sys.modules or MODULE in sys.modules:
        return
    version = installed_version()
    if version is None:
        return
    module = types.ModuleType(MODULE, "betterproto2's version (gpuagent.overrides.protoversion)")
    module.__dict__.update(__version__=version, check_compiler_version=compiler_check(version))
    sys.modules[MODULE] = module


def installed_version() -> str | None:
    """The version in betterproto2's ``METADATA`` file, or ``None`` if there is not exactly one
    distribution beside the package, or its file has no version."""
    spec = PathFinder.find_spec("betterproto2")
    locations = list(spec.submodule_search_locations or ()) if spec is not None else []
    if len(locations) != 1:
        return None
    found = list(Path(locations[0]).parent.glob("betterproto2-*.dist-info/METADATA"))
    if len(found) != 1:
        return None
    try:
        text = found[0].read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    for line in text.splitlines():
        if not line:
            break  # the headers end at the first empty line
        name, _, value = line.partition(":")
        if name == "Version":
            return value.strip()
    return None


def compiler_check(library: str) -> Callable[[str], None]:
    """betterproto2's check of generated code against the library's version ``library``: the
    compiler's major and minor version must be the library's, else :class:`ImportError` (raised as
    a generated module is imported)."""

    def check_compiler_version(compiler_version: str) -> None:
        ours = tuple(int(x) for x in library.split(".")[:2])
        theirs = tuple(int(x) for x in compiler_version.split(".")[:2])
        if ours != theirs:
            raise ImportError(
                f"Unsupported version. The proto files were compiled with betterproto2_compiler "
                f"{compiler_version}, which is not compatible with betterproto2 {library}: the "
                "versions x.y.z and a.b.c match if and only if x=a and y=b."
            )

    return check_compiler_version
