"""How often one node may write to the API server: coalescing, backoff, and rare retries.

A control plane serves thousands of nodes, so each node's writes follow three rules (pure
decisions here; :mod:`gpuagent.kube.pacer` applies them to the API calls):

- **Coalescing.** The first change after a quiet spell goes out at once (after ``settle``, which
  gathers what one fault changes at the same moment); later changes are merged into one write at
  most every ``window`` seconds. However a storm goes, a node writes an object at most twice a
  minute with the default window.
- **Backoff.** An API server that does not answer (or answers 429, 5xx) is retried after a
  full-jitter exponential delay: uniform between 0 and ``min(maximum, initial * 2**(n-1))`` after
  the n-th failure in a row, so nodes that failed together do not come back together. A
  ``Retry-After`` the server sent is honoured: never sooner, and spread over the jitter after it.
- **Rare retries.** A write the server refuses for good reasons (403: no permission; 404: no such
  object) is said once and tried again only every ``rare`` seconds.

``draw`` arguments are uniform random numbers in [0, 1) from the caller (injected, so the
decisions are exact in tests).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Backoff", "Coalescing", "next_heartbeat"]


@dataclass(frozen=True, slots=True)
class Backoff:
    """Full-jitter exponential backoff between ``initial`` and ``maximum`` seconds."""

    initial: float = 0.5
    maximum: float = 60.0
    #: Seconds between tries of a write the server refused (403, 404).
    rare: float = 600.0

    def ceiling(self, failures: int) -> float:
        """The longest delay after ``failures`` (>= 1) failures in a row."""
        exponent = min(max(failures, 1) - 1, 32)  # 2**32 * 0.5 s is past any maximum
        return min(self.maximum, self.initial * 2.0**exponent)

    def delay(self, failures: int, draw: float, retry_after: float | None = None) -> float:
        """Seconds before the next try after ``failures`` failures in a row.

        ``retry_after``: what the server asked for (429, 503); the delay is never shorter, and
        the jitter comes on top of it.
        """
        jitter = _unit(draw) * self.ceiling(failures)
        if retry_after is not None and retry_after > 0:
            return min(retry_after, 3600.0) + jitter
        return jitter


@dataclass(frozen=True, slots=True)
class Coalescing:
    """When a change goes out: at once after a quiet spell, else merged into the next window."""

    window: float = 30.0
    settle: float = 0.2

    def due(self, changed_at: float, last_write: float | None) -> float:
        """The time a change first seen at ``changed_at`` is written, the last write having been
        made at ``last_write`` (``None``: never)."""
        if last_write is None or changed_at - last_write >= self.window:
            return changed_at + self.settle
        return last_write + self.window


def next_heartbeat(last_write: float, interval: float, draw: float) -> float:
    """When an unchanged object is written again to say the writer is alive: ``interval`` to
    ``interval * 1.1`` after the last write (never sooner, so a node at rest makes at most
    ``3600 / interval`` such writes an hour; spread, so nodes started together drift apart)."""
    return last_write + interval * (1.0 + 0.1 * _unit(draw))


def _unit(draw: float) -> float:
    return min(max(draw, 0.0), 1.0)
