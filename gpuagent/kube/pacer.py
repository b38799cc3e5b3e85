"""The pacing rules of :mod:`gpuagent.domain.pacing`, applied to one node's API calls.

A writer asks :meth:`Pacer.due` when its pending changes may go out (naming the GPUs and causes
whose health differs from what it last wrote: news goes at once, the rest is merged), makes its
calls through :meth:`Pacer.call` (which counts each, and sorts a failure into one of the
:class:`CallFailed` kinds), and says :meth:`Pacer.done` after a batch went out whole.
Unreachable servers, 429 and 5xx answers put every call of the node into backoff (full jitter;
``Retry-After`` honoured); 403 and 404 refuse only the object they concern, which is tried again
every :attr:`Pacer.rare` seconds (10 minutes) and said once in the log (as is any other refusal,
422 included: retrying soon would not help). Nothing here sleeps: the writer waits on its store
watch with :meth:`due` as the deadline (:meth:`~gpuagent.state.store.Watch.next`), on the
pacer's clock.
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass, field
from typing import Literal, TypeVar

import structlog

from gpuagent.domain.backoff import Backoff
from gpuagent.domain.pacing import RARE_RETRY_S, Budget, Coalescing, NewsKey, Spent
from gpuagent.kube.client import ApiError, ApiUnreachable
from gpuagent.state.clock import Clock

__all__ = ["CallFailed", "Pacer", "RequestCounts"]

log = structlog.get_logger("gpuagent.kube")

T = TypeVar("T")

Result = Literal[
    "ok", "unreachable", "throttled", "server_error", "forbidden", "not_found", "conflict",
    "invalid",
]  # fmt: skip
#: Answers after which every call waits (the server is down or overloaded).
_RETRY_CODES = frozenset({408, 429})


class CallFailed(Exception):
    """A paced call failed: ``retry`` (the server is down, throttles or errs: every call
    backs off), ``refused`` (403, 404: this object waits :attr:`Pacer.rare` seconds),
    ``conflict`` (409; and 404 for a call made with ``absent_is_conflict``: the object is not as
    the writer thought) or ``invalid`` (another refusal: a bug, not retried as such)."""

    def __init__(
        self, kind: Literal["retry", "refused", "conflict", "invalid"], error: str, code: int = 0
    ) -> None:
        super().__init__(error)
        self.kind = kind
        self.error = error
        self.code = code


@dataclass
class RequestCounts:
    """Calls by object and result (``gpuagent_kube_requests_total``)."""

    counts: dict[tuple[str, str], int] = field(default_factory=dict)

    def add(self, obj: str, result: Result) -> None:
        self.counts[(obj, result)] = self.counts.get((obj, result), 0) + 1

    @property
    def total(self) -> int:
        return sum(self.counts.values())


class Pacer:
    """One node's calls to the API server, coalesced and backed off."""

    def __init__(
        self,
        clock: Clock,
        *,
        backoff: Backoff = Backoff(),
        coalescing: Coalescing = Coalescing(),
        budget: Budget = Budget(),
        draw: Callable[[], float] = random.random,
        rare: float = RARE_RETRY_S,
    ) -> None:
        self.clock = clock
        self.backoff = backoff
        self.rare = rare  # seconds between tries of what the server refused
        self.coalescing = coalescing
        self.budget = budget
        self.draw = draw
        self.counts = RequestCounts()
        self.failures = 0  # in a row, of calls that put the node into backoff
        self.error = ""  # the last such failure, "" once a call succeeded
        #: The budget's size: the node's GPU count (the writer sets it as it learns it).
        self.capacity = 1
        self._retry_at: float | None = None
        self._last_write: float | None = None
        self._changed_at: float | None = None
        self._news_at: float | None = None  # news first seen among the pending changes
        self._spent = Spent()
        self._told: dict[NewsKey, float] = {}  # key -> when its last change went out
        self._stirred: set[NewsKey] = set()  # keys changed since the last write
        self._refused: dict[str, tuple[float, str]] = {}  # object -> (until, why)

    # ----- when --------------------------------------------------------------------------------
    def changed(self) -> None:
        """Something new waits to be written (the first change since the last batch counts)."""
        if self._changed_at is None:
            self._changed_at = self.clock.now()

    @property
    def pending(self) -> bool:
        return self._changed_at is not None

    def due(self, changed: Collection[NewsKey] = (), *, fresh: bool = False) -> float | None:
        """When the pending changes may go out (``None``: nothing pending). ``changed``: the GPUs
        and causes whose health differs from what was last written; those that are news (not
        flapping) go out once settled, if the budget has a token, whatever was written before.
        ``fresh``: something never written before waits (a new event): news too, flapping or
        not."""
        if self._changed_at is None:
            return None
        now = self.clock.now()
        self._stirred.update(changed)
        if not fresh and not self.budget.news(changed, self._told, now):
            self._news_at = None
        elif self._news_at is None:
            self._news_at = now
        token_at = self.budget.token_at(self._spent, self.capacity)
        due = self.coalescing.due(self._changed_at, self._last_write, self._news_at, token_at)
        return max(due, self._retry_at) if self._retry_at is not None else due

    def refused(self, obj: str) -> float | None:
        """Until when ``obj`` is refused (403, 404), or ``None``."""
        entry = self._refused.get(obj)
        return entry[0] if entry is not None and entry[0] > self.clock.now() else None

    def done(self, *, wrote: bool) -> None:
        """The batch went out whole (``wrote``: it made a write, which opens the window). A write
        with news spends a token; every GPU and cause whose health changed since the last write
        (and changed back, maybe) flaps for a while: its next change is merged."""
        now = self.clock.now()
        if wrote:
            self._last_write = now
            if self._news_at is not None:
                self._spent = self.budget.spend(self._spent, now, self.capacity)
            for key in self._stirred:
                self._told[key] = now
            for key in [k for k, at in self._told.items() if now - at >= self.budget.flap]:
                del self._told[key]  # long quiet: news again, and kept no longer
        self._changed_at = None
        self._news_at = None
        self._stirred = set()

    # ----- calls -------------------------------------------------------------------------------
    async def call(
        self,
        obj: str,
        call: Awaitable[T],
        *,
        key: str | None = None,
        absent_is_conflict: bool = False,
    ) -> T:
        """Await ``call``, a request about ``obj`` (counted under it); raises
        :class:`CallFailed`. A refusal (403, 404) holds back ``key`` (default ``obj``): what
        :meth:`refused` answers for; with ``absent_is_conflict`` a 404 is a conflict instead
        (the writer's copy is stale: it reads again, it is not refused)."""
        try:
            result = await call
        except ApiUnreachable as exc:
            self._backoff(obj, "unreachable", f"API server unreachable: {exc}", None)
        except ApiError as exc:
            if exc.code == 404 and absent_is_conflict:
                self.counts.add(obj, "not_found")
                raise CallFailed("conflict", str(exc), exc.code) from None
            self._failed(obj, key or obj, exc)
        self.counts.add(obj, "ok")
        self._recovered(key or obj)
        return result

    def _failed(self, obj: str, key: str, exc: ApiError) -> None:
        code = exc.code
        if code in _RETRY_CODES or code >= 500:
            result: Result = "throttled" if code == 429 else "server_error"
            self._backoff(obj, result, f"API server: {exc}", exc.retry_after)
        if code in (401, 403, 404):
            self.counts.add(obj, "not_found" if code == 404 else "forbidden")
            self._refuse(key, str(exc))
            raise CallFailed("refused", str(exc), code)
        if code == 409:
            self.counts.add(obj, "conflict")
            raise CallFailed("conflict", str(exc), code)
        self.counts.add(obj, "invalid")
        self._refuse(key, str(exc))  # a bug or a policy: trying again soon would not help
        raise CallFailed("invalid", str(exc), code)

    def _backoff(self, obj: str, result: Result, error: str, retry_after: float | None) -> None:
        self.counts.add(obj, result)
        self.pause(error, retry_after)
        raise CallFailed("retry", error)

    def pause(self, error: str, retry_after: float | None = None) -> None:
        """Back off every call (one more failure in a row): the server is down, or the writer
        failed in a way it cannot tell apart from that."""
        self.failures += 1
        delay = self.backoff.delay(self.failures, self.draw(), retry_after)
        self._retry_at = self.clock.now() + delay
        if error != self.error:  # once per error, not on every retry
            log.warning("API writes paused; retrying", error=error, delay=round(delay, 3))
        self.error = error

    def _refuse(self, obj: str, why: str) -> None:
        was = self._refused.get(obj)
        self._refused[obj] = (self.clock.now() + self.rare, why)
        if was is None or was[1] != why:
            log.warning(
                "API server refused; trying again rarely",
                object=obj,
                error=why,
                retry_s=self.rare,
            )

    def forget(self, key: str) -> None:
        """Stop holding ``key`` back (the object it was about is gone)."""
        self._refused.pop(key, None)

    def _recovered(self, key: str) -> None:
        if self.error:
            log.info("API writes work again", after_failures=self.failures)
        self.failures = 0
        self.error = ""
        self._retry_at = None
        if self._refused.pop(key, None) is not None:
            log.info("API server accepts again", object=key)
