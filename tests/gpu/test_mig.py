"""MIG discovery (``read_mig``) through pynvml over the simulated driver, and its pure helpers."""

from __future__ import annotations

import gc
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path

import pynvml
import pytest
import structlog.testing
from support.simnvml import Run

from gpuagent.domain.devices import MigDevice
from gpuagent.gpu.mig import (
    MIG_MINORS_FILE,
    load_mig_minors,
    mig_device_nodes,
    mig_memory_gb,
    mig_profile_name,
    parse_mig_minors,
    read_mig,
)
from gpuagent.gpu.sim import SimDriver, installed, node_from_mapping
from gpuagent.gpu.sim.profiles import PROFILES
from gpuagent.gpu.sim.spec import SimNode, mig_minors_text

MIB = 1024 * 1024
A100_40GB_MIB, A100_80GB_MIB, H100_MIB, H200_MIB = 40960, 81920, 81559, 143771
MISSING_MINORS_LOG = "mig capability minors unreadable; mig devices get no device nodes"
P = pynvml

# A100 80GB and H100 80GB, each with a mixed layout; an A100 40GB cut in seven; a plain H100.
LAYOUTS = {
    "version": "v1",
    "gpus": [
        {"name": "A100-80GB", "mig": ["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"]},
        {"name": "H100", "mig": ["3g.40gb", "1g.20gb", "1g.10gb+me", "1g.10gb"]},
        {"name": "A100-40GB", "mig": ["1g.5gb"] * 7},
        {"name": "H100"},
    ],
}


@pytest.fixture
def node() -> SimNode:
    """The layouts, read with CAP_SYS_ADMIN (see TestWithoutCapSysAdmin for the default)."""
    return node_from_mapping({**LAYOUTS, "cap_sys_admin": True})


@pytest.fixture
def minors(tmp_path: Path, node: SimNode) -> Path:
    """The simulated node's mig-minors file."""
    path = tmp_path / "mig-minors"
    path.write_text(mig_minors_text(node))
    return path


def read(index: int, minors: Path) -> tuple[bool, tuple[MigDevice, ...]]:
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    return read_mig(index, handle, int(pynvml.nvmlDeviceGetMinorNumber(handle)), mig_minors=minors)


def cap(gpu_minor: int, gi: int, ci: int | None = None) -> str:
    """The nvidia-caps node of a GPU or compute instance by the kernel's numbering."""
    minor = 3 + gpu_minor * 135 + gi * 9 + (0 if ci is None else 1 + ci)
    return f"/dev/nvidia-caps/nvidia-cap{minor}"


def summary(devices: tuple[MigDevice, ...]) -> list[tuple[str, int, int, int]]:
    return sorted(
        (d.profile, d.gpu_instance_id, d.compute_instance_id, d.memory_mib) for d in devices
    )


