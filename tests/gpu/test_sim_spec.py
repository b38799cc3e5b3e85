"""The simulated node's description: ``--simulate N``, ``--sim-config`` parsing and profiles."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gpuagent.gpu.sim import (
    SimConfigError,
    find_profile,
    load_sim_config,
    node_from_count,
    node_from_mapping,
)
from gpuagent.gpu.sim.profiles import A100_40GB, A100_80GB, H100_80GB, place_mig
from gpuagent.gpu.sim.spec import node_with_nvswitches

H100_NAME = "NVIDIA H100 80GB HBM3"


def v1(*gpus: object, **extra: object) -> dict[str, object]:
    return {"version": "v1", "gpus": list(gpus), **extra}


class TestNodeFromCount:
    def test_h100_profile_and_driver(self) -> None:
        """--simulate N gives N H100 80GB HBM3 GPUs as NVML names them, with a driver version."""
        node = node_from_count(4)
        assert [g.name for g in node.gpus] == [H100_NAME] * 4
        assert {g.memory_mib for g in node.gpus} == {81559}
        assert node.driver_version
        assert node.cuda_driver_version >= 12000

    @pytest.mark.parametrize(
        ("n", "numa"),
        [
            (1, [0]),
            (2, [0, 1]),
            (3, [0, 0, 1]),
            (8, [0, 0, 0, 0, 1, 1, 1, 1]),
        ],
    )
    def test_numa_split(self, n: int, numa: list[int]) -> None:
        """The first half of the GPUs sits on NUMA node 0, the rest on NUMA node 1."""
        assert [g.numa_node for g in node_from_count(n).gpus] == numa

    @pytest.mark.parametrize("n", [2, 3, 8, 19, 64])
    def test_nvlink_all_pairs(self, n: int) -> None:
        """Every pair of GPUs is joined by NVLink exactly once."""
        node = node_from_count(n)
        pairs = [(a, b) for a, b, _ in node.nvlinks]
        assert len(pairs) == len(set(pairs)) == n * (n - 1) // 2
        assert {frozenset(p) for p in pairs} == {
            frozenset((a, b)) for a in range(n) for b in range(a + 1, n)
        }
        assert all(count >= 1 for _, _, count in node.nvlinks)

    def test_links_fit_the_board(self) -> None:
        """On an 8-GPU board each GPU's links to its peers fit in the H100's 18 links."""
        node = node_from_count(8)
        for gpu in range(8):
            assert sum(count for _, count in node.links_of(gpu)) <= 18

    def test_single_gpu_has_no_nvlink(self) -> None:
        """One GPU has no peers."""
        assert node_from_count(1).nvlinks == ()

    def test_identity_is_unique_and_deterministic(self) -> None:
        """UUIDs and bus IDs are distinct, well formed and the same every time."""
        node = node_from_count(64)
        assert node == node_from_count(64)
        uuids = [g.uuid for g in node.gpus]
        buses = [g.pci_bus_id for g in node.gpus]
        assert len(set(uuids)) == len(set(buses)) == 64
        assert all(re.fullmatch(r"GPU-[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}", u) for u in uuids)
        assert all(re.fullmatch(r"00000000:[0-9A-F]{2}:00\.0", b) for b in buses)
        assert [g.minor for g in node.gpus] == list(range(64))

    @pytest.mark.parametrize("n", [0, -1, 65, True, "8", 2.0])
    def test_rejects_bad_counts(self, n: object) -> None:
        """N outside 1..64 (or not an integer) is an error on the ``simulate`` key."""
        with pytest.raises(SimConfigError) as info:
            node_from_count(n)  # type: ignore[arg-type]
        assert info.value.key == "simulate"
        assert "simulate" in str(info.value)


class TestProfiles:
    @pytest.mark.parametrize(
        ("name", "model"),
        [
            ("H100", H100_NAME),
            ("h100-80gb", H100_NAME),
            ("NVIDIA H100 80GB HBM3", H100_NAME),
            ("nvidia h100 80gb hbm3", H100_NAME),
            ("A100-40GB", "NVIDIA A100-SXM4-40GB"),
            ("A100-80GB", "NVIDIA A100-SXM4-80GB"),
            ("NVIDIA A100-SXM4-80GB", "NVIDIA A100-SXM4-80GB"),
            ("H200", "NVIDIA H200"),
            ("b200", "NVIDIA B200"),
        ],
    )
    def test_names_and_aliases(self, name: str, model: str) -> None:
        """Model names and short aliases find their profile, whatever the case."""
        profile = find_profile(name)
        assert profile is not None
        assert profile.model_name == model

    def test_unknown_name(self) -> None:
        """An unknown model has no profile."""
        assert find_profile("Tesla T4") is None


class TestNodeFromMapping:
    def test_defaults_from_profile(self) -> None:
        """Keys left out come from the named profile; NUMA nodes split like --simulate."""
        node = node_from_mapping(v1({"name": "A100-40GB"}, {}, None))
        first, second, third = node.gpus
        assert first.name == "NVIDIA A100-SXM4-40GB"
        assert first.memory_mib == A100_40GB.memory_mib
        assert first.profile is A100_40GB
        assert (second.name, third.profile) == (H100_NAME, H100_80GB)
        assert [g.numa_node for g in node.gpus] == [0, 0, 1]
        assert node.nvlinks == ()

    def test_explicit_values(self) -> None:
        """Configured memory, NUMA node and MIG profiles win over the defaults."""
        node = node_from_mapping(
            v1({"name": "H200", "memory_mib": 1000, "numa_node": 3, "mig": ["3g.71gb", "1g.18gb"]})
        )
        (gpu,) = node.gpus
        assert (gpu.name, gpu.memory_mib, gpu.numa_node) == ("NVIDIA H200", 1000, 3)
        assert gpu.mig == ("3g.71gb", "1g.18gb")

    def test_unknown_name_keeps_h100_defaults(self) -> None:
        """An unknown model name is reported as given, on H100 defaults."""
        (gpu,) = node_from_mapping(v1({"name": "Tesla T4"})).gpus
        assert gpu.name == "Tesla T4"
        assert gpu.profile is H100_80GB
        assert gpu.memory_mib == H100_80GB.memory_mib

    def test_nvlinks(self) -> None:
        """NVLink pairs are kept as configured."""
        node = node_from_mapping(v1({}, {}, {}, nvlinks=[[0, 1, 4], [2, 1, 14]]))
        assert node.nvlinks == ((0, 1, 4), (2, 1, 14))
        assert node.links_of(1) == ((0, 4), (2, 14))
        assert node.links_of(0) == ((1, 4),)

    def test_uuid_depends_on_profile_and_index(self) -> None:
        """The same slot with another model gets another UUID."""
        h100 = node_from_mapping(v1({"name": "H100"}, {"name": "H100"})).gpus
        a100 = node_from_mapping(v1({"name": "A100-80GB"})).gpus
        assert h100[0].uuid != h100[1].uuid
        assert h100[0].uuid != a100[0].uuid
        assert h100[0].uuid == node_from_count(1).gpus[0].uuid

    @pytest.mark.parametrize(
        ("data", "key"),
        [
            ([], "sim-config"),
            ({"gpus": [{}]}, "version"),
            ({"version": "v2", "gpus": [{}]}, "version"),
            ({"version": 1, "gpus": [{}]}, "version"),
            ({"version": "v1"}, "gpus"),
            (v1(), "gpus"),
            ({"version": "v1", "gpus": "a100"}, "gpus"),
            (v1(*([{}] * 65)), "gpus"),
            (v1({}, extra=1), "extra"),
            (v1(5), "gpus[0]"),
            (v1({}, {"memroy_mib": 1}), "gpus[1].memroy_mib"),
            (v1({"name": 3}), "gpus[0].name"),
            (v1({"name": " "}), "gpus[0].name"),
            (v1({}, {"memory_mib": "80GB"}), "gpus[1].memory_mib"),
            (v1({"memory_mib": 0}), "gpus[0].memory_mib"),
            (v1({"memory_mib": True}), "gpus[0].memory_mib"),
            (v1({"memory_mib": 81559.0}), "gpus[0].memory_mib"),
            (v1({"numa_node": -1}), "gpus[0].numa_node"),
            (v1({"numa_node": "0"}), "gpus[0].numa_node"),
            (v1({"mig": "1g.10gb"}), "gpus[0].mig"),
            (v1({"mig": ["9g.99gb"]}), "gpus[0].mig[0]"),
            (v1({"mig": ["1g.10gb", 7]}), "gpus[0].mig[1]"),
            (v1({"mig": ["1g.5gb"]}), "gpus[0].mig[0]"),
            (v1({"mig": ["7g.80gb", "1g.10gb"]}), "gpus[0].mig"),
            (v1({"mig": ["1g.10gb+me", "1g.10gb+me"]}), "gpus[0].mig[1]"),
            (v1({"mig": ["4g.40gb", "4g.40gb"]}), "gpus[0].mig[1]"),
            (v1({"mig": ["1g.20gb"] * 5}), "gpus[0].mig[4]"),
            (v1({"mig": ["1g.10gb"] * 8}), "gpus[0].mig[7]"),
            (v1({"mig": ["3g.40gb", "3g.40gb", "1g.10gb"]}), "gpus[0].mig"),
            (v1({"mig": ["4g.40gb", "1g.20gb", "1g.20gb", "1g.10gb"]}), "gpus[0].mig"),
            (v1({"name": "A100-40GB", "mig": ["7g.40gb", "1g.5gb"]}), "gpus[0].mig"),
            (v1({}, {"name": "H200", "mig": ["3g.40gb"]}), "gpus[1].mig[0]"),
            (v1({}, {}, nvlinks="all"), "nvlinks"),
            (v1({}, {}, nvlinks=[[0, 1]]), "nvlinks[0]"),
            (v1({}, {}, nvlinks=[[0, 1, 1, 1]]), "nvlinks[0]"),
            (v1({}, {}, nvlinks=[[0, 2, 1]]), "nvlinks[0][1]"),
            (v1({}, {}, nvlinks=[[-1, 1, 1]]), "nvlinks[0][0]"),
            (v1({}, {}, nvlinks=[[0, 0, 1]]), "nvlinks[0]"),
            (v1({}, {}, nvlinks=[[0, 1, 0]]), "nvlinks[0][2]"),
            (v1({}, {}, nvlinks=[[0, 1, 19]]), "nvlinks[0][2]"),
            (v1({}, {}, nvlinks=[[0, 1, "2"]]), "nvlinks[0][2]"),
            (v1({}, {}, nvlinks=[[0, 1, 1], [1, 0, 2]]), "nvlinks[1]"),
            (v1({"name": "a100"}, {}, {}, nvlinks=[[0, 1, 12], [0, 2, 1]]), "nvlinks[1]"),
        ],
    )
    def test_errors_name_the_key(self, data: object, key: str) -> None:
        """Every type or range problem raises SimConfigError naming the dotted key."""
        with pytest.raises(SimConfigError) as info:
            node_from_mapping(data)
        assert info.value.key == key
        assert str(info.value).startswith(f"{key}: ")


class TestMigLayouts:
    @pytest.mark.parametrize(
        ("name", "mig", "placed"),
        [
            (
                "A100-80GB",
                ["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"],
                [("3g.40gb", 4, 2), ("2g.20gb", 2, 4), ("1g.10gb", 0, 7), ("1g.10gb", 1, 8)],
            ),
            (
                "H100",
                ["1g.10gb", "4g.40gb", "1g.20gb", "1g.10gb+me"],
                [("4g.40gb", 0, 1), ("1g.20gb", 6, 6), ("1g.10gb+me", 4, 11), ("1g.10gb", 5, 12)],
            ),
            ("H100", ["3g.40gb", "3g.40gb"], [("3g.40gb", 0, 1), ("3g.40gb", 4, 2)]),
            (
                "H100",
                ["2g.20gb", "2g.20gb", "3g.40gb"],
                [("2g.20gb", 0, 3), ("2g.20gb", 2, 4), ("3g.40gb", 4, 2)],
            ),
            ("H100", ["1g.20gb"] * 4, [("1g.20gb", s, 3 + s // 2) for s in (0, 2, 4, 6)]),
            ("A100-40GB", ["1g.5gb"] * 7, [("1g.5gb", s, 7 + s) for s in range(7)]),
            ("H200", ["7g.141gb"], [("7g.141gb", 0, 0)]),
        ],
    )
    def test_valid_layouts(
        self, name: str, mig: list[str], placed: list[tuple[str, int, int]]
    ) -> None:
        """Valid layouts become MIG devices with non-overlapping placements, in GI order."""
        (gpu,) = node_from_mapping(v1({"name": name, "mig": mig})).gpus
        assert gpu.mig == tuple(mig)
        devices = gpu.mig_devices
        assert [(d.name, d.start, d.gpu_instance_id) for d in devices] == sorted(
            placed, key=lambda p: p[2]
        )
        slices = [s for d in devices for s in range(d.start, d.start + d.profile.memory_slices)]
        assert len(slices) == len(set(slices))
        assert all(d.compute_instance_id == 0 for d in devices)
        assert len({d.uuid for d in devices}) == len(devices)
        assert all(
            re.fullmatch(r"MIG-[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}", d.uuid) for d in devices
        )

    def test_memory_from_profile(self) -> None:
        """Instance memory is the profile's; a GPU configured smaller scales it by its share."""
        node = node_from_mapping(
            v1({"name": "A100-80GB", "mig": ["3g.40gb"]}, {"memory_mib": 40000, "mig": ["7g.80gb"]})
        )
        assert node.gpus[0].mig_devices[0].memory_mib == 40448
        assert node.gpus[1].mig_devices[0].memory_mib == 81152 * 40000 // 81559

    def test_placement_message(self) -> None:
        """A layout that fits the slices but not the placements says so."""
        with pytest.raises(SimConfigError, match="no valid placement"):
            node_from_mapping(v1({"mig": ["3g.40gb", "3g.40gb", "1g.10gb"]}))

    def test_place_mig(self) -> None:
        """Larger instances go first, each at its highest free placement; overlaps fail."""
        twenty = A100_80GB.mig_profile("1g.20gb")
        three = A100_80GB.mig_profile("3g.40gb")
        four = A100_80GB.mig_profile("4g.40gb")
        assert twenty is not None
        assert three is not None
        assert four is not None
        assert place_mig([twenty, three, twenty]) == (2, 4, 0)
        assert place_mig([three, four]) == (4, 0)
        assert place_mig([four, four]) is None
        assert place_mig([three, three, twenty]) is None
        assert place_mig([]) == ()

    def test_profiles_listed_in_nvidia_order(self) -> None:
        """Profile names per model are listed as nvidia-smi mig -lgip lists them."""
        assert A100_40GB.mig_profile_names == (
            "1g.5gb",
            "1g.5gb+me",
            "1g.10gb",
            "2g.10gb",
            "3g.20gb",
            "4g.20gb",
            "7g.40gb",
        )
        assert [p.profile_id for p in H100_80GB.mig_profiles] == [19, 20, 15, 14, 9, 5, 0]


