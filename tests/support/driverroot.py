"""A fake NVIDIA driver installation on disk: libraries named by a driver version, tools, sockets,
firmware and (as root) real character-device nodes, laid out as a Debian/Ubuntu host has them."""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

__all__ = ["FakeDriver", "can_mknod", "make_driver_root"]

VERSION = "550.54.15"
LIBDIR = "/usr/lib/x86_64-linux-gnu"
# (file, SONAME link on the host or None)
LIBRARIES = (
    ("libcuda.so", "libcuda.so.1"),
    ("libnvidia-ml.so", "libnvidia-ml.so.1"),
    ("libnvidia-ptxjitcompiler.so", "libnvidia-ptxjitcompiler.so.1"),
    ("libnvidia-opticalflow.so", None),
    ("libGLX_nvidia.so", "libGLX_nvidia.so.0"),
)
# What a lookup of VERSION in the fake root finds, by path (the vdpau one included).
LIBRARY_PATHS = (
    f"{LIBDIR}/libGLX_nvidia.so.{VERSION}",
    f"{LIBDIR}/libcuda.so.{VERSION}",
    f"{LIBDIR}/libnvidia-ml.so.{VERSION}",
    f"{LIBDIR}/libnvidia-opticalflow.so.{VERSION}",
    f"{LIBDIR}/libnvidia-ptxjitcompiler.so.{VERSION}",
    f"{LIBDIR}/vdpau/libvdpau_nvidia.so.{VERSION}",
)
NULL_DEVICE = (1, 3)  # major, minor of /dev/null: harmless to open inside a container


@dataclass(frozen=True)
class FakeDriver:
    root: Path
    version: str
    libraries: tuple[str, ...]
    has_device_nodes: bool


def can_mknod() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def _file(root: Path, path: str, text: str = "", mode: int = 0o644) -> None:
    target = root / path.lstrip("/")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text or f"fake {path}\n")
    target.chmod(mode)


def _link(root: Path, path: str, target: str) -> None:
    link = root / path.lstrip("/")
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(target)


def _char(root: Path, path: str) -> bool:
    node = root / path.lstrip("/")
    node.parent.mkdir(parents=True, exist_ok=True)
    if not can_mknod():
        return False
    os.mknod(node, 0o666 | stat.S_IFCHR, os.makedev(*NULL_DEVICE))
    return True


def make_driver_root(
    root: Path,
    *,
    version: str = VERSION,
    gpu_minors: tuple[int, ...] = (0, 1),
    caps: tuple[int, ...] = (),
    bus_ids: tuple[str, ...] = (),
    libdir: str = LIBDIR,
) -> FakeDriver:
    """Lay out a driver of ``version`` under ``root``; device nodes only when running as root.

    ``bus_ids`` get DRM nodes (``/dev/dri/card<N+1>``, ``renderD<128+N>``) and by-path links.
    """
    libraries = []
    for name, soname in LIBRARIES:
        path = f"{libdir}/{name}.{version}"
        _file(root, path)
        libraries.append(path)
        if soname:
            _link(root, f"{libdir}/{soname}", f"{name}.{version}")
    _file(root, f"{libdir}/vdpau/libvdpau_nvidia.so.{version}")
    libraries.append(f"{libdir}/vdpau/libvdpau_nvidia.so.{version}")
    _link(root, f"{libdir}/vdpau/libvdpau_nvidia.so.1", f"libvdpau_nvidia.so.{version}")
    # Another driver's leftovers and unrelated libraries: never mounted.
    _file(root, f"{libdir}/libcuda.so.535.104.05")
    _file(root, f"{libdir}/libz.so.1.2.13")
    _link(root, f"{libdir}/libz.so.1", "libz.so.1.2.13")
    # Tools: one not executable (skipped), one found in /usr/sbin through /sbin -> usr/sbin.
    _file(root, "/usr/bin/nvidia-smi", "#!/bin/sh\necho fake nvidia-smi\n", 0o755)
    _file(root, "/usr/bin/nvidia-debugdump", mode=0o644)
    _file(root, "/usr/bin/nvidia-cuda-mps-control", mode=0o755)
    _file(root, "/usr/sbin/nvidia-persistenced", mode=0o755)
    _link(root, "/sbin", "usr/sbin")
    # IPC: /var/run -> /run (absolute: must resolve inside the root, not on the host).
    _link(root, "/var/run", "/run")
    _file(root, "/run/nvidia-persistenced/socket")
    (root / "tmp/nvidia-mps").mkdir(parents=True)
    # GSP firmware of this version and of the other one.
    _file(root, f"/lib/firmware/nvidia/{version}/gsp_ga10x.bin")
    _file(root, f"/lib/firmware/nvidia/{version}/gsp_tu10x.bin")
    _file(root, "/lib/firmware/nvidia/535.104.05/gsp_ga10x.bin")
    nodes = True
    for path in ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"):
        nodes = _char(root, path) and nodes
    for minor in gpu_minors:
        nodes = _char(root, f"/dev/nvidia{minor}") and nodes
    for cap in caps:
        nodes = _char(root, f"/dev/nvidia-caps/nvidia-cap{cap}") and nodes
    for n, bus_id in enumerate(bus_ids):
        address = f"{int(bus_id.split(':')[0], 16):04x}:{bus_id.split(':', 1)[1].lower()}"
        nodes = _char(root, f"/dev/dri/card{n + 1}") and nodes
        nodes = _char(root, f"/dev/dri/renderD{128 + n}") and nodes
        _link(root, f"/dev/dri/by-path/pci-{address}-card", f"../card{n + 1}")
        _link(root, f"/dev/dri/by-path/pci-{address}-render", f"../renderD{128 + n}")
    return FakeDriver(root, version, tuple(sorted(libraries)), nodes)
