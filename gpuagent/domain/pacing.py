"""How often one node may write to the API server: news, coalescing, backoff, and rare retries.

A control plane serves thousands of nodes, so each node's writes follow these rules (pure
decisions here; :mod:`gpuagent.kube.pacer` applies them to the API calls):

- **News goes at once.** A change of a GPU's health (a cause that appears or clears: a fault, a
  recovery) is written after ``settle`` (which gathers what one fault changes at the same
  moment), whatever was written before. What is news is decided per :data:`NewsKey` (a GPU and
  a cause): a key whose change went out less than ``Budget.flap`` seconds ago flaps, and its
  further changes are merged like any other. Each write that carries news spends a token of the
  writer's :class:`Budget` (as many as the node has GPUs, one back every ``Budget.refill``
  seconds); with none left, news waits for the next token or the window, whichever is sooner.
- **Coalescing.** Every other change (a claim, a message's wording, a repeat of a fault on a GPU
  already unhealthy) goes out at once after a quiet spell; later ones are merged into one write at
  most every ``window`` seconds. However a storm goes, its merged writes are at most two a minute
  with the default window, and a storm changes no cause after its first (repeats of a cause are
  not news), so it spends at most one token per GPU and cause.
- **Backoff.** An API server that does not answer (or answers 429, 5xx) is retried after a
  full-jitter exponential delay (:class:`~gpuagent.domain.backoff.Backoff`, 0.5 s to 60 s):
  uniform between 0 and ``min(maximum, initial * 2**(n-1))`` after the n-th failure in a row, so
  nodes that failed together do not come back together. A ``Retry-After`` the server sent is
  honoured: never sooner, and spread over the jitter after it.
- **Rare retries.** A write the server refuses for good reasons (403: no permission; 404: no such
  object) is said once and tried again only every :data:`RARE_RETRY_S` seconds.

``draw`` arguments are uniform random numbers in [0, 1) from the caller (injected, so the
decisions are exact in tests).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import TypeVar

__all__ = [
    "RARE_RETRY_S", "Budget", "Coalescing", "NewsKey", "Spent", "changed_keys", "next_heartbeat",
]  # fmt: skip

#: A float's slack when tokens come back exactly on a window's time.
_SLACK = 1e-9

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

#: What a change of health is news about: a GPU (its index) and a cause (a condition's kind, or
#: the taint key that says it).
NewsKey = tuple[int, str]
#: Seconds between tries of a write the server refused (403: no permission; 404: no such object).
RARE_RETRY_S = 600.0


@dataclass(frozen=True, slots=True)
class Coalescing:
    """When a change goes out: news and the first change after a quiet spell at once, the rest
    merged into the next window."""

    window: float = 30.0
    settle: float = 0.2

    def due(
        self,
        changed_at: float,
        last_write: float | None,
        news_at: float | None = None,
        token_at: float = 0.0,
    ) -> float:
        """The time a change first seen at ``changed_at`` is written, the last write having been
        made at ``last_write`` (``None``: never). ``news_at``: when news (a change of health not
        flapping) was first seen among the pending changes, ``None`` if none is; it goes out
        once settled and a token is there (``token_at``, :meth:`Budget.token_at`), or with the
        window if that comes sooner."""
        if last_write is None or changed_at - last_write >= self.window:
            merged = changed_at + self.settle
        else:
            merged = last_write + self.window
        if news_at is None:
            return merged
        return min(merged, max(news_at + self.settle, token_at))


@dataclass(frozen=True, slots=True)
class Spent:
    """Tokens of a budget spent, as counted at ``at``: a token bucket of ``capacity`` tokens, one
    back every ``refill`` seconds (the arithmetic of :class:`Budget` and of event series'
    pacing)."""

    tokens: float = 0.0
    at: float = 0.0

    def out(self, now: float, refill: float) -> float:
        """The tokens still out at ``now``."""
        return max(0.0, self.tokens - max(0.0, now - self.at) / refill)

    def token_at(self, capacity: int, refill: float) -> float:
        """When a token is there to spend (at once, or when the next one comes back)."""
        over = self.tokens - (capacity - 1)
        return self.at + over * refill if over > _SLACK else self.at

    def after(self, now: float, capacity: int, refill: float, count: int = 1) -> Spent:
        """These after ``count`` more are spent at ``now`` (never more out than ``capacity``)."""
        return Spent(min(float(capacity), self.out(now, refill) + count), now)


@dataclass(frozen=True, slots=True)
class Budget:
    """How much news one writer sends early: a token per write that carries news, out of as many
    as the node has GPUs (``capacity``, the caller's), one back every ``refill`` seconds (two a
    minute); and which changes are news at all (a key that changed within ``flap`` seconds of
    its last change going out flaps: its changes are merged)."""

    refill: float = 30.0
    flap: float = 60.0

    def spent_at(self, spent: Spent, now: float) -> float:
        """The tokens still out at ``now``."""
        return spent.out(now, self.refill)

    def token_at(self, spent: Spent, capacity: int) -> float:
        """When a token is there to spend (at once, or when the next one comes back)."""
        return spent.token_at(max(capacity, 1), self.refill)

    def spend(self, spent: Spent, now: float, capacity: int) -> Spent:
        """``spent`` after a write with news at ``now`` (never more out than ``capacity``)."""
        return spent.after(now, max(capacity, 1), self.refill)

    def news(self, keys: Iterable[K], told: Mapping[K, float], now: float) -> frozenset[K]:
        """The keys of ``keys`` (changed since last written) that are news at ``now``: those
        whose last change went out (``told``) ``flap`` seconds ago or more, or never."""
        return frozenset(k for k in keys if k not in told or now - told[k] >= self.flap)


def changed_keys(before: Mapping[K, V], after: Mapping[K, V]) -> frozenset[K]:
    """The keys whose values differ between ``before`` and ``after`` (absent counts as a value)."""
    return frozenset(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))


def next_heartbeat(last_write: float, interval: float, draw: float) -> float:
    """When an unchanged object is written again to say the writer is alive: ``interval`` to
    ``interval * 1.1`` after the last write (never sooner, so a node at rest makes at most
    ``3600 / interval`` such writes an hour; spread, so nodes started together drift apart)."""
    return last_write + interval * (1.0 + 0.1 * _unit(draw))


def _unit(draw: float) -> float:
    return min(max(draw, 0.0), 1.0)
