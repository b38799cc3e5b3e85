"""Where a simulated node keeps the files it stands in for (its ``/proc`` and ``/sys`` trees).

A folder of the node's own, made on first use and removed with the object that owns it (or at
the interpreter's exit). Two hazards are met here, once for every such tree:

* **A read-only root.** The image runs as the DaemonSet runs it: a read-only root file system
  with no ``/tmp``. The temporary directory Python would pick is then unusable, so the folder is
  made under ``/dev/shm`` instead (a tmpfs in every container Kubernetes or podman starts).
* **An agent killed hard** (SIGKILL, the exit on a second signal) runs no finaliser. Each folder
  is named after the process that made it; making one removes the folders of processes that no
  longer exist, so they do not pile up.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import weakref
from pathlib import Path

__all__ = ["FALLBACK", "scratch_folder"]

#: Where the folder is made when the temporary directory cannot be written.
FALLBACK = Path("/dev/shm")
PREFIX = "gpuagent-sim-"


def scratch_folder(owner: object, kind: str, *, fallback: Path = FALLBACK) -> Path:
    """A new, empty folder for ``owner``'s ``kind`` of files (``proc``, ``sys``), removed when
    ``owner`` is collected or at exit. ``OSError`` when neither the temporary directory nor
    ``fallback`` can hold it."""
    prefix = f"{PREFIX}{kind}-{os.getpid()}-"
    try:
        root = Path(tempfile.mkdtemp(prefix=prefix))
    except OSError:  # FileNotFoundError: "No usable temporary directory found"
        root = Path(tempfile.mkdtemp(prefix=prefix, dir=fallback))
    weakref.finalize(owner, shutil.rmtree, root, ignore_errors=True)
    _sweep(root.parent, kind)
    return root


def _sweep(parent: Path, kind: str) -> None:
    """Remove ``kind`` folders in ``parent`` left by processes that are gone."""
    with contextlib.suppress(OSError):
        for path in parent.glob(f"{PREFIX}{kind}-*-*"):
            pid = path.name.removeprefix(f"{PREFIX}{kind}-").partition("-")[0]
            if pid.isdigit() and not _alive(int(pid)):
                shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        return True
    return True
