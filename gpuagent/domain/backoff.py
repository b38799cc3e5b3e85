"""Waiting longer after each failure in a row: the agent's one exponential backoff.

After the n-th failure in a row the next try waits up to ``min(maximum, initial * 2**(n-1))``
seconds (:meth:`Backoff.ceiling`). Where many nodes fail together and must not come back
together (the API server's clients), the wait is drawn uniformly between 0 and that ceiling
(full jitter, :meth:`Backoff.delay`: the caller passes the draw, so tests are exact) and a
``Retry-After`` the server sent is honoured; where the agent waits on something of its own node
(the kubelet's sockets, the driver's event wait, a file to write) it waits the ceiling itself.
Each user keeps its own bounds; a success starts the count again.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Backoff"]

#: Doublings past which any maximum is reached (2**32 * 0.5 s is 68 years).
_MAX_EXPONENT = 32
#: The longest ``Retry-After`` honoured (seconds): a server's mistake must not stop a writer.
_MAX_RETRY_AFTER = 3600.0


@dataclass(frozen=True, slots=True)
class Backoff:
    """Exponential backoff between ``initial`` and ``maximum`` seconds (the defaults are the API
    writers')."""

    initial: float = 0.5
    maximum: float = 60.0

    def ceiling(self, failures: int) -> float:
        """The longest wait after ``failures`` (>= 1) failures in a row: ``initial`` after the
        first, doubling after each next, never over ``maximum``."""
        exponent = min(max(failures, 1) - 1, _MAX_EXPONENT)
        return min(self.maximum, self.initial * 2.0**exponent)

    def delay(self, failures: int, draw: float, retry_after: float | None = None) -> float:
        """A full-jitter wait after ``failures`` failures in a row: ``draw`` (uniform in [0, 1))
        of the ceiling. ``retry_after``: what the server asked for (429, 503); the wait is
        never shorter, and the jitter comes on top of it."""
        jitter = min(max(draw, 0.0), 1.0) * self.ceiling(failures)
        if retry_after is not None and retry_after > 0:
            return min(retry_after, _MAX_RETRY_AFTER) + jitter
        return jitter
