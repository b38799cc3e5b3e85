"""Node labels as GPU feature discovery writes them, and the NFD feature file."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from support.nodes import gpu, mig, node

from gpuagent.domain.resources import MigStrategy, ResourceSettings
from gpuagent.domain.sharing import MpsSharing
from gpuagent.domain.snapshot import Snapshot
from gpuagent.domain.timeslicing import ReplicaRule, TimeSlicing
from gpuagent.nodefiles.hostfacts import HostFacts, Vgpu
from gpuagent.nodefiles.labels import arch_family, node_labels, render_features, sync_features

H100_NODE = node(gpu(0, numa=0), gpu(1, numa=1), driver="550.54.15")
COMMON = {
    "nvidia.com/cuda.driver.major": "550",
    "nvidia.com/cuda.driver.minor": "54",
    "nvidia.com/cuda.driver.rev": "15",
    "nvidia.com/cuda.driver-version.major": "550",
    "nvidia.com/cuda.driver-version.minor": "54",
    "nvidia.com/cuda.driver-version.revision": "15",
    "nvidia.com/cuda.driver-version.full": "550.54.15",
    "nvidia.com/mig.capable": "true",
    "nvidia.com/mps.capable": "false",
}
H100_GPU = {
    "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
    "nvidia.com/gpu.count": "2",
    "nvidia.com/gpu.memory": "81559",
    "nvidia.com/gpu.family": "hopper",
    "nvidia.com/gpu.compute.major": "9",
    "nvidia.com/gpu.compute.minor": "0",
    "nvidia.com/gpu.replicas": "1",
    "nvidia.com/gpu.sharing-strategy": "none",
}


def shared(replicas: int, *, rename: bool = False, rule_rename: str = "") -> ResourceSettings:
    return ResourceSettings(
        time_slicing=TimeSlicing(
            resources=(ReplicaRule("gpu", replicas, rename=rule_rename),),
            rename_by_default=rename,
        )
    )


def through_mps(replicas: int, *, rename: bool = False) -> ResourceSettings:
    return ResourceSettings(
        mps=MpsSharing(resources=(ReplicaRule("gpu", replicas),), rename_by_default=rename)
    )


MIG_NODE = node(
    gpu(0, migs=[mig(0, 7), mig(0, 8), mig(0, 3, "2g.20gb", 19968)]),
    gpu(1, migs=[mig(1, 7), mig(1, 1, "1g.20gb+me", 19968)]),
)
UNIFORM = node(gpu(0, migs=[mig(0, 7), mig(0, 8)]), gpu(1, migs=[mig(1, 7)]))


@pytest.mark.parametrize(
    ("snapshot", "settings", "changes"),
    [
        pytest.param(H100_NODE, ResourceSettings(), {}, id="plain"),
        pytest.param(
            H100_NODE, shared(4),
            {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3-SHARED",
             "nvidia.com/gpu.replicas": "4",
             "nvidia.com/gpu.sharing-strategy": "time-slicing"},
            id="time-slicing",
        ),
        pytest.param(
            H100_NODE, shared(4, rename=True),
            {"nvidia.com/gpu.replicas": "4", "nvidia.com/gpu.sharing-strategy": "time-slicing"},
            id="time-slicing-renamed",
        ),
        pytest.param(
            H100_NODE, shared(2, rule_rename="gpu.half"),
            {"nvidia.com/gpu.replicas": "2", "nvidia.com/gpu.sharing-strategy": "time-slicing"},
            id="time-slicing-rule-rename",
        ),
        pytest.param(
            H100_NODE, through_mps(4),
            {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3-SHARED",
             "nvidia.com/gpu.replicas": "4",
             "nvidia.com/gpu.sharing-strategy": "mps",
             "nvidia.com/mps.capable": "true"},
            id="mps",
        ),
        pytest.param(
            H100_NODE, through_mps(10, rename=True),
            {"nvidia.com/gpu.replicas": "10",
             "nvidia.com/gpu.sharing-strategy": "mps",
             "nvidia.com/mps.capable": "true"},
            id="mps-renamed",
        ),
        pytest.param(
            MIG_NODE, through_mps(2),
            {"nvidia.com/gpu.replicas": "0",
             "nvidia.com/gpu.sharing-strategy": "mps"},
            id="mps-with-mig-mode-gpus-not-capable",
        ),
        pytest.param(
            H100_NODE, ResourceSettings(mig_strategy=MigStrategy.MIXED),
            {"nvidia.com/mig.strategy": "mixed"},
            id="mixed-without-mig-devices",
        ),
        pytest.param(
            UNIFORM, ResourceSettings(mig_strategy=MigStrategy.SINGLE),
            {"nvidia.com/mig.strategy": "single",
             "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3-MIG-1g.10gb",
             "nvidia.com/gpu.count": "3",
             "nvidia.com/gpu.memory": "9856",
             "nvidia.com/gpu.replicas": "1",
             "nvidia.com/gpu.slices.gi": "1",
             "nvidia.com/gpu.slices.ci": "1"},
            id="single",
        ),
        pytest.param(
            MIG_NODE, ResourceSettings(mig_strategy=MigStrategy.SINGLE),
            {"nvidia.com/mig.strategy": "single",
             "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3-MIG-INVALID",
             "nvidia.com/gpu.count": "0",
             "nvidia.com/gpu.memory": "0",
             "nvidia.com/gpu.replicas": "0"},
            id="single-invalid",
        ),
        pytest.param(
            MIG_NODE, ResourceSettings(mig_strategy=MigStrategy.NONE),
            {"nvidia.com/gpu.replicas": "0"},
            id="none-with-mig-mode-gpus",
        ),
    ],
)  # fmt: skip
def test_labels(snapshot: Snapshot, settings: ResourceSettings, changes: dict[str, str]) -> None:
    assert node_labels(snapshot, settings) == {**COMMON, **H100_GPU, **changes}


def test_mixed_labels_per_profile() -> None:
    labels = node_labels(MIG_NODE, ResourceSettings(mig_strategy=MigStrategy.MIXED))
    mig_labels = {k: v for k, v in labels.items() if k.startswith("nvidia.com/mig-")}
    assert mig_labels == {
        "nvidia.com/mig-1g.10gb.product": "NVIDIA-H100-80GB-HBM3-MIG-1g.10gb",
        "nvidia.com/mig-1g.10gb.count": "3",
        "nvidia.com/mig-1g.10gb.memory": "9856",
        "nvidia.com/mig-1g.10gb.replicas": "1",
        "nvidia.com/mig-1g.10gb.slices.gi": "1",
        "nvidia.com/mig-1g.10gb.slices.ci": "1",
        "nvidia.com/mig-2g.20gb.product": "NVIDIA-H100-80GB-HBM3-MIG-2g.20gb",
        "nvidia.com/mig-2g.20gb.count": "1",
        "nvidia.com/mig-2g.20gb.memory": "19968",
        "nvidia.com/mig-2g.20gb.replicas": "1",
        "nvidia.com/mig-2g.20gb.slices.gi": "2",
        "nvidia.com/mig-2g.20gb.slices.ci": "2",
        "nvidia.com/mig-1g.20gb.me.product": "NVIDIA-H100-80GB-HBM3-MIG-1g.20gb.me",
        "nvidia.com/mig-1g.20gb.me.count": "1",
        "nvidia.com/mig-1g.20gb.me.memory": "19968",
        "nvidia.com/mig-1g.20gb.me.replicas": "1",
        "nvidia.com/mig-1g.20gb.me.slices.gi": "1",
        "nvidia.com/mig-1g.20gb.me.slices.ci": "1",
    }
    assert labels["nvidia.com/mig.strategy"] == "mixed"


def test_mixed_mig_resource_shared() -> None:
    settings = ResourceSettings(
        mig_strategy=MigStrategy.MIXED,
        time_slicing=TimeSlicing(resources=(ReplicaRule("mig-2g.20gb", 3),)),
    )
    labels = node_labels(MIG_NODE, settings)
    assert labels["nvidia.com/mig-2g.20gb.replicas"] == "3"
    assert labels["nvidia.com/mig-2g.20gb.product"] == "NVIDIA-H100-80GB-HBM3-MIG-2g.20gb-SHARED"
    assert labels["nvidia.com/gpu.sharing-strategy"] == "time-slicing"


def test_compute_instance_profile_slices() -> None:
    snapshot = node(gpu(0, migs=[mig(0, 1, "1c.3g.40gb", 40192)]))
    labels = node_labels(snapshot, ResourceSettings(mig_strategy=MigStrategy.SINGLE))
    assert (labels["nvidia.com/gpu.slices.gi"], labels["nvidia.com/gpu.slices.ci"]) == ("3", "1")


def test_per_gpu_counts_label_the_smallest() -> None:
    settings = ResourceSettings(
        time_slicing=TimeSlicing(
            resources=(ReplicaRule("gpu", 8, devices=("0",)), ReplicaRule("gpu", 2)),
        )
    )
    assert node_labels(H100_NODE, settings)["nvidia.com/gpu.replicas"] == "2"


def test_optional_inputs() -> None:
    snapshot = node(gpu(0, mig_capable=False), gpu(1, mig_capable=False), driver="550.54.15")
    snapshot = replace(snapshot, driver=replace(snapshot.driver, cuda_version=(12, 4)))
    host = HostFacts(machine="DGX H100 (rev 1)")
    labels = node_labels(snapshot, host=host)
    assert labels["nvidia.com/gpu.machine"] == "DGX-H100-rev-1"
    assert labels["nvidia.com/gpu.mode"] == "unknown"  # no PCI class read
    assert labels["nvidia.com/mig.capable"] == "false"
    assert {k: v for k, v in labels.items() if "runtime" in k} == {
        "nvidia.com/cuda.runtime.major": "12",
        "nvidia.com/cuda.runtime.minor": "4",
        "nvidia.com/cuda.runtime-version.major": "12",
        "nvidia.com/cuda.runtime-version.minor": "4",
        "nvidia.com/cuda.runtime-version.full": "12.4",
    }


@pytest.mark.parametrize(
    ("pci_class", "mode"),
    [("0x030200", "compute"), ("0x030000", "graphics"), ("0x038000", "unknown"), ("", "unknown")],
)
def test_gpu_mode_from_the_first_gpus_pci_class(pci_class: str, mode: str) -> None:
    first, second = (g.pci_bus_id for g in H100_NODE.gpus)
    host = HostFacts(pci_classes={first: pci_class, second: "0x030000"})
    assert node_labels(H100_NODE, host=host)["nvidia.com/gpu.mode"] == mode


def test_vgpu_labels() -> None:
    host = HostFacts(vgpus=(Vgpu("0000:05:00.0", "460.16", "r460_00"),))
    labels = node_labels(H100_NODE, host=host)
    assert {k: v for k, v in labels.items() if "vgpu" in k} == {
        "nvidia.com/vgpu.present": "true",
        "nvidia.com/vgpu.host-driver-version": "460.16",
        "nvidia.com/vgpu.host-driver-branch": "r460_00",
    }
    # No vGPU: GFD writes vgpu.present=false; where it cannot look, no vgpu label at all.
    labels = node_labels(H100_NODE, host=HostFacts(vgpus=()))
    assert {k: v for k, v in labels.items() if "vgpu" in k} == {"nvidia.com/vgpu.present": "false"}
    labels = node_labels(H100_NODE, host=HostFacts(vgpus=None))
    assert not any("vgpu" in k for k in labels)


@pytest.mark.parametrize(
    ("name", "capable"),
    [("NVIDIA H100 80GB HBM3", "true"), ("NVIDIA A100-SXM4-40GB", "true"),
     ("NVIDIA L40S", "false"), ("Tesla T4", "false"), ("NVIDIA B200", "true")],
)  # fmt: skip
def test_mig_capable_guess(name: str, capable: str) -> None:
    assert node_labels(node(gpu(0, name=name)))["nvidia.com/mig.capable"] == capable


@pytest.mark.parametrize(
    ("answers", "names", "capable"),
    [
        pytest.param((True,), ("Tesla T4",), "true", id="driver-yes-name-no"),
        pytest.param((False,), ("NVIDIA H100 80GB HBM3",), "false", id="driver-no-name-yes"),
        pytest.param((False, True), ("Tesla T4", "NVIDIA A100-SXM4-40GB"), "true", id="any-yes"),
        pytest.param((False, None), ("Tesla T4", "NVIDIA H100 80GB HBM3"), "false", id="no-guess"),
        pytest.param((None, None), ("Tesla T4", "NVIDIA H100 80GB HBM3"), "true", id="all-unknown"),
    ],
)
def test_mig_capable_from_the_driver(
    answers: tuple[bool | None, ...], names: tuple[str, ...], capable: str
) -> None:
    """The driver's answers decide; the name is guessed from only when no GPU's is known."""
    pairs = enumerate(zip(answers, names, strict=True))
    gpus = (gpu(i, name=name, mig_capable=answer) for i, (answer, name) in pairs)
    assert node_labels(node(*gpus))["nvidia.com/mig.capable"] == capable


def test_heterogeneous_node_describes_the_most_numerous_model() -> None:
    snapshot = node(
        gpu(0, name="Tesla T4", memory_mib=15360, compute_capability="7.5"),
        gpu(1, name="NVIDIA L4", memory_mib=23034, compute_capability="8.9"),
        gpu(2, name="NVIDIA L4", memory_mib=23034, compute_capability="8.9"),
    )
    labels = node_labels(snapshot)
    assert (labels["nvidia.com/gpu.product"], labels["nvidia.com/gpu.count"]) == ("NVIDIA-L4", "2")
    assert labels["nvidia.com/gpu.family"] == "ada-lovelace"


@pytest.mark.parametrize(
    ("driver", "expected"),
    [("535.104", ("535", "104", "")), ("bogus", None), ("", None), ("1.2.3.4", None)],
)
def test_driver_versions(driver: str, expected: tuple[str, str, str] | None) -> None:
    labels = node_labels(node(gpu(0), driver=driver))
    got = tuple(labels.get(f"nvidia.com/cuda.driver.{k}") for k in ("major", "minor", "rev"))
    assert got == (expected or (None, None, None))


def test_unknown_compute_capability_has_no_family() -> None:
    labels = node_labels(node(gpu(0, compute_capability="")))
    assert "nvidia.com/gpu.family" not in labels


def test_product_is_sanitised_and_capped() -> None:
    labels = node_labels(node(gpu(0, name="NVIDIA  Weird/GPU (x)  " + "Z" * 80)))
    product = labels["nvidia.com/gpu.product"]
    assert product.startswith("NVIDIA-WeirdGPU-x-ZZZ")
    assert len(product) == 63


@pytest.mark.parametrize(
    ("major", "minor", "family"),
    [(3, 5, "kepler"), (6, 0, "pascal"), (7, 0, "volta"), (7, 5, "turing"), (8, 0, "ampere"),
     (8, 6, "ampere"), (8, 9, "ada-lovelace"), (9, 0, "hopper"), (10, 0, "blackwell"),
     (12, 0, "blackwell"), (4, 0, "undefined"), (11, 0, "undefined")],
)  # fmt: skip
def test_arch_family(major: int, minor: int, family: str) -> None:
    assert arch_family(major, minor) == family


def test_no_gpus_no_labels() -> None:
    assert node_labels(node()) == {}


def test_feature_file_format() -> None:
    assert render_features({"b": "2", "a": "1"}) == b"a=1\nb=2\n"


def test_sync_features(tmp_path: Path) -> None:
    path = tmp_path / "features.d" / "gpuagent"
    labels = node_labels(H100_NODE)
    assert sync_features(labels, path) is True
    assert path.read_text().splitlines()[0] == "nvidia.com/cuda.driver-version.full=550.54.15"
    inode = path.stat().st_ino
    assert sync_features(dict(labels), path) is False
    assert path.stat().st_ino == inode
    assert sync_features(node_labels(H100_NODE, shared(2)), path) is True
    assert "nvidia.com/gpu.replicas=2\n" in path.read_text()
    assert [p.name for p in path.parent.iterdir()] == ["gpuagent"]
    assert sync_features({}, path) is True
    assert not path.exists()
