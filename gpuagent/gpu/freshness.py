"""The poller's heartbeat, and readings too old to serve.

Each poll that completes is a heartbeat in the store's counters (``/health`` reads it). A GPU's
readings are served while its last good reading is younger than the freshness limit
(:func:`~gpuagent.domain.readiness.freshness_limit`): after that they are dropped from the store,
as dcgm-exporter serves nothing for a blank reading, until the GPU is read again. A GPU judged
unresponsive has dropped them already (:func:`~gpuagent.gpu.readings.recorded`); this catches the
readings that grow old without that verdict: liveness checks turned off
(``DP_DISABLE_HEALTHCHECKS=all``), probes that fail without being a liveness failure.
"""

from __future__ import annotations

from collections.abc import Callable

import structlog

from gpuagent.domain.health import LOST, UNRESPONSIVE
from gpuagent.gpu.readings import has, map_gpu, without_readings
from gpuagent.state.store import DeviceStore

__all__ = ["Freshness"]

log = structlog.get_logger("gpuagent.monitor")


class Freshness:
    """When each GPU was last read, against ``limit`` seconds of ``clock``."""

    def __init__(self, store: DeviceStore, limit: float, clock: Callable[[], float]) -> None:
        self._store = store
        self._limit = limit
        self._clock = clock
        self._read_at: dict[int, float] = {}
        self._expired: set[int] = set()

    def read(self, index: int) -> None:
        """GPU ``index``'s readings were just put in the store."""
        self._read_at[index] = self._clock()
        if index in self._expired:
            self._expired.discard(index)
            log.info("gpu readings current again", gpu=index)

    def polled(self) -> None:
        """A poll completed (or the GPUs were discovered): a heartbeat, and the readings that are
        now too old dropped (each GPU's logged once, until it is read again)."""
        now = self._clock()
        self._store.counters.polled(now)
        for index, at in self._read_at.items():
            if index not in self._expired and now - at > self._limit:
                self._expired.add(index)
                self._drop(index, round(now - at, 1))

    def _drop(self, index: int, age: float) -> None:
        snapshot = self._store.update(lambda s: map_gpu(s, index, without_readings))
        gpu = snapshot.gpu(index)
        if gpu is not None and not has(gpu, UNRESPONSIVE) and not has(gpu, LOST):
            # (A GPU judged unresponsive or lost has said why, and dropped them already.)
            log.warning(
                "gpu readings too old; not served until the gpu is read again",
                gpu=index,
                read_s_ago=age,
                limit_s=self._limit,
            )
