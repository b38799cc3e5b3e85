"""Test doubles of the monitor's driver backend, by delegation (never by subclassing ``Nvml``).

:class:`Delegating` forwards every :class:`~gpuagent.gpu.backend.Backend` method to a real
backend; a test double overrides the one it needs to misbehave.
"""

from __future__ import annotations

from gpuagent.domain.devices import DriverState, Gpu, P2PLevel, Topology
from gpuagent.gpu.backend import Backend, DriverEvent, Pair, Probe
from gpuagent.gpu.calls import NvmlCalls
from gpuagent.gpu.topology import GpuLinks


class Delegating:
    """A :class:`Backend` that does what ``inner`` does."""

    def __init__(self, inner: Backend) -> None:
        self.inner = inner

    @property
    def calls(self) -> NvmlCalls:
        return self.inner.calls

    def init(self) -> DriverState:
        return self.inner.init()

    def shutdown(self) -> None:
        self.inner.shutdown()

    def count(self) -> int:
        return self.inner.count()

    def uuid_of(self, index: int) -> str | None:
        return self.inner.uuid_of(index)

    def describe(self, index: int) -> Gpu:
        return self.inner.describe(index)

    def walk_links(self, index: int) -> GpuLinks | None:
        return self.inner.walk_links(index)

    def ancestors(self, index: int) -> list[tuple[Pair, P2PLevel | None]]:
        return self.inner.ancestors(index)

    def begin_topology(self, gpus: tuple[Gpu, ...]) -> None:
        self.inner.begin_topology(gpus)

    def end_topology(
        self, walks: dict[int, GpuLinks | None], levels: dict[Pair, P2PLevel | None]
    ) -> Topology:
        return self.inner.end_topology(walks, levels)

    def refresh_topology(self) -> Topology:
        return self.inner.refresh_topology()

    def create_event_set(self) -> str | None:
        return self.inner.create_event_set()

    def register_events(self, index: int) -> str | None:
        return self.inner.register_events(index)

    def rebuild_events(self, indexes: tuple[int, ...]) -> dict[int, str]:
        return self.inner.rebuild_events(indexes)

    def wait_event(self, timeout_ms: int) -> DriverEvent | None:
        return self.inner.wait_event(timeout_ms)

    def probe(self, index: int) -> Probe:
        return self.inner.probe(index)


def _conforms(backend: Delegating) -> Backend:
    return backend  # mypy checks that Delegating is a Backend
