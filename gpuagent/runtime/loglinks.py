"""Container names from the kubelet's container log links (``--container-logs-dir``).

The directory (``/var/log/containers``; the accounting component mounts it read-only) is listed
— names only: no link is followed, no log read — and the names parsed by
:mod:`gpuagent.domain.loglinks`. The listing is cached:

* :meth:`LogLinks.resolve` lists again only when asked for an ID the last listing did not name,
  at most every ``min_interval``; an ID still unnamed afterwards (a process on the host, a
  container outside Kubernetes) is looked for again only after ``retry_interval`` (the kubelet
  makes a container's link just after starting it);
* a listing that fails (the directory is absent or unreadable) keeps the last good one, is counted
  and logged once per problem, and is retried after ``retry_interval``.

Blocking: call it off the event loop.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Collection
from pathlib import Path

import structlog

from gpuagent.domain.devices import PodRef
from gpuagent.domain.loglinks import LogLinkIndex, index_links
from gpuagent.logs import ProblemLog

__all__ = ["DEFAULT_DIR", "MAX_ENTRIES", "LogLinks"]

log = structlog.get_logger("gpuagent.loglinks")

DEFAULT_DIR = Path("/var/log/containers")
#: Entries read from one listing at most (a node runs a few hundred containers).
MAX_ENTRIES = 100_000


class LogLinks:
    """Names of the node's containers from the kubelet's log links, listed on demand."""

    def __init__(
        self,
        directory: Path = DEFAULT_DIR,
        *,
        min_interval: float = 2.0,
        retry_interval: float = 30.0,
        max_entries: int = MAX_ENTRIES,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.directory = directory
        self._min_interval = min_interval
        self._retry_interval = retry_interval
        self._max_entries = max_entries
        self._monotonic = monotonic
        self._index = LogLinkIndex()
        self._unnamed: dict[str, float] = {}  # ID -> when a listing last did not name it
        self._next_allowed = float("-inf")
        self._problems = ProblemLog(log)
        self.listings = 0
        self.errors = 0

    @property
    def containers(self) -> int:
        """Containers named by the last good listing."""
        return len(self._index)

    def resolve(self, ids: Collection[str]) -> dict[str, PodRef]:
        """Names for those of ``ids`` the links name, listing again first if one of them is due
        (never seen, or unnamed for ``retry_interval``)."""
        now = self._monotonic()
        found = self._index.names_for(ids)
        due = [
            i
            for i in ids
            if i not in found and now - self._unnamed.get(i, float("-inf")) >= self._retry_interval
        ]
        if due and now >= self._next_allowed and self.refresh():
            found = self._index.names_for(ids)
            self._unnamed.update((i, now) for i in due if i not in found)
        self._unnamed = {i: t for i, t in self._unnamed.items() if i in ids and i not in found}
        return found

    def refresh(self) -> bool:
        """List the directory once; ``False`` (logged once per problem) when that failed."""
        self._next_allowed = self._monotonic() + self._min_interval
        self.listings += 1
        names: list[str] = []
        try:
            with os.scandir(self.directory) as entries:
                for entry in entries:
                    if len(names) >= self._max_entries:
                        break
                    names.append(entry.name)
        except OSError as exc:
            return self._failed(
                f"kubelet container log links unreadable ({self.directory}: "
                f"{exc.strerror or type(exc).__name__}); containers have no names"
            )
        self._index = index_links(names)
        self._problems.recovered(
            "kubelet container log links readable again", directory=str(self.directory)
        )
        return True

    def _failed(self, problem: str) -> bool:
        self.errors += 1
        self._next_allowed = self._monotonic() + self._retry_interval
        self._problems.failed(problem, retry_in_s=self._retry_interval)
        return False
