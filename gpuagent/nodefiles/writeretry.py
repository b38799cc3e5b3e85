"""When a node file that could not be written is tried again: no sooner than its backoff allows
after each failure in a row (:class:`~gpuagent.domain.backoff.Backoff`), unless what it is
written from changes; a write that works starts the count again. Pure bookkeeping: the keeper
makes the writes and waits (until :meth:`WriteRetry.retry_at`) on its own clock."""

from __future__ import annotations

from gpuagent.domain.backoff import Backoff

__all__ = ["WriteRetry"]


class WriteRetry:
    """The state of one file's writes, by the key of what each was written from."""

    def __init__(self, backoff: Backoff) -> None:
        self._backoff = backoff
        self._written: object = None  # what the file on disk was last written from
        self._failed: object = None  # what the last write that failed was for
        self._failures = 0  # writes in a row that failed
        self._retry_at = 0.0  # when the write that failed may be tried again
        #: Why the last write failed ("" once one worked).
        self.error = ""

    def due(self, key: object, now: float) -> bool:
        """Whether a write for ``key`` is to be made at ``now``: it is not on disk, and it is
        not the write that failed last with its backoff still running."""
        if key == self._written:
            return False
        return key != self._failed or now >= self._retry_at

    def retry_at(self, key: object) -> float | None:
        """When the write for ``key`` may be tried again, if it is the write that failed last;
        ``None`` otherwise (written, or to be written at once: nothing to wait for)."""
        return self._retry_at if key == self._failed else None

    def failed(self, key: object, error: str, now: float) -> bool:
        """The write for ``key`` failed at ``now`` with ``error``; whether the error is new (to
        be said: not at every try)."""
        new = error != self.error
        self._failures += 1
        self._failed, self.error = key, error
        self._retry_at = now + self._backoff.ceiling(self._failures)
        return new

    def succeeded(self, key: object) -> None:
        """The write for ``key`` worked: the file on disk is ``key``'s."""
        self._written, self._failed, self._failures = key, None, 0
        self.error = ""
