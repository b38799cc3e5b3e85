"""Readiness and freshness: one short, current line saying what the node waits for, and whether
the readings are current (``/health``)."""

from __future__ import annotations

from dataclasses import replace
from types import MappingProxyType

import pytest
from support.nodes import gpu, node

from gpuagent.domain.devices import DriverState, Registration
from gpuagent.domain.readiness import MAX_REASON, freshness, freshness_limit, readiness
from gpuagent.domain.snapshot import Snapshot

GPU = "nvidia.com/gpu"


def registered(snapshot: Snapshot, **states: Registration) -> Snapshot:
    return replace(snapshot, registrations=MappingProxyType(states))


def test_the_way_to_ready() -> None:
    assert readiness(Snapshot()) == "driver unavailable: not initialised yet"
    up = Snapshot(driver=DriverState(up=True, version="580.95.05"))
    assert readiness(up) == "gpus not discovered yet"
    found = node(gpu(0))
    assert readiness(found) == "not registered with the kubelet"
    assert readiness(found, "mig-strategy single: GPUs disagree") == (
        "devices cannot be advertised: mig-strategy single: GPUs disagree"
    )
    assert readiness(registered(found, gpu=Registration(registered=True))) is None


def test_without_kubernetes_ready_once_discovered() -> None:
    assert readiness(node(gpu(0)), kubernetes=False) is None
    assert readiness(Snapshot(), kubernetes=False) == "driver unavailable: not initialised yet"


def test_reasons_name_each_waiting_resource_with_its_current_error() -> None:
    snapshot = registered(
        node(gpu(0)),
        a=Registration(registered=True),
        b=Registration(error="kubelet unreachable"),
        c=Registration(error="waiting for the kubelet socket /x/kubelet.sock"),
    )
    assert readiness(snapshot) == (
        "not registered with the kubelet: b: kubelet unreachable; "
        "c: waiting for the kubelet socket /x/kubelet.sock"
    )


def test_reasons_are_bounded_however_long_the_kubelets_error() -> None:
    long = Registration(error="kubelet refused registration: " + "x" * 5000)
    reason = readiness(registered(node(gpu(0)), a=long, b=long))
    assert reason is not None
    assert len(reason) == MAX_REASON
    assert reason.endswith("…")
    driver = readiness(Snapshot(driver=DriverState(error="y" * 5000)))
    assert driver is not None
    assert len(driver) == MAX_REASON


# ----- freshness (/health) ----------------------------------------------------------------------
UP = DriverState(up=True, version="580.95.05")
DOWN = DriverState(error="NVML Shared Library Not Found (NVML 12)")


def test_the_freshness_limit_is_three_polls_and_the_call_limit() -> None:
    assert freshness_limit(5.0, 10.0) == 25.0  # the defaults
    assert freshness_limit(1.0, 0.5) == 3.5


@pytest.mark.parametrize(
    ("polled_at", "now", "driver", "reason"),
    [
        pytest.param(None, 5.0, DOWN, None, id="starting"),
        pytest.param(None, 500.0, UP, None, id="discovering"),  # bounded by --nvml-timeout
        pytest.param(None, 25.0, DOWN, None, id="driver-down-within-the-limit"),
        pytest.param(None, 25.5, DOWN,
                     "no readings: driver unavailable: NVML Shared Library Not Found (NVML 12)",
                     id="driver-down"),
        pytest.param(None, 26.0, DriverState(), "no readings: driver unavailable: not "
                     "initialised yet", id="driver-not-initialised"),
        pytest.param(100.0, 125.0, UP, None, id="polled-at-the-limit"),
        pytest.param(100.0, 140.4, UP,
                     "collection stalled: no poll completed for 40s (limit 25s)", id="stalled"),
    ],
)  # fmt: skip
def test_freshness(
    polled_at: float | None, now: float, driver: DriverState, reason: str | None
) -> None:
    assert freshness(polled_at, now, 25.0, since=0.0, driver=driver) == reason


def test_a_long_driver_error_is_bounded() -> None:
    down = DriverState(error="x" * 1000)
    reason = freshness(None, 100.0, 25.0, since=0.0, driver=down)
    assert reason is not None
    assert len(reason) == MAX_REASON
