"""A cumulative histogram cheap enough to feed on every scrape (the scrape-duration family)."""

from __future__ import annotations

import bisect
from collections.abc import Sequence

__all__ = ["SCRAPE_BUCKETS", "Histogram"]

# Scrape durations, in two buckets (each is a series on every node of a fleet): within the 10 ms
# a scrape that renders a new version is allowed, and within 250 ms (beyond it: something is
# wrong). Prometheus' own scrape_duration_seconds has each scrape's duration as it saw it.
SCRAPE_BUCKETS = (0.01, 0.25)


class Histogram:
    """A cumulative histogram of observations, cheap enough to feed on every scrape."""

    __slots__ = ("_counts", "bounds", "count", "total")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self._counts = [0] * len(self.bounds)
        self.count = 0
        self.total = 0.0

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(self.bounds, value)
        if i < len(self._counts):
            self._counts[i] += 1
        self.count += 1
        self.total += value

    def cumulative(self) -> list[tuple[float, int]]:
        out, running = [], 0
        for bound, n in zip(self.bounds, self._counts, strict=True):
            running += n
            out.append((bound, running))
        return out
