"""GPU topology (P2P level, NVLink count per pair) read through pynvml from the simulated driver."""

from __future__ import annotations

import dataclasses
from collections.abc import MutableMapping
from typing import Any

import pynvml
import pytest
import structlog.testing
from support.simnvml import Run

from gpuagent.domain.devices import Link, P2PLevel, Topology
from gpuagent.gpu.sim import (
    SimDriver,
    node_from_count,
    node_from_mapping,
    uninstall,
)
from gpuagent.gpu.sim.spec import node_with_nvswitches, switch_bus_id
from gpuagent.gpu.topology import bus_key, p2p_level, read_topology

NODE, SYSTEM = P2PLevel.NODE, P2PLevel.SYSTEM
UNKNOWN = int(pynvml.NVML_ERROR_UNKNOWN)
NOT_SUPPORTED = int(pynvml.NVML_ERROR_NOT_SUPPORTED)
LOST_LOG = "gpu lost; its topology is unknown"
NO_NVLINK_API_LOG = "nvlink queries not offered; nvlink counts are 0"


def handles(driver: SimDriver) -> dict[int, Any]:
    return {g.index: pynvml.nvmlDeviceGetHandleByIndex(g.index) for g in driver.node.gpus}


Pairs = dict[tuple[int, int], tuple[P2PLevel | None, int]]
Logs = list[MutableMapping[str, Any]]


def pairs(topology: Topology) -> Pairs:
    return {(link.a, link.b): (link.p2p, link.nvlinks) for link in topology.links}


def read_failing(run: Run, symbol: str, code: int, **where: int) -> tuple[Pairs, Logs]:
    """:data:`ASYMMETRIC` read while ``symbol`` fails with ``code`` (``where``: ``gpu``,
    ``count``), and what was logged meanwhile."""
    driver = run(node_from_mapping(ASYMMETRIC))
    driver.fail(symbol, code, **where)
    return read_logged(driver)


def read_logged(driver: SimDriver) -> tuple[Pairs, Logs]:
    """The pairs read from every GPU of ``driver``, and what was logged meanwhile."""
    with structlog.testing.capture_logs() as logs:
        got = pairs(read_topology(handles(driver)))
    return got, logs


ASYMMETRIC = {
    "version": "v1",
    "gpus": [
        {"numa_node": 0},
        {"numa_node": 0},
        {"numa_node": 1},
        {"numa_node": 0},
        {"numa_node": 1},
        {"numa_node": 1},
    ],
    # Island {0, 1, 2}: a triangle with unequal links; island {3, 4}; GPU 5 on PCIe only.
    "nvlinks": [[0, 1, 6], [1, 2, 4], [2, 0, 2], [3, 4, 12]],
}


class TestSimulatedNode:
    def test_simulate_8_all_pairs(self, run: Run) -> None:
        """--simulate 8: every pair joined by 2 links; NODE within a NUMA half, SYSTEM across."""
        driver = run(node_from_count(8))
        topology = read_topology(handles(driver))
        expected = tuple(
            Link(a, b, NODE if (a < 4) == (b < 4) else SYSTEM, 2)
            for a in range(8)
            for b in range(a + 1, 8)
        )
        assert topology.links == expected

    def test_asymmetric_islands(self, run: Run) -> None:
        """Two NVLink islands and a PCIe-only GPU across two NUMA nodes: exactly those links."""
        driver = run(node_from_mapping(ASYMMETRIC))
        got = pairs(read_topology(handles(driver)))
        assert got == {
            (0, 1): (NODE, 6),
            (0, 2): (SYSTEM, 2),
            (0, 3): (NODE, 0),
            (0, 4): (SYSTEM, 0),
            (0, 5): (SYSTEM, 0),
            (1, 2): (SYSTEM, 4),
            (1, 3): (NODE, 0),
            (1, 4): (SYSTEM, 0),
            (1, 5): (SYSTEM, 0),
            (2, 3): (SYSTEM, 0),
            (2, 4): (NODE, 0),
            (2, 5): (NODE, 0),
            (3, 4): (SYSTEM, 12),
            (3, 5): (SYSTEM, 0),
            (4, 5): (NODE, 0),
        }

    def test_subset_of_gpus(self, run: Run) -> None:
        """Only the GPUs handed in are paired; links to the others are not counted."""
        driver = run(node_from_mapping(ASYMMETRIC))
        subset = {i: h for i, h in handles(driver).items() if i in (0, 2, 5)}
        with structlog.testing.capture_logs() as logs:
            got = pairs(read_topology(subset))
        assert got == {(0, 2): (SYSTEM, 2), (0, 5): (SYSTEM, 0), (2, 5): (NODE, 0)}
        foreign = [e for e in logs if e["event"] == "nvlink to a gpu the agent does not manage"]
        assert [e["gpu"] for e in foreign] == [0, 2]

    @pytest.mark.parametrize("count", [0, 1])
    def test_no_pairs(self, run: Run, count: int) -> None:
        """No GPUs or a single GPU have no pairs."""
        driver = run(node_from_count(1))
        given = handles(driver) if count else {}
        assert read_topology(given) == Topology(links=())

    def test_between_is_symmetric(self, run: Run) -> None:
        """The store's lookup finds a pair from either end."""
        driver = run(node_from_mapping(ASYMMETRIC))
        topology = read_topology(handles(driver))
        assert topology.between(4, 3) == topology.between(3, 4) == Link(3, 4, SYSTEM, 12)


