"""A clock for the simulated driver's telemetry that only moves when a test moves it."""

from __future__ import annotations


class FakeClock:
    """Seconds, as ``time.monotonic`` would give them; set :attr:`now` to move time."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
