"""Readiness: one short, current line saying what the node waits for."""

from __future__ import annotations

from dataclasses import replace
from types import MappingProxyType

from support.nodes import gpu, node

from gpuagent.domain.devices import DriverState, Registration
from gpuagent.domain.readiness import MAX_REASON, readiness
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