class TestNvSwitch:
    def test_hgx_board(self, run: Run) -> None:
        """On an NVSwitch board every pair talks over all 18 links through the switches."""
        driver = run(node_with_nvswitches(8))
        topology = read_topology(handles(driver))
        assert {link.nvlinks for link in topology.links} == {18}
        assert len(topology.links) == 28

    def test_switch_links_are_not_direct_pairs(self, run: Run) -> None:
        """Only GPUs on a shared switch meet through it; a switch's bus is never a GPU peer."""
        base = node_from_mapping({"version": "v1", "gpus": [{}, {}, {}], "nvlinks": [[0, 2, 2]]})
        node = dataclasses.replace(base, nvswitch_links=((0, 0, 4), (1, 0, 3), (2, 1, 4)))
        driver = run(node)
        got = pairs(read_topology(handles(driver)))
        assert {pair: links for pair, (_, links) in got.items()} == {
            (0, 1): 3,  # min(4, 3) through switch 0
            (0, 2): 2,  # direct only: GPU 2 hangs off another switch
            (1, 2): 0,
        }

    def test_simulated_switch_answers(self, run: Run) -> None:
        """A switch link names an NVSwitch and its bus; the GPU's direct links come first."""
        base = node_from_mapping({"version": "v1", "gpus": [{}, {}], "nvlinks": [[0, 1, 2]]})
        driver = run(dataclasses.replace(base, nvswitch_links=((0, 3, 1),)))
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        kinds = [pynvml.nvmlDeviceGetNvLinkRemoteDeviceType(h, link) for link in range(3)]
        assert kinds == [pynvml.NVML_NVLINK_DEVICE_TYPE_GPU] * 2 + [
            pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH
        ]
        assert pynvml.nvmlDeviceGetNvLinkRemotePciInfo(h, 2).busId == switch_bus_id(3)
        assert pynvml.nvmlDeviceGetNvLinkRemotePciInfo(h, 0).busId == driver.node.gpus[1].pci_bus_id
        assert pynvml.nvmlDeviceGetNvLinkState(h, 3) == pynvml.NVML_FEATURE_DISABLED

    def test_without_remote_type(self, run: Run) -> None:
        """Without the remote device type direct GPU links still count; switch ports do not."""
        base = node_from_mapping({"version": "v1", "gpus": [{}, {}, {}], "nvlinks": [[0, 2, 2]]})
        driver = run(dataclasses.replace(base, nvswitch_links=((0, 0, 4), (1, 0, 3))))
        driver.remove("nvmlDeviceGetNvLinkRemoteDeviceType")
        got, logs = read_logged(driver)
        assert {pair: links for pair, (_, links) in got.items()} == {
            (0, 1): 0,
            (0, 2): 2,
            (1, 2): 0,
        }
        assert [e["event"] for e in logs] == [
            "nvlink remote device type not offered; links to non-gpus are ignored"
        ]


