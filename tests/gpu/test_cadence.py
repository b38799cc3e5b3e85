"""The cadence of the costly readings and the energy figure between reads, as plain values."""

from __future__ import annotations

import pytest

from gpuagent.gpu.cadence import DOUBT, ENERGY, Cadence, EnergyCounter


def test_a_reading_is_due_once_a_period() -> None:
    cadence = Cadence(30.0)
    last = cadence.window(0, 0.0)
    due = []
    for step in range(1, 37):  # three minutes at 5 s
        now = step * 5.0
        if cadence.due(0, now, last):
            due.append(now)
            last = cadence.window(0, now)
    assert due == [30.0, 60.0, 90.0, 120.0, 150.0, 180.0]
    assert cadence.due(0, 0.0, None)  # never taken: due at once


def test_polls_further_apart_than_the_period_take_it_every_poll() -> None:
    cadence = Cadence(30.0)
    last = cadence.window(3, 0.0)
    for step in range(1, 10):
        assert cadence.due(3, step * 45.0, last)
        last = cadence.window(3, step * 45.0)


def test_every_poll() -> None:
    every = Cadence(0.0)
    assert all(every.due(i, t, 7) for i in range(4) for t in (0.0, 0.1, 1e6))
    with pytest.raises(ValueError, match="every poll"):
        every.window(0, 1.0)


@pytest.mark.parametrize("gpus", [2, 8, 16])
def test_gpus_start_their_periods_spread_over_the_period(gpus: int) -> None:
    """Each GPU's period starts at its own time, spread over the period (so a poll round takes
    the reading on a few GPUs, not all): no two within a tenth of an even share of it."""
    period, step = ENERGY.period_s, 0.01
    starts = []
    for index in range(gpus):
        ticks = range(round(period / step))
        first = next(
            n
            for n in ticks
            if ENERGY.window(index, (n + 1) * step) != ENERGY.window(index, n * step)
        )
        starts.append(first * step)
    starts.sort()
    gaps = [b - a for a, b in zip(starts, [*starts[1:], starts[0] + period], strict=True)]
    assert min(gaps) > 0.1 * period / gpus


def test_the_figure_is_the_counter_where_read_and_the_trapezoid_between() -> None:
    energy = EnergyCounter()
    assert energy.advance(300.0, 1.0) is None  # never read: the counter must be
    assert energy.read(1_000_000.0, 300.0, 0.0) == 1_000_000.0
    assert energy.advance(300.0, 5.0) == 1_000_000.0 + 300.0 * 5 * 1000
    assert energy.advance(301.0, 10.0) == pytest.approx(1_000_000.0 + (1500 + 1502.5) * 1000)
    assert energy.read(4_100_000.0, 301.0, 15.0) == 4_100_000.0


def test_the_figure_never_falls_unless_the_counter_does() -> None:
    energy = EnergyCounter()
    energy.read(1_000_000.0, 300.0, 0.0)
    assert energy.advance(300.0, 10.0) == 4_000_000.0  # the load fell meanwhile: overestimated
    assert energy.read(3_500_000.0, 300.0, 10.0) == 4_000_000.0  # held, not lowered
    assert energy.advance(300.0, 11.0) == 4_000_000.0  # 3.8 M: still behind the figure
    assert energy.advance(300.0, 12.0) == 4_100_000.0  # caught up
    assert energy.read(2_000.0, 300.0, 13.0) == 2_000.0  # the driver restarted its counter


def test_no_power_no_estimate() -> None:
    energy = EnergyCounter()
    energy.read(1_000.0, None, 0.0)
    assert energy.advance(300.0, 5.0) is None
    energy.read(1_000.0, 300.0, 5.0)
    assert energy.advance(None, 10.0) is None
    assert energy.advance(300.0, 4.0) is None  # a clock that went back


def test_a_swinging_power_has_the_counter_read() -> None:
    """The trapezoid's doubt (half the swing times the time) past DOUBT of the energy estimated
    since the read: the counter must be read; nothing of the refused step is kept."""
    energy = EnergyCounter()
    energy.read(0.0, 300.0, 0.0)
    swing = 2 * DOUBT * 300.0 * 0.9  # just inside the doubt allowed over one step
    assert energy.advance(300.0 + swing, 5.0) is not None
    before = (energy.estimate_mj, energy.power_w, energy.at)
    assert energy.advance(100.0, 10.0) is None
    assert (energy.estimate_mj, energy.power_w, energy.at) == before
