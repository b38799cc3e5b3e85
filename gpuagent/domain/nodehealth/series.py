"""How often the series of an event already written is brought up to date
(:class:`SeriesPacing`): a repeat is news to nobody, so its count and last time are written at
a slow cadence per series, under a budget per node, and the last count once the repeats end.

Kubernetes' own recorder (client-go ``tools/events``) writes an event, its second occurrence
(the series made, count 2), and after that only from its cache: every series every 30 minutes,
and a series' final count once it has been quiet for 6 minutes. Here an event never written is
news (written at once, whatever flaps); a written series is written again no sooner than
``interval`` after its last write, and the node writes at most ``per_minute`` series updates a
minute (``burst`` at once): every GPU of a node flapping through many XID codes (dozens of
series) costs the API server that much, however fast they grow. The longest waiting goes
first; the final count goes out ``interval`` after the last write at the latest, when the budget
allows."""

from __future__ import annotations

import math
from dataclasses import dataclass

from gpuagent.domain.pacing import Spent

__all__ = ["SERIES_INTERVAL", "SeriesPacing"]

#: Seconds between two updates of one event's series, at least.
SERIES_INTERVAL = 300.0
#: A float's slack when tokens come back exactly on a window's time.
_SLACK = 1e-9


@dataclass(frozen=True, slots=True)
class SeriesPacing:
    """When a written series may be updated: ``interval`` after its last write, if the node's
    budget (``per_minute`` updates a minute, ``burst`` at once) has a token."""

    interval: float = SERIES_INTERVAL
    per_minute: int = 16
    burst: int = 8

    @property
    def refill(self) -> float:
        """Seconds for one token to come back."""
        return 60.0 / self.per_minute

    def due(self, written_at: float) -> float:
        """When a series last written at ``written_at`` may be written again."""
        return written_at + self.interval

    def allowance(self, spent: Spent, now: float) -> int:
        """Updates the budget allows at ``now``."""
        return max(0, math.floor(self.burst - spent.out(now, self.refill) + _SLACK))

    def token_at(self, spent: Spent) -> float:
        """When the budget next allows an update (at once, or when a token comes back)."""
        return spent.token_at(self.burst, self.refill)

    def spend(self, spent: Spent, now: float, updates: int) -> Spent:
        """``spent`` after ``updates`` series updates at ``now``."""
        return spent.after(now, self.burst, self.refill, updates)
