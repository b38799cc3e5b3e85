"""The telemetry tests' clock, and a 4-GPU H100 node with a backend that has discovered it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from support.clock import FakeClock

from gpu.telemetry.probes import GPUS, START, ready
from gpuagent.gpu.nvml import Nvml
from gpuagent.gpu.sim import (
    SimDriver,
    node_from_count,
)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(START)


@pytest.fixture
def sim(clock: FakeClock, tmp_path: Path) -> Iterator[tuple[SimDriver, Nvml]]:
    """A 4-GPU H100 node (all pairs on NVLink) and a backend that has discovered it."""
    with ready(node_from_count(GPUS), clock, tmp_path) as pair:
        yield pair


@pytest.fixture
def driver(sim: tuple[SimDriver, Nvml]) -> SimDriver:
    return sim[0]


@pytest.fixture
def nvml(sim: tuple[SimDriver, Nvml]) -> Nvml:
    return sim[1]
