"""When a node file that could not be written is tried again: after its backoff, or at once for
something else to write; the count starts again after a write that works."""

from __future__ import annotations

from gpuagent.domain.backoff import Backoff
from gpuagent.nodefiles.writeretry import WriteRetry


def test_a_failed_write_waits_its_backoff_and_a_new_one_goes_at_once() -> None:
    retry = WriteRetry(Backoff(1.0, 30.0))
    assert retry.due("a", 0.0)
    assert retry.failed("a", "read-only file system", 0.0) is True
    assert (retry.due("a", 0.5), retry.due("a", 1.0)) == (False, True)
    assert retry.retry_at("a") == 1.0
    assert retry.retry_at("b") is None  # not the write that failed: nothing to wait for
    assert retry.due("b", 0.5)
    assert retry.error == "read-only file system"


def test_failures_in_a_row_double_the_wait_and_a_write_that_works_starts_again() -> None:
    retry = WriteRetry(Backoff(1.0, 30.0))
    now, waits = 0.0, []
    for _ in range(7):
        retry.failed("a", "no space left on device", now)
        at = retry.retry_at("a")
        assert at is not None
        waits.append(at - now)
        now = at
    assert waits == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    retry.succeeded("a")
    assert (retry.due("a", now), retry.retry_at("a"), retry.error) == (False, None, "")
    retry.failed("b", "no space left on device", now)
    assert retry.retry_at("b") == now + 1.0


def test_each_error_is_new_once() -> None:
    retry = WriteRetry(Backoff(1.0, 30.0))
    assert [
        retry.failed("a", "read-only file system", 0.0),
        retry.failed("a", "read-only file system", 1.0),
        retry.failed("a", "no space left on device", 3.0),
    ] == [True, False, True]


def test_what_failed_before_another_write_worked_is_written_at_once() -> None:
    """The devices change back to what could not be written, after a write that worked: the
    file on disk is the other's, so it is written now, not after the old backoff."""
    retry = WriteRetry(Backoff(1.0, 30.0))
    retry.failed("a", "read-only file system", 0.0)
    retry.succeeded("b")
    assert retry.due("a", 0.1)
    assert not retry.due("b", 0.1)
