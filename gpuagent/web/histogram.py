"""A cumulative histogram cheap enough to feed on every scrape (the scrape-duration family)."""

from __future__ import annotations

import bisect
from collections.abc import Sequence

__all__ = ["SCRAPE_BUCKETS", "Histogram"]

# Scrape durations: from a cached 8-GPU scrape (~0.1 ms) to a slow, first render of a huge node.
SCRAPE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


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
