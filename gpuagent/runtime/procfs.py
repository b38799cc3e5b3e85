"""The container of a process, from ``<proc-root>/<pid>/cgroup`` (root injectable, ``/proc``).

A process's cgroup is read the first time its pid is asked for and cached while the pid keeps
being asked for (it stays on a GPU), unreadable or not; a pid no longer asked for is forgotten, so
a reused pid is read afresh once its old process has left the GPU. Blocking: call it off the
event loop.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from gpuagent.domain.cgroups import CgroupOwner, container_of

__all__ = ["ProcReader"]


class _Unreadable:
    """A pid whose cgroup file could not be read."""


UNREADABLE = _Unreadable()

# A cgroup file is a few hundred bytes; more is not a cgroup file.
MAX_CGROUP_BYTES = 64 * 1024


class ProcReader:
    """Reads which container each process runs in."""

    def __init__(self, root: Path = Path("/proc")) -> None:
        self.root = root
        self._cache: dict[int, CgroupOwner | _Unreadable | None] = {}
        self.reads = 0

    def owners(self, pids: Iterable[int]) -> dict[int, CgroupOwner | None]:
        """The container of each pid (``None``: outside any container). A pid whose file cannot
        be read (the process exited, or ``--proc-root`` does not show it) is left out."""
        cache: dict[int, CgroupOwner | _Unreadable | None] = {}
        for pid in pids:
            if pid in self._cache:
                cache[pid] = self._cache[pid]
                continue
            text = self._read(pid)
            cache[pid] = UNREADABLE if text is None else container_of(text)
        self._cache = cache
        return {pid: o for pid, o in cache.items() if not isinstance(o, _Unreadable)}

    def _read(self, pid: int) -> str | None:
        self.reads += 1
        try:
            with (self.root / str(pid) / "cgroup").open("rb") as f:
                data = f.read(MAX_CGROUP_BYTES)
        except OSError:
            return None
        return data.decode("utf-8", errors="replace")
