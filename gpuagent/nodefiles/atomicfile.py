"""Replacing a file atomically, and only when its content changes.

Readers (the container runtime's CDI registry, node-feature-discovery) watch these directories
and read whole files: they must see the old content or the new, never a partial write. The
content goes to a hidden temporary file beside the target (hidden: NFD skips dot-files, the CDI
registry only reads ``*.json`` and ``*.yaml``), is flushed to disk, then renamed over the target;
the directory is synced so the rename survives a crash.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

__all__ = ["remove_if_present", "write_if_changed"]


def write_if_changed(path: Path, data: bytes, *, mode: int = 0o644) -> bool:
    """Make ``path`` hold ``data``; ``True`` if it was written, ``False`` if it already did.

    Creates missing parent directories. Raises :class:`OSError` (nothing is left behind).
    """
    try:
        if path.read_bytes() == data:
            return False
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            os.fchmod(out.fileno(), mode)
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _sync_directory(path.parent)
    return True


def remove_if_present(path: Path) -> bool:
    """Remove ``path``; ``True`` if it existed."""
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    _sync_directory(path.parent)
    return True


def _sync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
