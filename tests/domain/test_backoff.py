"""The one exponential backoff: its ceiling doubling between each user's bounds, full jitter,
Retry-After."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuagent.domain.backoff import Backoff


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


@pytest.mark.parametrize(
    ("backoff", "waits"),
    [
        (
            Backoff(0.01, 1.0),
            [0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.0, 1.0],
        ),  # kubelet socket
        (Backoff(0.1, 10.0), [0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 6.4, 10.0, 10.0]),  # DRA sockets
        (Backoff(0.5, 30.0), [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]),  # event waits
        (Backoff(1.0, 30.0), [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0, 30.0]),  # the CDI spec
        (Backoff(2.0, 1.0), [1.0] * 9),  # a first wait over the maximum is the maximum
    ],
)
def test_each_users_bounds_double_from_the_first_wait_to_the_maximum(
    backoff: Backoff, waits: list[float]
) -> None:
    assert [backoff.ceiling(n) for n in range(1, 10)] == pytest.approx(waits)