class TestReadMig:
    @pytest.mark.parametrize(
        ("gpu", "expected"),
        [
            (
                0,
                [
                    ("1g.10gb", 7, 0, 9728),
                    ("1g.10gb", 8, 0, 9728),
                    ("2g.20gb", 4, 0, 19968),
                    ("3g.40gb", 2, 0, 40448),
                ],
            ),
            (
                1,
                [
                    ("1g.10gb", 7, 0, 9984),
                    ("1g.10gb+me", 8, 0, 9984),
                    ("1g.20gb", 4, 0, 20096),
                    ("3g.40gb", 2, 0, 40448),
                ],
            ),
            (2, [("1g.5gb", gi, 0, 4864) for gi in range(7, 14)]),
        ],
    )
    def test_devices(
        self,
        run: Run,
        node: SimNode,
        minors: Path,
        gpu: int,
        expected: list[tuple[str, int, int, int]],
    ) -> None:
        """Each MIG device: profile name, GI/CI IDs, memory, MIG- UUID and caps device nodes."""
        run(node)
        enabled, devices = read(gpu, minors)
        assert enabled
        assert summary(devices) == expected
        spec = node.gpus[gpu]
        assert {d.uuid for d in devices} == {m.uuid for m in spec.mig_devices}
        for device in devices:
            assert device.uuid.startswith("MIG-")
            assert device.parent_index == gpu
            gi, ci = device.gpu_instance_id, device.compute_instance_id
            assert device.device_nodes == (cap(spec.minor, gi), cap(spec.minor, gi, ci))

    def test_mig_disabled(self, run: Run, node: SimNode, minors: Path) -> None:
        """A GPU with MIG mode off has no MIG devices."""
        run(node)
        assert read(3, minors) == (False, ())

    @pytest.mark.parametrize("how", ["not_supported", "removed"])
    def test_mig_mode_not_offered(self, run: Run, node: SimNode, minors: Path, how: str) -> None:
        """A GPU or driver without MIG support reads as MIG disabled."""
        driver = run(node)
        if how == "removed":
            driver.remove("nvmlDeviceGetMigMode")
        else:
            driver.fail("nvmlDeviceGetMigMode", int(P.NVML_ERROR_NOT_SUPPORTED), gpu=0)
        assert read(0, minors) == (False, ())

    def test_lost_gpu_raises(self, run: Run, node: SimNode, minors: Path) -> None:
        """A lost GPU is the caller's discovery error, not an empty MIG list."""
        driver = run(node)
        driver.inject(1, "lost")
        with pytest.raises(pynvml.NVMLError_GpuIsLost):
            read(1, minors)

    def test_lost_while_listing(self, run: Run, node: SimNode, minors: Path) -> None:
        """Losing the GPU between MIG mode and its devices raises too."""
        driver = run(node)
        driver.fail("nvmlDeviceGetGpuInstanceId", int(P.NVML_ERROR_GPU_IS_LOST))
        with pytest.raises(pynvml.NVMLError_GpuIsLost):
            read(0, minors)

    def test_missing_minors_file(self, run: Run, node: SimNode, tmp_path: Path) -> None:
        """Without the mig-minors file devices have no nodes; that is logged once for all GPUs."""
        run(node)
        missing = tmp_path / "absent" / "mig-minors"
        with structlog.testing.capture_logs() as logs:
            first = read(0, missing)
            second = read(1, missing)
        assert len(first[1]) == len(second[1]) == 4
        assert all(d.device_nodes == () for d in first[1] + second[1])
        assert [e["event"] for e in logs] == [MISSING_MINORS_LOG]

    def test_minors_file_without_this_gpu(self, run: Run, node: SimNode, tmp_path: Path) -> None:
        """A file lacking the GPU's entries leaves its devices without nodes (logged)."""
        run(node)
        path = tmp_path / "mig-minors"
        path.write_text("config 1\nmonitor 2\ngpu0/gi7/access 66\n")
        with structlog.testing.capture_logs() as logs:
            _, devices = read(0, path)
        assert all(d.device_nodes == () for d in devices)
        assert len([e for e in logs if e["event"] == "mig device has no capability minors"]) == 4

    def test_without_attributes(self, run: Run, node: SimNode, minors: Path) -> None:
        """Without the attributes call, profile info and memory info give the same devices
        (less the attributes themselves: SMs and engines for GFD's MIG labels)."""
        driver = run(node)
        enabled, with_attributes = read(1, minors)
        assert all(d.attributes is not None for d in with_attributes)
        driver.remove("nvmlDeviceGetAttributes_v2")
        assert read(1, minors) == (
            enabled,
            tuple(replace(d, attributes=None) for d in with_attributes),
        )

    def test_without_gpu_instance_lookup(self, run: Run, node: SimNode, minors: Path) -> None:
        """Unable to read the GPU instance's profile, names lose their +me suffix (logged once)."""
        driver = run(node)
        driver.remove("nvmlDeviceGetGpuInstanceById")
        with structlog.testing.capture_logs() as logs:
            _, devices = read(1, minors)
        assert sorted(d.profile for d in devices) == ["1g.10gb", "1g.10gb", "1g.20gb", "3g.40gb"]
        assert len(logs) == 1

    def test_unversioned_profile_info(self, run: Run, node: SimNode, minors: Path) -> None:
        """An older driver without the versioned profile call is read with the unversioned one."""
        driver = run(node)
        driver.remove("nvmlDeviceGetGpuInstanceProfileInfoV")
        _, devices = read(1, minors)
        assert "1g.10gb+me" in {d.profile for d in devices}

    def test_sparse_indexes(self, run: Run, node: SimNode, minors: Path) -> None:
        """A MIG device index with no device (NOT_FOUND) is skipped, not fatal."""
        driver = run(node)
        _, everything = read(0, minors)
        driver.fail("nvmlDeviceGetMigDeviceHandleByIndex", int(P.NVML_ERROR_NOT_FOUND), count=1)
        enabled, devices = read(0, minors)
        assert enabled
        assert devices == everything[1:]

    def test_count_not_offered(self, run: Run, node: SimNode, minors: Path) -> None:
        """MIG on but its devices not listable: enabled, no devices."""
        driver = run(node)
        driver.remove("nvmlDeviceGetMaxMigDeviceCount")
        assert read(0, minors) == (True, ())

    def test_configured_memory_scales_instances(self, run: Run, tmp_path: Path) -> None:
        """A GPU configured with other memory keeps each instance's share; names follow the rule."""
        node = node_from_mapping(
            {"version": "v1", "gpus": [{"name": "H100", "memory_mib": 40960, "mig": ["3g.40gb"]}]}
        )
        run(node)
        _, (device,) = read(0, tmp_path / "none")
        assert device.memory_mib == 40448 * 40960 // H100_MIB
        assert device.profile == "3g.20gb"


