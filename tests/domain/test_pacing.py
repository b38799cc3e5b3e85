"""The pacing rules: full-jitter backoff, Retry-After, coalescing windows, heartbeats."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuagent.domain.pacing import Backoff, Coalescing, next_heartbeat


def test_the_ceiling_doubles_from_half_a_second_to_a_minute() -> None:
    backoff = Backoff()
    assert [backoff.ceiling(n) for n in range(1, 10)] == [
        0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0,
    ]  # fmt: skip
    assert backoff.ceiling(10_000) == 60.0


@given(failures=st.integers(1, 200), draw=st.floats(0.0, 1.0))
def test_full_jitter_spreads_a_retry_over_the_whole_ceiling(failures: int, draw: float) -> None:
    backoff = Backoff()
    delay = backoff.delay(failures, draw)
    assert 0.0 <= delay <= backoff.ceiling(failures)
    assert delay == pytest.approx(draw * backoff.ceiling(failures))


def test_nodes_that_failed_together_do_not_retry_together() -> None:
    """The same failure count with different draws gives different delays (no lockstep)."""
    backoff = Backoff()
    delays = {backoff.delay(5, draw) for draw in (0.1, 0.4, 0.7, 0.95)}
    assert len(delays) == 4
    assert max(delays) <= 8.0


@given(retry_after=st.floats(0.5, 600.0), draw=st.floats(0.0, 1.0), failures=st.integers(1, 50))
def test_retry_after_is_never_cut_short(retry_after: float, draw: float, failures: int) -> None:
    backoff = Backoff()
    delay = backoff.delay(failures, draw, retry_after)
    assert retry_after <= delay <= retry_after + backoff.ceiling(failures)


def test_a_429_with_retry_after_5_waits_5_seconds_not_half_a_second() -> None:
    assert Backoff().delay(1, 0.0, 5.0) == 5.0
    assert Backoff().delay(1, 0.0) == 0.0


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


@given(last=st.floats(0, 1e6), interval=st.floats(60, 86_400), draw=st.floats(0, 1))
def test_a_heartbeat_comes_no_sooner_than_its_interval(
    last: float, interval: float, draw: float
) -> None:
    beat = next_heartbeat(last, interval, draw)
    assert last + interval <= beat <= last + interval * 1.1 + 1e-6
