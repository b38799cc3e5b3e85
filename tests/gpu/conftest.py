"""Fixtures of the driver-side tests."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack

import pynvml
import pytest
from support.simnvml import Run

from gpuagent.gpu.sim import SimDriver, installed
from gpuagent.gpu.sim.spec import SimNode


@pytest.fixture
def run() -> Iterator[Run]:
    """``run(node[, sleep])`` installs a driver for ``node``, initialises NVML and returns the
    driver; the driver is removed when the test ends."""
    with ExitStack() as stack:

        def start(node: SimNode, sleep: Callable[[float], None] = time.sleep) -> SimDriver:
            driver = stack.enter_context(installed(SimDriver(node, sleep=sleep)))
            pynvml.nvmlInit()
            return driver

        yield start