class TestSimulatedMig:
    """What the fake driver answers for MIG, through the pynvml wrappers."""

    def test_mig_device_handles(self, run: Run, node: SimNode) -> None:
        """MIG handles know their IDs, parent, UUID, name and memory, and resolve by UUID."""
        run(node)
        gpu = pynvml.nvmlDeviceGetHandleByIndex(1)
        assert pynvml.nvmlDeviceGetMaxMigDeviceCount(gpu) == 7
        # nvml.h: zero when MIG is not supported or not enabled (GPU 3: an H100, MIG off).
        full = pynvml.nvmlDeviceGetHandleByIndex(3)
        assert pynvml.nvmlDeviceGetMaxMigDeviceCount(full) == 0
        mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu, 0)
        spec = node.gpus[1].mig_devices[0]
        assert pynvml.nvmlDeviceIsMigDeviceHandle(mig).value == 1
        assert pynvml.nvmlDeviceIsMigDeviceHandle(gpu).value == 0
        assert pynvml.nvmlDeviceGetGpuInstanceId(mig) == spec.gpu_instance_id
        assert pynvml.nvmlDeviceGetComputeInstanceId(mig) == 0
        assert pynvml.nvmlDeviceGetUUID(mig) == spec.uuid
        assert pynvml.nvmlDeviceGetName(mig) == f"NVIDIA H100 80GB HBM3 MIG {spec.name}"
        assert pynvml.nvmlDeviceGetMemoryInfo(mig).total == spec.memory_mib * MIB
        parent = pynvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(mig)
        assert pynvml.nvmlDeviceGetUUID(parent) == node.gpus[1].uuid
        by_uuid = pynvml.nvmlDeviceGetHandleByUUID(spec.uuid)
        assert pynvml.nvmlDeviceGetGpuInstanceId(by_uuid) == spec.gpu_instance_id
        with pytest.raises(pynvml.NVMLError_NotFound):
            pynvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu, 4)
        with pytest.raises(pynvml.NVMLError_InvalidArgument):
            pynvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu, 7)
        with pytest.raises(pynvml.NVMLError_NotSupported):
            pynvml.nvmlDeviceGetGpuInstanceId(gpu)
        with pytest.raises(pynvml.NVMLError_NotSupported):
            pynvml.nvmlDeviceGetAttributes_v2(gpu)

    def test_instances_and_profiles(self, run: Run, node: SimNode) -> None:
        """GPU- and compute-instance info carry the profile ID and placement of each device."""
        run(node)
        gpu = pynvml.nvmlDeviceGetHandleByIndex(0)
        for spec in node.gpus[0].mig_devices:
            instance = pynvml.nvmlDeviceGetGpuInstanceById(gpu, spec.gpu_instance_id)
            info = pynvml.nvmlGpuInstanceGetInfo(instance)
            assert (info.id, info.profileId) == (spec.gpu_instance_id, spec.profile.profile_id)
            assert (info.placement.start, info.placement.size) == (
                spec.start,
                spec.profile.memory_slices,
            )
            compute = pynvml.nvmlGpuInstanceGetComputeInstanceById(instance, 0)
            ci = pynvml.nvmlComputeInstanceGetInfo(compute)
            assert (ci.id, ci.profileId, ci.placement.size) == (
                0,
                spec.profile.ci_profile,
                spec.profile.slices,
            )
            with pytest.raises(pynvml.NVMLError_NotFound):
                pynvml.nvmlGpuInstanceGetComputeInstanceById(instance, 1)
        with pytest.raises(pynvml.NVMLError_NotFound):
            pynvml.nvmlDeviceGetGpuInstanceById(gpu, 0)
        info = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(
            gpu, P.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1
        )
        assert (info.id, info.name, info.instanceCount) == (20, "MIG 1g.10gb+me", 1)
        with pytest.raises(pynvml.NVMLError_NotSupported):
            pynvml.nvmlDeviceGetGpuInstanceProfileInfo(gpu, P.NVML_GPU_INSTANCE_PROFILE_6_SLICE)
        plain = pynvml.nvmlDeviceGetHandleByIndex(3)
        with pytest.raises(pynvml.NVMLError_NotSupported):
            pynvml.nvmlDeviceGetGpuInstanceProfileInfo(plain, P.NVML_GPU_INSTANCE_PROFILE_1_SLICE)

    def test_lost_gpu_loses_its_mig_devices(self, run: Run, node: SimNode) -> None:
        """A lost GPU takes its MIG devices and instances with it; recovery brings them back."""
        driver = run(node)
        gpu = pynvml.nvmlDeviceGetHandleByIndex(0)
        mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu, 0)
        instance = pynvml.nvmlDeviceGetGpuInstanceById(
            gpu, node.gpus[0].mig_devices[0].gpu_instance_id
        )
        driver.inject(0, "lost")
        with pytest.raises(pynvml.NVMLError_GpuIsLost):
            pynvml.nvmlDeviceGetUUID(mig)
        with pytest.raises(pynvml.NVMLError_GpuIsLost):
            pynvml.nvmlGpuInstanceGetInfo(instance)
        driver.inject(0, "recover")
        assert pynvml.nvmlDeviceGetUUID(mig) == node.gpus[0].mig_devices[0].uuid


