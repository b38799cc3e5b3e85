"""The agent's probes as the HTTP server asks them (``/healthz``, ``/readyz``, ``/health``):
each ``None`` when OK, else why not in one line. The verdicts are the domain's
(:mod:`gpuagent.domain.readiness`) over the store's snapshot and counters; this gathers their
inputs."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from gpuagent.domain.readiness import freshness, readiness
from gpuagent.domain.serving import ResourceView, cdi_gated
from gpuagent.state.store import DeviceStore

if TYPE_CHECKING:
    from gpuagent.dra.side import DraSide

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
        dra: DraSide | None,
        *,
        kubernetes: bool,
        freshness_limit: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self.liveness = liveness
        self._view = view
        self._dra = dra
        self._kubernetes = kubernetes
        self._limit = freshness_limit
        self._clock = clock
        self._since = clock()  # the agent's start: before the first poll, what "stalled" counts

    def readiness(self) -> str | None:
        snapshot = self._store.snapshot
        serving = snapshot.plan.serving
        self._view.resources(snapshot, serving)  # builds (or finds cached) them, or the error
        reason = readiness(snapshot, self._view.error, kubernetes=self._kubernetes)
        cdi = snapshot.cdi
        if (
            reason is None
            and cdi is not None
            and cdi.error
            and cdi_gated(snapshot, serving.containers)
        ):
            return f"CDI spec not written (devices it lacks are not offered): {cdi.error}"
        if reason is None and self._dra is not None:
            return self._dra.readiness()
        return reason

    def freshness(self) -> str | None:
        polled_at, driver = self._store.counters.polled_at, self._store.snapshot.driver
        return freshness(polled_at, self._clock(), self._limit, since=self._since, driver=driver)