class TestCalls:
    """How many calls a read takes: link states in one call, remote types only for non-GPUs."""

    def test_eight_gpus_all_linked(self, run: Run) -> None:
        driver = run(node_from_count(8))
        given = handles(driver)
        before = dict(driver.calls)
        read_topology(given)
        made = {k: v - before.get(k, 0) for k, v in driver.calls.items() if v != before.get(k, 0)}
        assert made == {
            "nvmlDeviceGetPciInfo_v3": 8,  # bus IDs (discovery hands them over instead)
            "nvmlDeviceGetFieldValues": 8,  # link count and every link's state, per GPU
            "nvmlDeviceGetNvLinkRemotePciInfo_v2": 8 * 14,  # 2 links to each of 7 peers
            "nvmlDeviceGetTopologyCommonAncestor": 28,  # one per pair
        }

    def test_bus_ids_given(self, run: Run) -> None:
        """With the bus IDs from discovery, no PCI info is read again."""
        driver = run(node_from_count(4))
        buses = {g.index: g.pci_bus_id for g in driver.node.gpus}
        before = driver.calls["nvmlDeviceGetPciInfo_v3"]
        with_buses = read_topology(handles(driver), buses=buses)
        assert driver.calls["nvmlDeviceGetPciInfo_v3"] == before
        assert with_buses == read_topology(handles(driver))

    def test_switches_need_the_remote_type(self, run: Run) -> None:
        driver = run(node_with_nvswitches(2))
        given = handles(driver)
        before = driver.calls["nvmlDeviceGetNvLinkRemoteDeviceType"]
        read_topology(given)
        assert driver.calls["nvmlDeviceGetNvLinkRemoteDeviceType"] - before == 2 * 18

    def test_driver_without_link_state_fields(self, run: Run) -> None:
        """Without the NVLink state field, each link's state is asked for; same topology."""
        node = node_from_mapping(ASYMMETRIC)
        expected = pairs(read_topology(handles(run(node))))
        pynvml.nvmlShutdown()
        uninstall()
        old = dataclasses.replace(
            node, absent_fields=frozenset({pynvml.NVML_FI_DEV_NVLINK_GET_STATE})
        )
        driver = run(old)
        assert pairs(read_topology(handles(driver))) == expected
        assert driver.calls["nvmlDeviceGetNvLinkState"] > 0


