"""The labels file on simulated nodes, against GPU feature discovery's label set.

Each node runs the real NVML backend on the simulated driver (discovery reads names, memory,
compute capability, the CUDA version, MIG devices and their attributes) beside a fake ``/sys``
(DMI product name, PCI class and configuration space), and the agent's label writer produces the
NFD feature file. The expected sets are GFD's: the labels its README lists ("Generated Labels",
the MIG ``single`` and ``mixed`` tables) plus those its labelers write beyond the README
(``cuda.driver-version.*``, ``cuda.runtime-version.*``, ``gpu.replicas``,
``gpu.sharing-strategy``, ``mig.capable``, ``mps.capable``), each with the value GFD derives from
the same NVML answers (values typed out here, not computed by the code under test). Left out,
deliberately: ``gfd.timestamp``; ``gpu.clique`` and ``gpu.imex-domain`` (GB200 NVL fabric only).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from gpuagent.domain.resources import MigStrategy, ResourceSettings
from gpuagent.gpu.monitor import GpuMonitor
from gpuagent.gpu.nvml import Nvml
from gpuagent.gpu.sim import SimDriver, installed, node_from_mapping
from gpuagent.gpu.sim.spec import mig_minors_text
from gpuagent.nodefiles.driverfiles import sysfs_address
from gpuagent.nodefiles.labelkeeper import LabelTarget, write_labels
from gpuagent.state.store import DeviceStore

# What every node here has: driver 580.95.05 with CUDA 13.0, MIG-capable GPUs, no MPS.
DRIVER = {
    "nvidia.com/cuda.driver.major": "580",
    "nvidia.com/cuda.driver.minor": "95",
    "nvidia.com/cuda.driver.rev": "05",
    "nvidia.com/cuda.driver-version.major": "580",
    "nvidia.com/cuda.driver-version.minor": "95",
    "nvidia.com/cuda.driver-version.revision": "05",
    "nvidia.com/cuda.driver-version.full": "580.95.05",
    "nvidia.com/cuda.runtime.major": "13",
    "nvidia.com/cuda.runtime.minor": "0",
    "nvidia.com/cuda.runtime-version.major": "13",
    "nvidia.com/cuda.runtime-version.minor": "0",
    "nvidia.com/cuda.runtime-version.full": "13.0",
    "nvidia.com/mig.capable": "true",
    "nvidia.com/mps.capable": "false",
    "nvidia.com/gpu.mode": "compute",
    "nvidia.com/gpu.sharing-strategy": "none",
    # The whole PCI configuration space is readable and names no vGPU: GFD's vGPU labeler
    # (internal/lm/vgpu.go) writes present=false.
    "nvidia.com/vgpu.present": "false",
}
H100 = {
    "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
    "nvidia.com/gpu.memory": "81559",
    "nvidia.com/gpu.family": "hopper",
    "nvidia.com/gpu.compute.major": "9",
    "nvidia.com/gpu.compute.minor": "0",
}


def mig_type(key: str, product: str, count: int, memory: int, sms: int, slices: int,
             copy: int, dec: int, jpeg: int, ofa: int) -> dict[str, str]:  # fmt: skip
    """One MIG type's labels (GFD: product, count, replicas, then the device's attributes)."""
    return {
        f"{key}.product": product,
        f"{key}.count": str(count),
        f"{key}.replicas": "1",
        f"{key}.memory": str(memory),
        f"{key}.multiprocessors": str(sms),
        f"{key}.slices.gi": str(slices),
        f"{key}.slices.ci": str(slices),
        f"{key}.engines.copy": str(copy),
        f"{key}.engines.decoder": str(dec),
        f"{key}.engines.encoder": "0",
        f"{key}.engines.jpeg": str(jpeg),
        f"{key}.engines.ofa": str(ofa),
    }


CASES: dict[str, tuple[dict[str, Any], MigStrategy, str, dict[str, str]]] = {
    "h100": (
        {"gpus": [{"name": "H100"}] * 8},
        MigStrategy.NONE,
        "DGX H100",
        {**DRIVER, **H100, "nvidia.com/gpu.count": "8", "nvidia.com/gpu.replicas": "1",
         "nvidia.com/gpu.machine": "DGX-H100"},
    ),
    "a100": (
        {"gpus": [{"name": "A100-SXM4-40GB"}] * 8},
        MigStrategy.NONE,
        "DGXA100 920-23687-2530-000",
        {**DRIVER,
         "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB",
         "nvidia.com/gpu.memory": "40960",
         "nvidia.com/gpu.family": "ampere",
         "nvidia.com/gpu.compute.major": "8",
         "nvidia.com/gpu.compute.minor": "0",
         "nvidia.com/gpu.count": "8",
         "nvidia.com/gpu.replicas": "1",
         "nvidia.com/gpu.machine": "DGXA100-920-23687-2530-000"},
    ),
    "mig-mixed": (
        {"gpus": [{"name": "H100", "mig": ["3g.40gb", "3g.40gb"]},
                  {"name": "H100", "mig": ["1g.10gb", "1g.10gb", "1g.10gb"]},
                  {"name": "H100"}]},
        MigStrategy.MIXED,
        "PowerEdge XE9680",
        # Full-GPU labels count every GPU of the model; the one without MIG sets replicas.
        {**DRIVER, **H100, "nvidia.com/gpu.count": "3", "nvidia.com/gpu.replicas": "1",
         "nvidia.com/gpu.machine": "PowerEdge-XE9680",
         "nvidia.com/mig.strategy": "mixed",
         **mig_type("nvidia.com/mig-3g.40gb", "NVIDIA-H100-80GB-HBM3-MIG-3g.40gb", 2, 40448,
                    60, 3, 3, 3, 3, 0),
         **mig_type("nvidia.com/mig-1g.10gb", "NVIDIA-H100-80GB-HBM3-MIG-1g.10gb", 3, 9984,
                    16, 1, 1, 1, 1, 0)},
    ),
    "mig-single": (
        {"gpus": [{"name": "H100", "mig": ["1g.10gb"] * 7}] * 2},
        MigStrategy.SINGLE,
        "DGX H100",
        # MIG type labels override the full-GPU ones under nvidia.com/gpu.
        {**DRIVER, **H100, "nvidia.com/gpu.machine": "DGX-H100",
         "nvidia.com/mig.strategy": "single",
         **mig_type("nvidia.com/gpu", "NVIDIA-H100-80GB-HBM3-MIG-1g.10gb", 14, 9984,
                    16, 1, 1, 1, 1, 0)},
    ),
}  # fmt: skip


def fake_sys(root: Path, bus_ids: list[str], product: str) -> Path:
    """/sys with the DMI product name and, per GPU, a 3D controller's class and config space."""
    (root / "class/dmi/id").mkdir(parents=True)
    (root / "class/dmi/id/product_name").write_text(product + "\n")
    for bus_id in bus_ids:
        device = root / "bus/pci/devices" / sysfs_address(bus_id)
        device.mkdir(parents=True)
        (device / "vendor").write_text("0x10de\n")
        (device / "class").write_text("0x030200\n")
        config = bytearray(256)
        config[0:2] = b"\xde\x10"
        (device / "config").write_bytes(bytes(config))  # no capability list: not a vGPU
    return root


