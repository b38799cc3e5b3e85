"""The DRA side's counts: what the claims' preparer counts as it works (exported, and read by the
benchmark), and the part of it the store's counters hold."""

from __future__ import annotations

from dataclasses import dataclass, field

from gpuagent.state.counters import ClaimCounts

__all__ = ["DraStats"]


@dataclass
class DraStats:
    """Counters of the DRA side (exported, and read by the benchmark)."""

    prepares: int = 0
    prepare_errors: int = 0
    unprepares: int = 0
    # Devices of claims prepared again whose device was gone: prepared again (a MIG device made
    # again, a MIG device found under a new UUID), or the claim refused.
    gone_prepared_again: int = 0
    gone_refused: int = 0
    # Time spent in NodePrepareResources per claim, without the API server read.
    prepare_seconds: list[float] = field(default_factory=list)
    api_read_seconds: list[float] = field(default_factory=list)

    def record(self, samples: list[float], seconds: float) -> None:
        if len(samples) < 100_000:
            samples.append(seconds)

    def counts(self, *, prepared_claims: int) -> ClaimCounts:
        """What the store's counters hold of these, with the claims prepared now."""
        return ClaimCounts(
            prepared_claims=prepared_claims,
            prepares=self.prepares,
            prepare_errors=self.prepare_errors,
            unprepares=self.unprepares,
            gone_prepared_again=self.gone_prepared_again,
            gone_refused=self.gone_refused,
        )
