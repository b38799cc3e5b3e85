"""The NVML backend's fixtures: a simulated node installed below pynvml, a backend on it, and
that backend started.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.clock import FakeClock

from gpu.nvml.rig import GPUS
from gpuagent.gpu.nvml import (
    Nvml,
)
from gpuagent.gpu.sim import SimDriver, install, node_from_count, uninstall


@pytest.fixture
def driver(clock: FakeClock) -> Iterator[SimDriver]:
    """A 4-GPU simulated node installed below pynvml (not initialised); uninstalled afterwards.

    Its driver answers ``nvmlDeviceGetNumaNodeId`` (as where the GPUs are NUMA nodes), so the
    backend's choice between NVML and sysfs can be tested; the built-in node's does not."""
    drv = SimDriver(dataclasses.replace(node_from_count(GPUS), numa_from_nvml=True), clock=clock)
    install(drv)
    try:
        yield drv
    finally:
        uninstall()


@pytest.fixture
def nvml(driver: SimDriver, clock: FakeClock, tmp_path: Path) -> Iterator[Nvml]:
    """An uninitialised backend reading sysfs from an empty ``tmp_path`` tree; shut down after."""
    backend = Nvml(sysfs_root=tmp_path, clock=clock)
    try:
        yield backend
    finally:
        backend.shutdown()


@pytest.fixture
def ready(nvml: Nvml) -> Nvml:
    """The backend initialised, every GPU discovered and registered for health events."""
    nvml.init()
    assert len(nvml.discover()) == GPUS
    assert nvml.open_events() == {}
    return nvml
