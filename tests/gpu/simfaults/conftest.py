"""The fault tests' simulated node, initialised, and an event set with every GPU registered."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pynvml
import pytest

from gpu.simfaults.nvmlevents import HEALTH, handle
from gpuagent.gpu.sim import SimDriver, installed, node_from_count


@pytest.fixture
def driver() -> Iterator[SimDriver]:
    """A 4-GPU node, installed below pynvml and initialised."""
    with installed(SimDriver(node_from_count(4))) as drv:
        pynvml.nvmlInit()
        yield drv


@pytest.fixture
def events(driver: SimDriver) -> Iterator[Any]:
    """An event set with every GPU registered for XID, double-bit ECC and recovery events."""
    event_set = pynvml.nvmlEventSetCreate()
    for index in range(4):
        pynvml.nvmlDeviceRegisterEvents(handle(index), HEALTH, event_set)
    yield event_set
    pynvml.nvmlEventSetFree(event_set)