# Memory (MiB) of each instance as nvidia-smi mig -lgip reports it, and the names it shows.
KNOWN_NAMES = [
    # A100-SXM4-40GB
    (1, 1, 4864, A100_40GB_MIB, P.NVML_GPU_INSTANCE_PROFILE_1_SLICE, "1g.5gb"),
    (1, 1, 4864, A100_40GB_MIB, P.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1, "1g.5gb+me"),
    (1, 1, 9856, A100_40GB_MIB, P.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2, "1g.10gb"),
    (2, 2, 9856, A100_40GB_MIB, P.NVML_GPU_INSTANCE_PROFILE_2_SLICE, "2g.10gb"),
    (3, 3, 20096, A100_40GB_MIB, P.NVML_GPU_INSTANCE_PROFILE_3_SLICE, "3g.20gb"),
    (4, 4, 20096, A100_40GB_MIB, P.NVML_GPU_INSTANCE_PROFILE_4_SLICE, "4g.20gb"),
    (7, 7, 40448, A100_40GB_MIB, P.NVML_GPU_INSTANCE_PROFILE_7_SLICE, "7g.40gb"),
    # A100-SXM4-80GB
    (1, 1, 9728, A100_80GB_MIB, P.NVML_GPU_INSTANCE_PROFILE_1_SLICE, "1g.10gb"),
    (1, 1, 19968, A100_80GB_MIB, P.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2, "1g.20gb"),
    (2, 2, 19968, A100_80GB_MIB, P.NVML_GPU_INSTANCE_PROFILE_2_SLICE, "2g.20gb"),
    (3, 3, 40448, A100_80GB_MIB, P.NVML_GPU_INSTANCE_PROFILE_3_SLICE, "3g.40gb"),
    (7, 7, 81152, A100_80GB_MIB, P.NVML_GPU_INSTANCE_PROFILE_7_SLICE, "7g.80gb"),
    # H100 80GB HBM3 (9.75, 19.62, 39.50 and 79.25 GiB)
    (1, 1, 9984, H100_MIB, P.NVML_GPU_INSTANCE_PROFILE_1_SLICE, "1g.10gb"),
    (1, 1, 9984, H100_MIB, P.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1, "1g.10gb+me"),
    (1, 1, 20096, H100_MIB, P.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2, "1g.20gb"),
    (2, 2, 20096, H100_MIB, P.NVML_GPU_INSTANCE_PROFILE_2_SLICE, "2g.20gb"),
    (3, 3, 40448, H100_MIB, P.NVML_GPU_INSTANCE_PROFILE_3_SLICE, "3g.40gb"),
    (4, 4, 40448, H100_MIB, P.NVML_GPU_INSTANCE_PROFILE_4_SLICE, "4g.40gb"),
    (7, 7, 81152, H100_MIB, P.NVML_GPU_INSTANCE_PROFILE_7_SLICE, "7g.80gb"),
    # A compute instance smaller than its GPU instance; the other suffixes.
    (3, 1, 40448, H100_MIB, P.NVML_GPU_INSTANCE_PROFILE_3_SLICE, "1c.3g.40gb"),
    (7, 2, 81152, H100_MIB, None, "2c.7g.80gb"),
    (1, 1, 9984, H100_MIB, P.NVML_GPU_INSTANCE_PROFILE_1_SLICE_NO_ME, "1g.10gb-me"),
    (1, 1, 9984, H100_MIB, P.NVML_GPU_INSTANCE_PROFILE_1_SLICE_ALL_ME, "1g.10gb+me.all"),
    (2, 2, 20096, H100_MIB, P.NVML_GPU_INSTANCE_PROFILE_2_SLICE_GFX, "2g.20gb+gfx"),
    (1, 1, 9984, H100_MIB, None, "1g.10gb"),
    # H200: half of 141 GB is 70.5, which rounds up (banker's rounding would say 70).
    (3, 3, 71424, H200_MIB, P.NVML_GPU_INSTANCE_PROFILE_3_SLICE, "3g.71gb"),
]