async def labels_file(node: Mapping[str, Any], strategy: MigStrategy, product: str,
                      tmp_path: Path) -> dict[str, str]:  # fmt: skip
    # With CAP_SYS_ADMIN, as GFD runs: a MIG GPU's total memory is readable (docs/health.md).
    sim = SimDriver(node_from_mapping({"version": "v1", "cap_sys_admin": True, **node}))
    minors = tmp_path / "mig-minors"
    minors.write_text(mig_minors_text(sim.node))
    sysfs = fake_sys(tmp_path / "sys", [g.pci_bus_id for g in sim.node.gpus], product)
    store = DeviceStore()
    with installed(sim):
        monitor = GpuMonitor(store, Nvml(sysfs, mig_minors=minors), poll_interval=60)
        try:
            await monitor.start()
        finally:
            await monitor.close()
    target = LabelTarget(
        path=tmp_path / "features.d" / "gpuagent",
        machine_type_file=sysfs / "class/dmi/id/product_name",
        sysfs_root=sysfs,
    )
    assert write_labels(store.snapshot, ResourceSettings(mig_strategy=strategy), target)
    text = target.path.read_text()
    return dict(line.split("=", 1) for line in text.splitlines())


@pytest.mark.asyncio(loop_factories=["asyncio"])
@pytest.mark.parametrize("case", sorted(CASES))
async def test_labels_file_matches_gfds_label_set(case: str, tmp_path: Path) -> None:
    node, strategy, product, expected = CASES[case]
    labels = await labels_file(node, strategy, product, tmp_path)
    assert set(labels) == set(expected), {
        "missing": sorted(set(expected) - set(labels)),
        "extra": sorted(set(labels) - set(expected)),
    }
    assert labels == expected
