"""The simulated driver installed below pynvml for a test, with NVML initialised."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol

import pynvml

from gpuagent.gpu.sim import SimDriver, installed
from gpuagent.gpu.sim.spec import SimNode

__all__ = ["Run", "nvml_on"]


@contextmanager
def nvml_on(driver: SimDriver) -> Iterator[SimDriver]:
    """``driver`` installed and NVML initialised; NVML shut down and the driver removed after."""
    with installed(driver):
        pynvml.nvmlInit()
        try:
            yield driver
        finally:
            pynvml.nvmlShutdown()


class Run(Protocol):
    """The ``run`` fixture of tests/gpu: ``run(node[, sleep])`` installs a driver for ``node``,
    initialises NVML and returns the driver (removed when the test ends)."""

    def __call__(self, node: SimNode, sleep: Callable[[float], None] = time.sleep) -> SimDriver:
        """A driver for ``node``, its latencies slept with ``sleep``."""