class TestNvSwitchNode:
    @pytest.mark.parametrize(("switches", "split"), [(4, [5, 5, 4, 4]), (6, [3] * 6), (1, [18])])
    def test_links_over_switches(self, switches: int, split: list[int]) -> None:
        """Each GPU spreads its 18 links over the switches and has no direct GPU link."""
        node = node_with_nvswitches(3, switches)
        assert node.nvlinks == ()
        assert node.nvswitches == switches
        for gpu in range(3):
            assert [count for _, count in node.switch_links_of(gpu)] == split

    @pytest.mark.parametrize(
        ("n", "switches", "key"), [(0, 4, "simulate"), (2, 0, "nvswitches"), (2, 17, "nvswitches")]
    )
    def test_rejects(self, n: int, switches: int, key: str) -> None:
        """Out-of-range sizes are errors naming the key."""
        with pytest.raises(SimConfigError) as info:
            node_with_nvswitches(n, switches)
        assert info.value.key == key


class TestLoadSimConfig:
    def test_reads_yaml(self, tmp_path: Path) -> None:
        """A YAML file is parsed like the mapping it holds."""
        path = tmp_path / "node.yaml"
        path.write_text(
            "version: v1\n"
            "gpus:\n"
            "  - name: H100\n"
            "    numa_node: 1\n"
            "    mig: [1g.10gb]\n"
            "  - {}\n"
            "nvlinks:\n"
            "  - [0, 1, 18]\n"
        )
        node = load_sim_config(path)
        assert [g.numa_node for g in node.gpus] == [1, 1]
        assert node.gpus[0].mig == ("1g.10gb",)
        assert node.nvlinks == ((0, 1, 18),)

    @pytest.mark.parametrize("content", [None, "version: v1\ngpus: [\n", "\xff\xfe"])
    def test_unreadable(self, tmp_path: Path, content: str | None) -> None:
        """A missing file, broken YAML or undecodable bytes are errors on ``sim-config``."""
        path = tmp_path / "node.yaml"
        if content is not None:
            path.write_bytes(content.encode("latin-1"))
        with pytest.raises(SimConfigError) as info:
            load_sim_config(path)
        assert info.value.key == "sim-config"

    def test_content_errors_name_the_key(self, tmp_path: Path) -> None:
        """A readable file with a bad value names that value's key."""
        path = tmp_path / "node.yaml"
        path.write_text("version: v1\ngpus:\n  - memory_mib: lots\n")
        with pytest.raises(SimConfigError) as info:
            load_sim_config(path)
        assert info.value.key == "gpus[0].memory_mib"
