"""Fixtures of the driver-side tests; none of their ``nvml-*`` threads outlives its test.

A worker or event thread left running (a call released as the test ends, a wait still blocked)
would go on calling whatever NVML library is installed next — another test's simulated driver —
and log into that test's capture. So uninstalling the simulated driver first waits (on a
deadline) for every ``nvml-*`` thread the test started to end, and fails the test if one does
not; a test that never uninstalls is checked the same way as it ends.

The poller's tests share their simulated node (``driver``) and store here, and the rest of
their set-up in :mod:`gpu.monitoring`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import pynvml
import pytest
from support.mpsdaemon import StandIn, running_daemon
from support.simnvml import Run

from gpu.monitoring import GPUS
from gpuagent.gpu.sim import SimDriver, installed, node_from_count
from gpuagent.gpu.sim import driver as sim_driver
from gpuagent.gpu.sim.spec import SimNode
from gpuagent.state.store import DeviceStore

#: How long a thread may take to end once its test is over (a deadline for a broken test).
WAIT_S = 15.0


def _started_since(before: set[threading.Thread]) -> list[threading.Thread]:
    return [
        t
        for t in threading.enumerate()
        if t not in before and t.name.startswith("nvml-") and t.is_alive()
    ]


def _ended(threads: list[threading.Thread]) -> list[str]:
    """Wait up to :data:`WAIT_S` for ``threads`` to end; the names of those still running."""
    deadline = time.monotonic() + WAIT_S
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return sorted(t.name for t in threads if t.is_alive())


@pytest.fixture(autouse=True)
def no_worker_left_behind(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Fail a test whose ``nvml-*`` threads are still running when the simulated driver is
    uninstalled (by ``installed()`` or a fixture), or when the test is over."""
    before = set(threading.enumerate())
    uninstall = sim_driver.uninstall
    left: list[str] = []

    def checked_uninstall() -> None:
        try:
            left.extend(_ended(_started_since(before)))
        finally:
            uninstall()

    monkeypatch.setattr(sim_driver, "uninstall", checked_uninstall)
    yield
    left.extend(_ended(_started_since(before)))
    if left:
        pytest.fail(f"threads outlived the test: {', '.join(sorted(set(left)))}", pytrace=False)


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


@pytest.fixture
def driver() -> Iterator[SimDriver]:
    """A 4-GPU simulated node installed below pynvml; uninstalled afterwards. No test may use
    NVML as nvml.h forbids (a set freed, or NVML shut down, under a blocked wait)."""
    with installed(SimDriver(node_from_count(GPUS))) as drv:
        yield drv
        assert drv.misuse == []


@pytest.fixture
def mps_daemon(tmp_path: Path) -> Iterator[StandIn]:
    """A stand-in MPS control daemon: an MPS client on a simulated GPU needs one answering (the
    simulated driver runs a process without one as CUDA does, without MPS)."""
    with running_daemon(
        tmp_path / "driver", tmp_path / "mps" / "pipe", tmp_path / "mps" / "log"
    ) as daemon:
        yield daemon


@pytest.fixture
def store() -> DeviceStore:
    return DeviceStore()
