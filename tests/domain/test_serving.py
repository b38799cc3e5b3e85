"""What the device plugin may offer while the CDI spec on disk lags the devices."""

from __future__ import annotations

from dataclasses import replace

import pytest
from support.nodes import gpu, gpu_uuid, mig, mig_uuid, node

from gpuagent.domain.containers import TOOLKIT_CDI_KIND, ContainerSettings, DeviceListStrategy
from gpuagent.domain.devices import CdiSpec, IdStrategy
from gpuagent.domain.resources import MigStrategy, ResourceSettings
from gpuagent.domain.serving import (
    ResourceView,
    ServingPolicy,
    awaits_cdi_spec,
    cdi_gated,
    spec_devices,
)
from gpuagent.domain.snapshot import Snapshot

CRI = ContainerSettings(strategies=(DeviceListStrategy.CDI_CRI,))
ENVVAR = ContainerSettings()
TOOLKIT = replace(CRI, cdi_kind=TOOLKIT_CDI_KIND)
MIXED = ResourceSettings(mig_strategy=MigStrategy.MIXED)
NODE = node(gpu(0), gpu(1, migs=[mig(1, 7), mig(1, 8)], mig_enabled=True), gpu(2))


def offered(snapshot: Snapshot, containers: ContainerSettings) -> dict[str, tuple[str, ...]]:
    """The device IDs of each resource the view builds for ``snapshot``."""
    serving = ServingPolicy(resources=MIXED, containers=containers)
    return {r.name: r.ids for r in ResourceView().resources(snapshot, serving).resources}


def test_the_spec_defines_every_device_by_uuid_and_index() -> None:
    assert spec_devices(NODE) == {
        (gpu_uuid(0), "0"), (gpu_uuid(1), "1"), (mig_uuid(1, 7), "1:0"), (mig_uuid(1, 8), "1:1"),
        (gpu_uuid(2), "2"),
    }  # fmt: skip


def test_devices_the_spec_lacks_are_not_offered_under_cdi() -> None:
    """GPU 2 and MIG device 1:1 appeared after the spec was written: kept back, while their
    resources stay (so do the registrations)."""
    old = node(gpu(0), gpu(1, migs=[mig(1, 7)], mig_enabled=True))
    lagging = replace(NODE, cdi=CdiSpec(devices=spec_devices(old), written=True))
    assert offered(lagging, CRI) == {
        "nvidia.com/gpu": (gpu_uuid(0),),
        "nvidia.com/mig-1g.10gb": (mig_uuid(1, 7),),
    }
    caught_up = replace(NODE, cdi=CdiSpec(devices=spec_devices(NODE), written=True))
    assert offered(caught_up, CRI) == offered(NODE, ENVVAR)
    by_index = replace(CRI, id_strategy=IdStrategy.INDEX)  # the containers' names: both defined
    assert offered(caught_up, by_index) == offered(NODE, ENVVAR)


def test_a_device_whose_index_names_another_in_the_spec_is_not_offered() -> None:
    """GPUs 0 and 1 swapped indexes since the spec was written: neither name pair is defined."""
    swapped = node(replace(gpu(0), index=1), replace(gpu(1), index=0))
    stale = replace(swapped, cdi=CdiSpec(devices=spec_devices(node(gpu(0), gpu(1))), written=True))
    assert offered(stale, CRI) == {"nvidia.com/gpu": ()}


@pytest.mark.parametrize(
    ("cdi", "containers"),
    [
        pytest.param(CdiSpec(), ENVVAR, id="envvar"),
        pytest.param(CdiSpec(), TOOLKIT, id="toolkit-spec"),
        pytest.param(None, CRI, id="no-spec-kept"),
    ],
)
def test_nothing_waits_without_a_spec_of_the_agents_in_use(
    cdi: CdiSpec | None, containers: ContainerSettings
) -> None:
    snapshot = replace(NODE, cdi=cdi)
    assert not cdi_gated(snapshot, containers)
    assert not awaits_cdi_spec(snapshot, containers)
    assert offered(snapshot, containers) == offered(NODE, ENVVAR)


def test_the_first_device_list_waits_for_the_first_write() -> None:
    assert awaits_cdi_spec(replace(NODE, cdi=CdiSpec()), CRI)
    failed = CdiSpec(written=True, error="read-only file system")
    assert not awaits_cdi_spec(replace(NODE, cdi=failed), CRI)  # tried: /readyz says why
    assert offered(replace(NODE, cdi=failed), CRI) == {
        "nvidia.com/gpu": (),
        "nvidia.com/mig-1g.10gb": (),
    }
