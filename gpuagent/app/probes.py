"""The agent's probes as the HTTP server asks them (``/healthz``, ``/readyz``, ``/health``):
liveness and freshness each ``None`` when OK, else why not in one line; readiness with the note
said beside it. The verdicts are the domain's (:mod:`gpuagent.domain.readiness`) over the store's
snapshot and counters, one pure function each; this gathers their inputs."""

from __future__ import annotations

import time
from collections.abc import Callable

from gpuagent.domain.readiness import Readiness, freshness, readiness
from gpuagent.domain.serving import ResourceView
from gpuagent.state.store import DeviceStore

__all__ = ["AgentProbes"]


class AgentProbes:
    """Liveness (``liveness``: the supervisor's, the root tasks run), readiness (the GPUs are
    served) and freshness (the readings are current, against ``freshness_limit`` seconds of
    ``clock``)."""

    def __init__(
        self,
        store: DeviceStore,
        liveness: Callable[[], str | None],
        view: ResourceView,
        *,
        kubernetes: bool,
        freshness_limit: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self.liveness = liveness
        self._view = view
        self._kubernetes = kubernetes
        self._limit = freshness_limit
        self._clock = clock
        self._since = clock()  # the agent's start: before the first poll, what "stalled" counts

    def readiness(self) -> Readiness:
        snapshot = self._store.snapshot
        self._view.resources(snapshot, snapshot.plan.serving)  # builds (or finds) them, or why not
        return readiness(
            snapshot,
            self._view.error,
            kubernetes=self._kubernetes,
            api=self._store.counters.api_reach(),
        )

    def freshness(self) -> str | None:
        polled_at, driver = self._store.counters.polled_at, self._store.snapshot.driver
        return freshness(polled_at, self._clock(), self._limit, since=self._since, driver=driver)
