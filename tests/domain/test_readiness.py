"""Readiness and freshness: one short, current line saying what the node waits for (``/readyz``'s
whole answer, from the snapshot and what the API writers last said), and whether the readings are
current (``/health``)."""

from __future__ import annotations

from dataclasses import replace
from types import MappingProxyType
from typing import Any

import pytest
from support.nodes import gpu, node

from gpuagent.domain.apireach import ApiReach, ApiWriter
from gpuagent.domain.containers import ContainerSettings, DeviceListStrategy
from gpuagent.domain.devices import CdiSpec, DriverState, Registration
from gpuagent.domain.dra import DraGpus, DraPlan
from gpuagent.domain.plan import Plan
from gpuagent.domain.readiness import (
    MAX_REASON,
    Readiness,
    freshness,
    freshness_limit,
    readiness,
)
from gpuagent.domain.serving import ServingPolicy
from gpuagent.domain.snapshot import Snapshot

GPU = "nvidia.com/gpu"


def registered(snapshot: Snapshot, **states: Registration) -> Snapshot:
    return replace(snapshot, registrations=MappingProxyType(states))


def reason(snapshot: Snapshot, resources_error: str = "", **kw: Any) -> str | None:
    return readiness(snapshot, resources_error, **kw).reason


def test_the_way_to_ready() -> None:
    assert reason(Snapshot()) == "driver unavailable: not initialised yet"
    up = Snapshot(driver=DriverState(up=True, version="580.95.05"))
    assert reason(up) == "gpus not discovered yet"
    found = node(gpu(0))
    assert reason(found) == "not registered with the kubelet"
    assert reason(found, "mig-strategy single: GPUs disagree") == (
        "devices cannot be advertised: mig-strategy single: GPUs disagree"
    )
    assert reason(registered(found, gpu=Registration(registered=True))) is None


def test_without_kubernetes_ready_once_discovered() -> None:
    assert reason(node(gpu(0)), kubernetes=False) is None
    assert reason(Snapshot(), kubernetes=False) == "driver unavailable: not initialised yet"


def test_reasons_name_each_waiting_resource_with_its_current_error() -> None:
    snapshot = registered(
        node(gpu(0)),
        a=Registration(registered=True),
        b=Registration(error="kubelet unreachable"),
        c=Registration(error="waiting for the kubelet socket /x/kubelet.sock"),
    )
    assert reason(snapshot) == (
        "not registered with the kubelet: b: kubelet unreachable; "
        "c: waiting for the kubelet socket /x/kubelet.sock"
    )


def test_reasons_are_bounded_however_long_the_kubelets_error() -> None:
    long = Registration(error="kubelet refused registration: " + "x" * 5000)
    said = reason(registered(node(gpu(0)), a=long, b=long))
    assert said is not None
    assert len(said) == MAX_REASON
    assert said.endswith("…")
    driver = reason(Snapshot(driver=DriverState(error="y" * 5000)))
    assert driver is not None
    assert len(driver) == MAX_REASON


# ----- the CDI spec, DRA and the node health's note ----------------------------------------------
READY = registered(node(gpu(0), gpu(1), gpu(2)), gpu=Registration(registered=True))
CDI = ContainerSettings(strategies=(DeviceListStrategy.CDI_ANNOTATIONS,))


def with_plan(snapshot: Snapshot, **plan: Any) -> Snapshot:
    return replace(snapshot, plan=Plan(**plan))


def test_a_cdi_spec_not_written_holds_readiness_where_devices_wait_for_it() -> None:
    failed = replace(READY, cdi=CdiSpec(written=True, error="cannot write /etc/cdi: read-only"))
    gated = with_plan(failed, serving=ServingPolicy(containers=CDI))
    assert reason(gated) == (
        "CDI spec not written (devices it lacks are not offered): cannot write /etc/cdi: read-only"
    )
    assert reason(failed) is None  # envvar: no device waits for the spec
    assert reason(replace(gated, cdi=CdiSpec(written=True))) is None


DRA_ON = with_plan(READY, dra=DraPlan(gpus=DraGpus.parse("1,2")))


def test_dra_waits_for_its_slices_then_its_registration() -> None:
    """Not published: the GPUs given to DRA that no published slice holds are named (offered
    through neither API); then the plugin's registration, with the kubelet's words."""
    snapshot = replace(DRA_ON, dra_registration=Registration())
    assert reason(snapshot) == (
        "DRA: GPUs 1, 2 offered through neither API: ResourceSlices not published: "
        "not published yet"
    )
    down = {"resource_slices": ApiReach(backing_off=True, error="API server unreachable: x")}
    half = replace(snapshot, dra_published=frozenset({"gpu-2"}))
    assert reason(half, api=down) == (
        "DRA: GPU 1 offered through neither API: ResourceSlices not published: "
        "API server unreachable: x"
    )
    up = {"resource_slices": ApiReach(up=True)}
    assert reason(half, api=up) == "DRA: not registered with the kubelet"
    refused = Registration(error="kubelet refused: v2 unknown")
    assert reason(replace(snapshot, dra_registration=refused), api=up) == (
        "DRA: not registered with the kubelet: kubelet refused: v2 unknown"
    )
    accepted = Registration(registered=True)
    assert reason(replace(snapshot, dra_registration=accepted), api=up) is None
    assert reason(DRA_ON) is None  # no DRA side (no registration said): nothing of DRA waits


def test_the_node_healths_wait_is_a_note_ready_or_not() -> None:
    waiting: dict[ApiWriter, ApiReach] = {
        "node_health": ApiReach(backing_off=True, error="API server throttling (429)")
    }
    note = "node health not written: API server throttling (429); retrying\n"
    ready = readiness(READY, api=MappingProxyType(waiting))
    assert ready == Readiness(None, note)
    assert ready.text == f"ready\n{note}"
    unready = readiness(node(gpu(0)), api=MappingProxyType(waiting))
    assert unready.text == f"not registered with the kubelet\n{note}"
    assert readiness(READY, api={"node_health": ApiReach(up=True)}).text == "ready\n"


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
