"""The device-state store: one versioned, immutable snapshot shared by every adapter."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace

from gpuagent.domain.devices import Snapshot


class DeviceStore:
    """Holds the current :class:`Snapshot`; writers replace it, readers wait for newer versions.

    Used from the event loop's thread only. ``update`` bumps the version only when the new snapshot
    differs from the current one, so watchers wake on real changes.
    """

    def __init__(self, initial: Snapshot | None = None) -> None:
        self._snapshot = initial or Snapshot()
        self._changed = asyncio.Event()

    @property
    def snapshot(self) -> Snapshot:
        return self._snapshot

    def update(self, change: Callable[[Snapshot], Snapshot]) -> Snapshot:
        """Apply ``change`` to the current snapshot; returns the (possibly new) current snapshot."""
        current = self._snapshot
        proposed = change(current)
        if replace(proposed, version=current.version) == current:
            return current
        self._snapshot = replace(proposed, version=current.version + 1)
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()
        return self._snapshot

    async def wait_newer(self, version: int) -> Snapshot:
        """Return the first snapshot whose version is greater than ``version``."""
        while self._snapshot.version <= version:
            await self._changed.wait()
        return self._snapshot