class TestFailures:
    def test_lost_gpu(self, run: Run) -> None:
        """A lost GPU's pairs are unknown; every other pair reads as before; no exception."""
        driver = run(node_from_count(8))
        given = handles(driver)
        before = read_topology(given)
        driver.inject(5, "lost")
        with structlog.testing.capture_logs() as logs:
            after = read_topology(given)
        for old, new in zip(before.links, after.links, strict=True):
            if 5 in (old.a, old.b):
                assert new == Link(old.a, old.b, None, 0)
            else:
                assert new == old
        assert [(e["event"], e["gpu"]) for e in logs] == [(LOST_LOG, 5)]

    def test_lost_after_pci_info(self, run: Run) -> None:
        """A GPU lost only once its links are walked still leaves just its own pairs unknown."""
        driver = run(node_from_mapping(ASYMMETRIC))
        driver.fail("nvmlDeviceGetFieldValues", int(pynvml.NVML_ERROR_GPU_IS_LOST), gpu=1)
        got = pairs(read_topology(handles(driver)))
        assert all(got[p] == (None, 0) for p in got if 1 in p)
        assert got[(0, 2)] == (SYSTEM, 2)
        assert got[(3, 4)] == (SYSTEM, 12)

    @pytest.mark.parametrize(
        "symbols",
        [
            ["nvmlDeviceGetNvLinkState", "nvmlDeviceGetFieldValues"],
            ["nvmlDeviceGetNvLinkRemotePciInfo_v2"],
        ],
    )
    def test_nvlink_functions_removed(self, run: Run, symbols: list[str]) -> None:
        """An older driver without the NVLink calls: no links anywhere, P2P intact, logged once."""
        driver = run(node_from_count(4))
        for symbol in symbols:
            driver.remove(symbol)
        with structlog.testing.capture_logs() as logs:
            topology = read_topology(handles(driver))
        assert [link.nvlinks for link in topology.links] == [0] * 6
        assert [link.p2p for link in topology.links] == [NODE, SYSTEM, SYSTEM, SYSTEM, SYSTEM, NODE]
        assert [e["event"] for e in logs] == [NO_NVLINK_API_LOG]

    def test_common_ancestor_removed(self, run: Run) -> None:
        """Without the common-ancestor call P2P is unknown; NVLink counts stay; logged once."""
        driver = run(node_from_count(4))
        driver.remove("nvmlDeviceGetTopologyCommonAncestor")
        with structlog.testing.capture_logs() as logs:
            topology = read_topology(handles(driver))
        assert [(link.p2p, link.nvlinks) for link in topology.links] == [(None, 6)] * 6
        assert [e["event"] for e in logs] == [
            "pcie common ancestor not offered; p2p levels unknown"
        ]

    def test_nvlink_not_supported_on_one_gpu(self, run: Run) -> None:
        """A GPU without NVLink support has no links; its NVLink peers then have none with it."""
        driver = run(node_from_mapping(ASYMMETRIC))
        driver.fail("nvmlDeviceGetFieldValues", NOT_SUPPORTED, gpu=0)
        driver.fail("nvmlDeviceGetNvLinkState", NOT_SUPPORTED, gpu=0)
        got, logs = read_logged(driver)
        assert got[(0, 1)] == (NODE, 0)
        assert got[(0, 2)] == (SYSTEM, 0)
        assert got[(1, 2)] == (SYSTEM, 4)
        assert [(e["event"], e["gpu"]) for e in logs] == [
            ("nvlink not offered by this gpu or driver", 0)
        ]

    def test_remote_not_supported_on_active_links(self, run: Run) -> None:
        """Active links whose remote the driver will not name are not counted (logged once)."""
        got, logs = read_failing(run, "nvmlDeviceGetNvLinkRemotePciInfo_v2", NOT_SUPPORTED, gpu=3)
        assert got[(3, 4)] == (SYSTEM, 0)
        assert got[(0, 1)] == (NODE, 6)
        assert len([e for e in logs if e["event"].startswith("nvlink remote not offered")]) == 1

    @pytest.mark.parametrize(
        "symbol", ["nvmlDeviceGetPciInfo_v3", "nvmlDeviceGetNvLinkRemotePciInfo_v2"]
    )
    def test_failing_gpu(self, run: Run, symbol: str) -> None:
        """A GPU whose topology calls fail has unknown pairs; the failure is logged once."""
        got, logs = read_failing(run, symbol, UNKNOWN, gpu=2)
        assert all(got[p] == (None, 0) for p in got if 2 in p)
        assert got[(0, 1)] == (NODE, 6)
        assert [(e["event"], e["gpu"]) for e in logs] == [("gpu topology unreadable", 2)]

    def test_common_ancestor_failing_for_one_pair(self, run: Run) -> None:
        """A pair whose P2P level cannot be read keeps its NVLink count."""
        got, logs = read_failing(run, "nvmlDeviceGetTopologyCommonAncestor", UNKNOWN, count=1)
        assert got[(0, 1)] == (None, 6)
        assert got[(0, 2)] == (SYSTEM, 2)
        assert [e["gpus"] for e in logs] == [[0, 1]]

    def test_mig_handles_have_no_topology(self, run: Run) -> None:
        """MIG devices take no part in topology calls."""
        run(node_from_mapping({"version": "v1", "gpus": [{"mig": ["7g.80gb"]}, {}]}))
        gpu = pynvml.nvmlDeviceGetHandleByIndex(0)
        mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu, 0)
        with pytest.raises(pynvml.NVMLError_NotSupported):
            pynvml.nvmlDeviceGetTopologyCommonAncestor(mig, gpu)
        with pytest.raises(pynvml.NVMLError_NotSupported):
            pynvml.nvmlDeviceGetNvLinkState(mig, 0)


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("00000000:18:00.0", (0, 0x18, 0, 0)),
        ("0000:18:00.0", (0, 0x18, 0, 0)),
        ("18:00.0", (0, 0x18, 0, 0)),
        ("00000001:aB:1f.7", (1, 0xAB, 0x1F, 7)),
        (b"00000000:E0:00.0", (0, 0xE0, 0, 0)),
        (" 00000000:18:00.0 ", (0, 0x18, 0, 0)),
        ("", None),
        ("00000000:18:00", None),
        ("0:0:18:00.0", None),
        ("zz:00.0", None),
    ],
)
def test_bus_key(text: str | bytes, key: tuple[int, int, int, int] | None) -> None:
    """Bus IDs compare by value whatever the domain width and case."""
    assert bus_key(text) == key


@pytest.mark.parametrize(
    ("value", "level"),
    [
        (pynvml.NVML_TOPOLOGY_INTERNAL, P2PLevel.INTERNAL),
        (pynvml.NVML_TOPOLOGY_SINGLE, P2PLevel.SINGLE),
        (pynvml.NVML_TOPOLOGY_MULTIPLE, P2PLevel.MULTIPLE),
        (pynvml.NVML_TOPOLOGY_HOSTBRIDGE, P2PLevel.HOSTBRIDGE),
        (pynvml.NVML_TOPOLOGY_NODE, P2PLevel.NODE),
        (pynvml.NVML_TOPOLOGY_CPU, P2PLevel.NODE),
        (pynvml.NVML_TOPOLOGY_SYSTEM, P2PLevel.SYSTEM),
        (35, None),
        (60, None),
    ],
)
def test_p2p_level(value: int, level: P2PLevel | None) -> None:
    """NVML's topology levels map onto P2PLevel; an unknown level is None."""
    assert p2p_level(value) == level
