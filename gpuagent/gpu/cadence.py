"""How often the costly readings of a GPU are taken, and the energy counter between two reads.

Most of a probe's readings cost the driver microseconds and are taken every poll. A few cost
milliseconds on a real driver and say nothing a reader loses by waiting (measured on an H200,
driver 580.159, ``../shared/reference/real-h200/``): the total-energy counter (3.2 ms median, 5.8
ms mean; it moves more slowly than it can be read) and the throttling times where the field
values do not carry them (``nvmlDeviceGetViolationStatus``, 0.6 ms each). They are taken once a
:class:`Cadence` period, the GPUs staggered so that a poll round never takes them all at once.

Between two reads of the energy counter, :class:`EnergyCounter` advances it by the GPU's power
as read each poll (the trapezoid between two polls), so every poll still has an energy figure
for the consumers that take differences of it (per-container energy, ``rate()`` of
``DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION``). Each read of the counter puts the figure back on the
driver's value, so the estimate's error never builds up beyond one period's; the figure never
falls (an estimate ahead of the counter waits for it), except when the counter itself does (the
driver restarted it). And the counter is read sooner when the power moved so much between polls
that the trapezoid may be off by more than :data:`DOUBT` of the energy since the last read (a
bursty load): a GPU at rest or under a steady load reads it once a period, a bursty one up to
every poll. tests/gpu/test_poll_cadence.py measures what consumers see against reading it every
poll; docs/metrics.md states the tolerances.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["DOUBT", "ENERGY", "VIOLATIONS", "Cadence", "EnergyCounter"]

#: The golden ratio's fractional part: GPU ``i``'s periods start ``i * PHI`` periods late (mod
#: 1), so any number of GPUs spread evenly over a period, whatever their count.
PHI = (math.sqrt(5.0) - 1.0) / 2.0


@dataclass(frozen=True, slots=True)
class Cadence:
    """A reading taken once every ``period_s`` seconds of the reader's clock (at most once a
    poll; every poll when the polls are further apart), GPU ``i``'s periods shifted by
    ``phase + i * PHI`` periods. ``period_s`` 0: every poll."""

    period_s: float
    phase: float = 0.0

    def window(self, index: int, now: float) -> int:
        """The number of GPU ``index``'s period that ``now`` falls in."""
        if self.period_s <= 0:
            raise ValueError("a cadence of every poll has no windows")
        shift = (self.phase + index * PHI) % 1.0
        return math.floor(now / self.period_s + shift)

    def due(self, index: int, now: float, last: int | None) -> bool:
        """Whether the reading is due at ``now``, last taken in window ``last`` (None: never)."""
        return self.period_s <= 0 or last is None or self.window(index, now) != last


#: The total-energy counter: once in 30 s (dcgm-exporter's default collection interval), power
#: integrated between reads.
ENERGY = Cadence(30.0)
#: Throttling times read by a call of their own (not from the field values): once in 30 s, half
#: a period away from the energy read.
VIOLATIONS = Cadence(30.0, phase=0.5)


#: How far the trapezoid may be off (the power's swing between polls, halved, times the time)
#: as a share of the energy it estimated since the counter was read, before the counter is read
#: again, due or not.
DOUBT = 0.05


@dataclass(slots=True)
class EnergyCounter:
    """One GPU's energy figure (mJ): the driver's counter where read, power integrated between.

    ``counted_mj`` is the counter as last read, ``estimate_mj`` that plus the power integrated
    since, ``served_mj`` what was last handed out (never less than before unless the counter
    fell); ``power_w`` and ``at`` the last poll's power and time; ``doubt_mj`` how far the
    estimate may be off, summed since the read.
    """

    counted_mj: float | None = None
    estimate_mj: float = 0.0
    served_mj: float = 0.0
    power_w: float | None = None
    at: float = 0.0
    doubt_mj: float = 0.0

    def read(self, counter_mj: float, power_w: float | None, now: float) -> float:
        """The driver's counter was read at ``now``: the figure to serve."""
        if self.counted_mj is None or counter_mj < self.counted_mj:
            served = counter_mj  # the first read, or the driver restarted its counter
        else:
            served = max(self.served_mj, counter_mj)
        self.counted_mj = self.estimate_mj = counter_mj
        self.served_mj, self.power_w, self.at = served, power_w, now
        self.doubt_mj = 0.0
        return served

    def advance(self, power_w: float | None, now: float) -> float | None:
        """The figure at ``now`` from the power read then; None when the counter must be read
        instead: never read, no power now or at the last poll, or too much doubt."""
        if self.counted_mj is None or power_w is None or self.power_w is None or now < self.at:
            return None
        seconds = now - self.at
        estimate = self.estimate_mj + (self.power_w + power_w) / 2.0 * seconds * 1000.0
        doubt = self.doubt_mj + abs(self.power_w - power_w) / 2.0 * seconds * 1000.0
        if doubt > DOUBT * (estimate - self.counted_mj):
            return None
        self.estimate_mj, self.doubt_mj = estimate, doubt
        self.served_mj = max(self.served_mj, estimate)
        self.power_w, self.at = power_w, now
        return float(math.floor(self.served_mj))  # whole mJ, as the driver counts
