"""How often a written event's series is updated: per series no sooner than the interval, per
node no more than the budget allows (8 at once, one back every 3.75 s: 16 a minute)."""

from __future__ import annotations

from gpuagent.domain.nodehealth import SERIES_INTERVAL, SeriesPacing
from gpuagent.domain.pacing import Spent


def test_a_series_is_due_five_minutes_after_its_last_write() -> None:
    assert SERIES_INTERVAL == 300.0
    assert SeriesPacing().due(100.0) == 400.0


def test_the_budget_allows_8_at_once_and_16_a_minute() -> None:
    pacing = SeriesPacing()
    spent = Spent()
    assert pacing.allowance(spent, 0.0) == 8
    spent = pacing.spend(spent, 10.0, 8)
    assert pacing.allowance(spent, 10.0) == 0
    assert pacing.token_at(spent) == 13.75  # one back after 3.75 s
    assert pacing.allowance(spent, 13.75) == 1
    assert pacing.allowance(spent, 40.0) == 8  # a window later, all of them
    assert pacing.allowance(spent, 130.2 - 100.2 + 10.0) == 8  # a float's slack on the window
    spent = pacing.spend(spent, 40.0, 8)
    assert pacing.allowance(spent, 70.0) == 8  # 8 more a window later: 16 a minute


def test_spending_never_owes_more_than_the_burst() -> None:
    pacing = SeriesPacing()
    spent = pacing.spend(Spent(), 0.0, 20)
    assert spent.tokens == 8.0
    assert pacing.token_at(spent) == 3.75
