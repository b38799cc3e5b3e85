"""Finding the driver's files under a driver root, as NVIDIA's container toolkit finds them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from support.driverroot import LIBDIR, LIBRARY_PATHS, VERSION, can_mknod, make_driver_root

from gpuagent.nodefiles.driverfiles import DriverRoot, DrmNodes, Symlink, sysfs_address

BUS = "00000000:18:00.0"


def driver_root(root: Path) -> DriverRoot:
    return DriverRoot(root, kernel_release="6.1.0-test", firmware_class_path=root / "no-such-file")


def test_everything_of_the_running_version(tmp_path: Path) -> None:
    fake = make_driver_root(tmp_path)
    files = driver_root(tmp_path).find(VERSION)
    assert files.version == VERSION
    assert files.libraries == LIBRARY_PATHS
    assert set(files.libraries) == set(fake.libraries)
    assert files.library_dirs == (LIBDIR, f"{LIBDIR}/vdpau")
    # Binaries: the executable ones, each at the first PATH directory that has it.
    assert files.binaries == (
        "/usr/bin/nvidia-smi",
        "/usr/sbin/nvidia-persistenced",
        "/usr/bin/nvidia-cuda-mps-control",
    )
    assert files.ipc == ("/var/run/nvidia-persistenced/socket", "/tmp/nvidia-mps")
    # /var/run -> /run inside the root: mounted from there, not through the host's /var/run.
    assert dict(files.sources) == {
        "/var/run/nvidia-persistenced/socket": "/run/nvidia-persistenced/socket"
    }
    assert files.source("/usr/bin/nvidia-smi") == "/usr/bin/nvidia-smi"
    assert files.firmware == (
        f"/lib/firmware/nvidia/{VERSION}/gsp_ga10x.bin",
        f"/lib/firmware/nvidia/{VERSION}/gsp_tu10x.bin",
    )


def test_library_links_mirror_the_host_and_add_the_toolkits(tmp_path: Path) -> None:
    make_driver_root(tmp_path)
    links = driver_root(tmp_path).find(VERSION).library_links
    assert [str(s) for s in links] == [
        f"libGLX_nvidia.so.{VERSION}::{LIBDIR}/libGLX_indirect.so.0",  # toolkit: GLVND
        f"libGLX_nvidia.so.{VERSION}::{LIBDIR}/libGLX_nvidia.so.0",  # host SONAME links
        f"libcuda.so.1::{LIBDIR}/libcuda.so",  # toolkit: libcuda.so for dlopen
        f"libcuda.so.{VERSION}::{LIBDIR}/libcuda.so.1",
        f"libnvidia-ml.so.{VERSION}::{LIBDIR}/libnvidia-ml.so.1",
        f"libnvidia-opticalflow.so.1::{LIBDIR}/libnvidia-opticalflow.so",  # toolkit
        f"libnvidia-ptxjitcompiler.so.{VERSION}::{LIBDIR}/libnvidia-ptxjitcompiler.so.1",
        f"libvdpau_nvidia.so.{VERSION}::{LIBDIR}/vdpau/libvdpau_nvidia.so.1",
    ]
    # libz.so.1 points at a library that is not the driver's: not recreated.
    assert not any("libz" in s.link for s in links)


def test_host_dev_link_keeps_its_chain(tmp_path: Path) -> None:
    make_driver_root(tmp_path)
    (tmp_path / LIBDIR.lstrip("/") / "libcuda.so").symlink_to("libcuda.so.1")
    links = {s.link: s.target for s in driver_root(tmp_path).find(VERSION).library_links}
    assert links[f"{LIBDIR}/libcuda.so"] == "libcuda.so.1"


def test_another_version_finds_its_own_libraries_only(tmp_path: Path) -> None:
    make_driver_root(tmp_path)
    files = driver_root(tmp_path).find("535.104.05")
    assert files.libraries == (f"{LIBDIR}/libcuda.so.535.104.05",)
    assert files.firmware == ("/lib/firmware/nvidia/535.104.05/gsp_ga10x.bin",)


@pytest.mark.parametrize("version", ["", "999.1", "../../etc", "."])
def test_no_libraries_for_an_absent_or_odd_version(tmp_path: Path, version: str) -> None:
    make_driver_root(tmp_path)
    files = driver_root(tmp_path).find(version)
    assert (files.libraries, files.library_links, files.firmware) == ((), (), ())
    assert files.binaries  # the tools do not depend on the version


def test_libraries_in_a_directory_named_by_ld_so_conf(tmp_path: Path) -> None:
    make_driver_root(tmp_path, libdir="/opt/nvidia/lib64")
    assert driver_root(tmp_path).find(VERSION).libraries == ()
    conf = tmp_path / "etc/ld.so.conf"
    conf.parent.mkdir(parents=True, exist_ok=True)
    conf.write_text("# system\ninclude ld.so.conf.d/*.conf\n")
    (tmp_path / "etc/ld.so.conf.d").mkdir()
    (tmp_path / "etc/ld.so.conf.d/nvidia.conf").write_text("/opt/nvidia/lib64  # driver\n")
    files = driver_root(tmp_path).find(VERSION)
    assert f"/opt/nvidia/lib64/libcuda.so.{VERSION}" in files.libraries


def test_links_resolve_inside_the_root_not_on_the_host(tmp_path: Path) -> None:
    make_driver_root(tmp_path)
    root = driver_root(tmp_path)
    assert root.resolve("/var/run/nvidia-persistenced/socket") == "/run/nvidia-persistenced/socket"
    (tmp_path / "escape").symlink_to("../../../../etc/passwd")
    assert root.resolve("/escape") is None  # ".." stops at the root: no /etc/passwd inside it
    (tmp_path / "loop").symlink_to("loop")
    assert root.resolve("/loop") is None


def test_library_that_is_a_link_is_mounted_as_its_file(tmp_path: Path) -> None:
    make_driver_root(tmp_path, libdir="/usr/lib64")
    lib64 = tmp_path / "usr/lib64"
    os.replace(lib64 / f"libcuda.so.{VERSION}", lib64 / "real-libcuda")
    (lib64 / f"libcuda.so.{VERSION}").symlink_to("/usr/lib64/real-libcuda")
    files = driver_root(tmp_path).find(VERSION)
    assert "/usr/lib64/real-libcuda" in files.libraries
    assert f"/usr/lib64/libcuda.so.{VERSION}" not in files.libraries


def test_firmware_in_the_kernel_specific_and_custom_directories(tmp_path: Path) -> None:
    make_driver_root(tmp_path)
    custom = tmp_path / "custom-firmware-path"
    custom.write_text("/opt/firmware\n")
    for where in ("/opt/firmware", "/lib/firmware/updates/6.1.0-test"):
        target = tmp_path / where.lstrip("/") / "nvidia" / VERSION / "gsp_x.bin"
        target.parent.mkdir(parents=True)
        target.write_text("x")
    root = DriverRoot(tmp_path, kernel_release="6.1.0-test", firmware_class_path=custom)
    assert root.find(VERSION).firmware == (
        f"/opt/firmware/nvidia/{VERSION}/gsp_x.bin",
        f"/lib/firmware/updates/6.1.0-test/nvidia/{VERSION}/gsp_x.bin",
        f"/lib/firmware/nvidia/{VERSION}/gsp_ga10x.bin",
        f"/lib/firmware/nvidia/{VERSION}/gsp_tu10x.bin",
    )


@pytest.mark.skipif(not can_mknod(), reason="device nodes need root (mknod)")
def test_drm_nodes_by_pci_address(tmp_path: Path) -> None:
    make_driver_root(tmp_path, bus_ids=(BUS,))
    files = driver_root(tmp_path).find(VERSION, [BUS, "00000000:99:00.0"])
    assert files.drm[BUS] == DrmNodes(
        ("/dev/dri/card1", "/dev/dri/renderD128"),
        (
            Symlink("../card1", "/dev/dri/by-path/pci-0000:18:00.0-card"),
            Symlink("../renderD128", "/dev/dri/by-path/pci-0000:18:00.0-render"),
        ),
    )
    assert files.drm["00000000:99:00.0"] == DrmNodes()


def test_drm_link_to_a_regular_file_is_ignored(tmp_path: Path) -> None:
    make_driver_root(tmp_path)
    (tmp_path / "dev/dri/by-path").mkdir(parents=True)
    (tmp_path / "dev/dri/card1").write_text("not a device")
    (tmp_path / "dev/dri/by-path/pci-0000:18:00.0-card").symlink_to("../card1")
    assert driver_root(tmp_path).find(VERSION, [BUS]).drm[BUS] == DrmNodes()


def test_an_empty_root_finds_nothing(tmp_path: Path) -> None:
    files = driver_root(tmp_path / "absent").find(VERSION, [BUS])
    assert (files.libraries, files.binaries, files.ipc, files.firmware) == ((), (), (), ())


@pytest.mark.parametrize(
    ("bus_id", "address"),
    [("00000000:18:00.0", "0000:18:00.0"), ("00000001:AB:00.1", "0001:ab:00.1"),
     ("0000:18:00.0", "0000:18:00.0"), ("bogus", "bogus")],
)  # fmt: skip
def test_sysfs_address(bus_id: str, address: str) -> None:
    assert sysfs_address(bus_id) == address
