"""Discovery carries MIG devices and the node's topology into the store, read once."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from support.waiting import eventually

from gpuagent.domain.devices import P2PLevel
from gpuagent.gpu.monitor import GpuMonitor
from gpuagent.gpu.nvml import Nvml
from gpuagent.gpu.sim import SimDriver, installed, node_from_mapping
from gpuagent.gpu.sim.spec import mig_minors_text
from gpuagent.state.store import DeviceStore

NODE = {
    "version": "v1",
    "gpus": [
        {"name": "H100", "numa_node": 0, "mig": ["3g.40gb", "2g.20gb", "1g.10gb"]},
        {"name": "H100", "numa_node": 0},
        {"name": "H100", "numa_node": 1},
    ],
    "nvlinks": [[1, 2, 18]],
}


@pytest.fixture
def driver() -> Iterator[SimDriver]:
    sim = SimDriver(node_from_mapping(NODE))
    with installed(sim):
        yield sim


async def test_mig_devices_and_topology_reach_the_store(driver: SimDriver, tmp_path: Path) -> None:
    minors = tmp_path / "mig-minors"
    minors.write_text(mig_minors_text(driver.node))
    store = DeviceStore()
    monitor = GpuMonitor(store, Nvml(tmp_path, mig_minors=minors), poll_interval=60)
    try:
        await monitor.start()
        topology_calls = driver.calls["nvmlDeviceGetTopologyCommonAncestor"]
        await monitor.poll_once()
        await monitor.poll_once()
    finally:
        await monitor.close()
    snapshot = store.snapshot
    first = snapshot.gpu(0)
    assert first is not None
    assert first.mig_enabled
    assert sorted(m.profile for m in first.mig_devices) == ["1g.10gb", "2g.20gb", "3g.40gb"]
    assert all(m.uuid.startswith("MIG-") for m in first.mig_devices)
    assert all(len(m.device_nodes) == 2 for m in first.mig_devices)
    second = snapshot.gpu(1)
    assert second is not None
    assert not second.mig_enabled
    link = snapshot.topology.between(1, 2)
    assert link is not None
    assert link.nvlinks == 18
    assert link.p2p is P2PLevel.SYSTEM
    other = snapshot.topology.between(0, 1)
    assert other is not None
    assert other.nvlinks == 0
    assert other.p2p is P2PLevel.NODE
    # Topology is read at discovery only: probes never ask for it again.
    assert topology_calls == 3  # one per pair
    assert driver.calls["nvmlDeviceGetTopologyCommonAncestor"] == topology_calls


async def test_topology_is_read_again_when_a_lost_gpu_answers(
    driver: SimDriver, tmp_path: Path
) -> None:
    store = DeviceStore()
    monitor = GpuMonitor(store, Nvml(tmp_path), poll_interval=60)
    try:
        await monitor.start()
        reads = driver.calls["nvmlDeviceGetTopologyCommonAncestor"]
        driver.inject(1, "lost")
        await monitor.poll_once()
        lost = store.snapshot.gpu(1)
        assert lost is not None
        assert "lost" in lost.health.reason
        assert driver.calls["nvmlDeviceGetTopologyCommonAncestor"] == reads
        driver.inject(1, "recover")
        await monitor.poll_once()
        # The refresh runs in the background on the control worker.
        await eventually(
            lambda: driver.calls["nvmlDeviceGetTopologyCommonAncestor"] >= reads + 3,
            what="the topology read again",
        )
        assert driver.calls["nvmlDeviceGetTopologyCommonAncestor"] == reads + 3
        link = store.snapshot.topology.between(1, 2)
        assert link is not None
        assert link.nvlinks == 18
    finally:
        await monitor.close()
