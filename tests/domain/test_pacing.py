"""The pacing rules: news and coalescing windows, the budget of early writes, heartbeats (the
backoff is tests/domain/test_backoff.py's)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuagent.domain.pacing import Budget, Coalescing, Spent, changed_keys, next_heartbeat


def test_the_first_change_after_a_quiet_spell_goes_out_at_once() -> None:
    pace = Coalescing(window=30.0, settle=0.2)
    assert pace.due(100.0, None) == pytest.approx(100.2)
    assert pace.due(100.0, 60.0) == pytest.approx(100.2)  # 40 s quiet


def test_later_changes_wait_for_the_window_so_at_most_two_writes_a_minute() -> None:
    pace = Coalescing(window=30.0, settle=0.2)
    assert pace.due(101.0, 100.2) == 130.2
    writes: list[float] = []
    pending: float | None = None
    for tick in range(6000):  # a change every second for ten minutes, looked at every 0.1 s
        now = tick / 10
        if tick % 10 == 0 and pending is None:
            pending = now
        if pending is not None and pace.due(pending, writes[-1] if writes else None) <= now:
            writes.append(now)
            pending = None
    assert len(writes) == 20  # two a minute
    assert writes[:3] == [pytest.approx(0.2), pytest.approx(30.2), pytest.approx(60.2)]


def test_news_goes_out_once_settled_whatever_was_written_before() -> None:
    """A fault 5 s after a write is written 0.2 s later, not with the window 30 s after it."""
    pace = Coalescing(window=30.0, settle=0.2)
    assert pace.due(105.0, 100.0) == 130.0  # merged
    assert pace.due(105.0, 100.0, news_at=105.0) == pytest.approx(105.2)
    # Merged changes pending since before the news go out with it.
    assert pace.due(101.0, 100.0, news_at=105.0) == pytest.approx(105.2)


def test_news_without_a_token_waits_for_the_next_one_or_the_window() -> None:
    pace = Coalescing(window=30.0, settle=0.2)
    assert pace.due(105.0, 100.0, news_at=105.0, token_at=112.0) == 112.0
    assert pace.due(105.0, 100.0, news_at=105.0, token_at=140.0) == 130.0  # the window


def test_the_budget_is_the_gpu_count_with_two_back_a_minute() -> None:
    budget = Budget(refill=30.0)
    spent = Spent()
    for second in range(8):  # eight GPUs fail a second apart: each write with news has a token
        assert budget.token_at(spent, 8) <= second
        spent = budget.spend(spent, float(second), 8)
    # The ninth waits for the first token back (they come back continuously: 7 s of its 30).
    assert budget.spent_at(spent, 7.0) == pytest.approx(8.0 - 7.0 / 30.0)
    assert budget.token_at(spent, 8) == pytest.approx(30.0)
    assert budget.spent_at(spent, 67.0) == pytest.approx(8.0 - 67.0 / 30.0)
    assert budget.token_at(budget.spend(spent, 30.0, 8), 8) == pytest.approx(60.0)
    # Never more out than the capacity: a long storm does not dig a deeper hole.
    for second in range(30, 600, 5):
        spent = budget.spend(spent, float(second), 8)
    assert budget.spent_at(spent, 595.0) <= 8.0
    assert budget.token_at(spent, 8) <= 595.0 + 30.0


@given(
    writes=st.lists(st.floats(0.0, 0.5), min_size=1, max_size=400),
    gpus=st.integers(1, 16),
)
def test_writes_with_news_are_at_most_the_gpu_count_and_two_a_minute(
    writes: list[float], gpus: int
) -> None:
    """However the news comes, writes that spend a token keep within capacity + refills."""
    budget = Budget()
    spent, now, made = Spent(), 0.0, 0
    for gap in writes:
        now += gap
        if budget.token_at(spent, gpus) <= now:
            spent = budget.spend(spent, now, gpus)
            made += 1
    assert made <= gpus + now / budget.refill + 1e-9


def test_a_key_that_changed_within_a_minute_of_its_last_write_flaps() -> None:
    budget = Budget(flap=60.0)
    told = {(3, "xid"): 100.0, (5, "lost"): 30.0}
    keys = [(3, "xid"), (5, "lost"), (3, "recovery_action")]
    # GPU 3's XID flaps; GPU 5 quiet for 70 s; GPU 3's recovery action is a new cause: news.
    assert budget.news(keys, told, 100.0 + 59.9) == {(5, "lost"), (3, "recovery_action")}
    assert budget.news(keys, told, 160.0) == set(keys)


def test_changed_keys_compare_what_was_and_what_is() -> None:
    before = {(0, "xid"): frozenset({"gpu-0"}), (1, "lost"): frozenset({"gpu-1"})}
    after = {(0, "xid"): frozenset({"gpu-0"}), (2, "ecc-dbe"): frozenset({"gpu-2"})}
    assert changed_keys(before, after) == {(1, "lost"), (2, "ecc-dbe")}
    assert changed_keys(after, after) == frozenset()


@given(last=st.floats(0, 1e6), interval=st.floats(60, 86_400), draw=st.floats(0, 1))
def test_a_heartbeat_comes_no_sooner_than_its_interval(
    last: float, interval: float, draw: float
) -> None:
    beat = next_heartbeat(last, interval, draw)
    assert last + interval <= beat <= last + interval * 1.1 + 1e-6