@pytest.mark.parametrize(("g", "c", "memory", "total_mib", "gi_profile", "name"), KNOWN_NAMES)
def test_profile_name(
    g: int, c: int, memory: int, total_mib: int, gi_profile: int | None, name: str
) -> None:
    """Slice counts, memory and the GPU-instance profile give NVIDIA's profile names."""
    assert mig_profile_name(g, c, memory, total_mib * MIB, gi_profile) == name


@pytest.mark.parametrize("model", PROFILES, ids=lambda p: p.key)
def test_simulated_profiles_follow_the_rule(model: object) -> None:
    """Every simulated MIG profile's memory gives back its own name (sim and reader agree)."""
    for shape in model.mig_profiles:  # type: ignore[attr-defined]
        got = mig_profile_name(
            shape.slices,
            shape.slices,
            shape.memory_mib,
            model.memory_mib * MIB,  # type: ignore[attr-defined]
            shape.gi_profile,
        )
        assert got == shape.name


@pytest.mark.parametrize(
    ("memory", "total_bytes", "gb"),
    [
        (10240, 81920 * MIB, 10),  # exactly an eighth: stays an eighth
        (10241, 81920 * MIB, 20),  # a MiB over: the next eighth
        (1, 81920 * MIB, 10),
        (81920, 81920 * MIB, 80),
        (100, 0, 0),
        (0, 81920 * MIB, 0),
    ],
)
def test_memory_gb(memory: int, total_bytes: int, gb: int) -> None:
    """The share of memory rounds up to eighths before scaling; unknown sizes give 0."""
    assert mig_memory_gb(memory, total_bytes) == gb


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        ("", {}),
        ("invalidLine", {}),
        ("config 1", {"config": 1}),
        ("gpu0/gi0/ci0/access 4", {"gpu0/gi0/ci0/access": 4}),
        ("config 1\ninvalidLine\n", {"config": 1}),
        ("config 1\ngpu0/gi0/ci0/access 4\n", {"config": 1, "gpu0/gi0/ci0/access": 4}),
        ("  gpu1/gi2/access\t156  \r\n", {"gpu1/gi2/access": 156}),
        ("gpu0/gi1/access 12 extra", {}),
        ("gpu0/gi1/access -12", {}),
        ("gpu0/gi1/access twelve", {}),
        ("gpu0/gi1/access \u0661\u0662", {}),
        ("gpu0/gi1/access 12\ngpu0/gi1/access 13", {"gpu0/gi1/access": 13}),
        ("\n\nmonitor 2", {"monitor": 2}),
    ],
)
def test_parse_mig_minors(text: str, parsed: dict[str, int]) -> None:
    """Well-formed lines are kept, anything else skipped; the last of a repeated name wins."""
    assert parse_mig_minors(text) == parsed


@pytest.mark.parametrize(
    ("minors", "nodes"),
    [
        (
            {"gpu2/gi3/access": 300, "gpu2/gi3/ci0/access": 301},
            ("/dev/nvidia-caps/nvidia-cap300", "/dev/nvidia-caps/nvidia-cap301"),
        ),
        ({"gpu2/gi3/access": 300}, ()),
        ({"gpu2/gi3/ci0/access": 301}, ()),
        ({"gpu3/gi3/access": 300, "gpu3/gi3/ci0/access": 301}, ()),
    ],
)
def test_device_nodes(minors: dict[str, int], nodes: tuple[str, ...]) -> None:
    """A MIG device needs both its GPU-instance and compute-instance capability."""
    assert mig_device_nodes(minors, 2, 3, 0) == nodes


def test_minors_file_layout(node: SimNode) -> None:
    """The generated file matches the kernel module's numbering NVIDIA documents."""
    text = mig_minors_text(node)
    lines = text.splitlines()
    assert lines[:4] == ["config 1", "monitor 2", "gpu0/gi0/access 3", "gpu0/gi0/ci0/access 4"]
    assert len(lines) == 2 + 32 * 15 * 9
    assert lines[-1] == "gpu31/gi14/ci7/access 4322"
    parsed = parse_mig_minors(text)
    assert parsed["gpu3/gi3/ci3/access"] == 439
    assert parsed["gpu6/gi11/ci7/access"] == 920
    assert len(set(parsed.values())) == len(parsed)


def test_minors_file_covers_high_minors() -> None:
    """A node with more than 32 GPUs gets entries for all of them."""
    big = node_from_mapping({"version": "v1", "gpus": [{}] * 40})
    parsed = parse_mig_minors(mig_minors_text(big))
    assert parsed["gpu39/gi14/ci7/access"] == 3 + 40 * 135 - 1


class TestWithoutCapSysAdmin:
    """The base manifest drops every capability: the parent GPU's memory read is refused."""

    def test_parent_memory_is_refused(self, run: Run) -> None:
        run(node_from_mapping(LAYOUTS))
        handle = pynvml.nvmlDeviceGetHandleByIndex(1)
        with pytest.raises(pynvml.NVMLError_NoPermission):
            pynvml.nvmlDeviceGetMemoryInfo(handle)
        with pytest.raises(pynvml.NVMLError_NoPermission):
            pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
        mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, 0)
        assert pynvml.nvmlDeviceGetMemoryInfo(mig).total > 0  # per instance: allowed
        plain = pynvml.nvmlDeviceGetHandleByIndex(3)
        assert pynvml.nvmlDeviceGetMemoryInfo(plain).total == H100_MIB * MIB  # no MIG: allowed

    def test_same_devices_as_with_it(self, run: Run, minors: Path) -> None:
        """Profile names from the largest GPU-instance profile match the privileged read."""
        with ExitStack() as stack:
            stack.enter_context(installed(SimDriver(node_from_mapping(LAYOUTS))))
            pynvml.nvmlInit()
            with structlog.testing.capture_logs() as logs:
                refused = [read(i, minors) for i in range(4)]
            pynvml.nvmlShutdown()
        run(node_from_mapping({**LAYOUTS, "cap_sys_admin": True}))
        privileged = [read(i, minors) for i in range(4)]
        assert refused == privileged
        assert [e["gpu"] for e in logs if "CAP_SYS_ADMIN" in e["event"]] == [0, 1, 2]


def test_minors_file_is_parsed_again_only_when_it_changes(tmp_path: Path) -> None:
    path = tmp_path / "mig-minors"
    path.write_text("config 1\ngpu0/gi1/access 9\n")
    first = load_mig_minors(path)
    assert first == {"config": 1, "gpu0/gi1/access": 9}
    assert first is not None
    first["config"] = 99  # a caller's copy: the cache is not touched
    assert load_mig_minors(path) == {"config": 1, "gpu0/gi1/access": 9}
    path.write_text("config 1\ngpu0/gi1/access 9\ngpu0/gi1/ci0/access 10\n")
    assert load_mig_minors(path) == {"config": 1, "gpu0/gi1/access": 9, "gpu0/gi1/ci0/access": 10}


def test_a_simulated_node_has_its_own_proc_files() -> None:
    """Its mig-minors where the kernel module writes it (the agent reads the simulated node's,
    never the host's), and a boot of its own per driver; the folder goes with the driver."""
    node = node_from_mapping({"version": "v1", "gpus": [{"name": "H100", "mig": ["1g.10gb"]}]})
    driver = SimDriver(node)
    root = driver.proc_root
    assert (root / MIG_MINORS_FILE).read_text() == mig_minors_text(node)
    assert load_mig_minors(root / MIG_MINORS_FILE) == parse_mig_minors(mig_minors_text(node))
    boot = (root / "sys/kernel/random/boot_id").read_text()
    assert boot == f"{driver.boot_id}\n"
    assert SimDriver(node).boot_id != driver.boot_id
    assert SimDriver(node, boot_id="b-1").boot_id == "b-1"
    del driver
    gc.collect()
    assert not root.exists()
