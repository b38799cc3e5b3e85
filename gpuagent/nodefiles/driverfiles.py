"""The NVIDIA driver's user-space files under a driver root, found as the container toolkit does.

A container that is handed a GPU through CDI needs more than its device nodes: the driver's
libraries (``libcuda``, ``libnvidia-ml``, …), its tools (``nvidia-smi``), the sockets of its
daemons and the GSP firmware, all of the driver version the kernel module runs. The toolkit's
``nvidia-ctk cdi generate`` (and NVIDIA's device plugin, which uses the same library) finds them
this way, and so does :meth:`DriverRoot.find`:

* **libraries**: the directory holding ``libcuda.so.<version>`` (else ``libnvidia-ml.so.<version>``)
  among the usual library directories and those named by the root's ``/etc/ld.so.conf`` (the
  toolkit reads the binary ``ld.so.cache`` instead); then every ``*.so.<version>`` in it and in
  its ``vdpau`` subdirectory, and ``libnvidia-nvvm70.so.*``. Symbolic links are followed inside
  the root. The host's own links to those files (``libcuda.so.1 -> libcuda.so.550.54.15``, the
  SONAME links ``ldconfig`` makes) are recreated in the container, with the toolkit's three extra
  ones (``libcuda.so``, ``libGLX_indirect.so.0``, ``libnvidia-opticalflow.so``);
* **binaries**: ``nvidia-smi``, ``nvidia-debugdump``, ``nvidia-persistenced``, the MPS control
  and server, ``nvidia-imex`` and ``nvidia-imex-ctl``, the first executable of each name in the
  ``PATH`` directories;
* **IPC**: the persistence daemon's and fabric manager's sockets, the MPS pipe directory;
* **firmware**: ``nvidia/<version>/gsp*.bin`` in the kernel's firmware directories;
* **DRM nodes** of each GPU (``/dev/dri/cardN``, ``renderDN``) by their ``by-path`` links.

Paths are returned as the container sees them (absolute, relative to the driver root); the host
path is the driver root joined with :meth:`DriverFiles.source` of them (links followed inside the
root, as the host's runtime would otherwise follow an absolute one out of it). The root is read
where the agent sees it (``root``), which in a container is where the host's driver root is
mounted. Nothing here raises for a missing or unreadable file: what is not found is left out.
"""

from __future__ import annotations

import fnmatch
import glob
import os
import posixpath
import stat
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

__all__ = [
    "BINARIES",
    "IPC_PATHS",
    "LIBRARY_DIRS",
    "DriverFiles",
    "DriverRoot",
    "DrmNodes",
    "Symlink",
]

#: Where the toolkit's library locator looks first (``internal/lookup/library.go``).
LIBRARY_DIRS = (
    "/usr/lib64",
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/usr/lib/x86_64-linux-gnu/nvidia/current",
    "/usr/lib/aarch64-linux-gnu/nvidia/current",
    "/lib64",
    "/lib/x86_64-linux-gnu",
    "/lib/aarch64-linux-gnu",
    "/lib/x86_64-linux-gnu/nvidia/current",
    "/lib/aarch64-linux-gnu/nvidia/current",
    "/glibc/lib",
)
#: The dynamic linker's trusted directories, searched after ``ld.so.conf``'s.
TRUSTED_DIRS = ("/usr/lib", "/lib")
#: The driver's libraries are located by these, in order.
ANCHOR_LIBRARIES = ("libcuda.so", "libnvidia-ml.so")
LEGACY_LIBRARIES = ("libnvidia-nvvm70.so.*",)
EXECUTABLE_DIRS = ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")
BINARIES = (
    "nvidia-smi",
    "nvidia-debugdump",
    "nvidia-persistenced",
    "nvidia-cuda-mps-control",
    "nvidia-cuda-mps-server",
    "nvidia-imex",
    "nvidia-imex-ctl",
)
IPC_PATHS = (
    "/var/run/nvidia-persistenced/socket",
    "/var/run/nvidia-fabricmanager/socket",
    "/tmp/nvidia-mps",
)
FIRMWARE_CLASS_PATH = Path("/sys/module/firmware_class/parameters/path")
_MAX_LINKS = 40  # as the kernel's path walk
_MAX_INCLUDE_DEPTH = 8


@dataclass(frozen=True, slots=True)
class Symlink:
    """A link to create in the container: ``link`` (absolute) pointing at ``target``."""

    target: str
    link: str

    def __str__(self) -> str:
        """The toolkit's ``create-symlinks --link`` argument: ``<target>::<link>``."""
        return f"{self.target}::{self.link}"


@dataclass(frozen=True, slots=True)
class DrmNodes:
    """A GPU's DRM device nodes and the ``/dev/dri/by-path`` links that name them."""

    nodes: tuple[str, ...] = ()
    links: tuple[Symlink, ...] = ()


@dataclass(frozen=True, slots=True)
class DriverFiles:
    """The user-space files of one driver version, as container paths."""

    version: str
    libraries: tuple[str, ...] = ()
    library_links: tuple[Symlink, ...] = ()
    binaries: tuple[str, ...] = ()
    ipc: tuple[str, ...] = ()
    firmware: tuple[str, ...] = ()
    drm: Mapping[str, DrmNodes] = field(default_factory=lambda: MappingProxyType({}))
    # Where a path lies inside the root once its links are followed, where that differs: the
    # host's runtime must not follow an absolute link (``/var/run -> /run``) outside the root.
    sources: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))

    def source(self, path: str) -> str:
        """The file to mount at container path ``path``, relative to the driver root."""
        return self.sources.get(path, path)

    @property
    def library_dirs(self) -> tuple[str, ...]:
        """The directories of the libraries, in order, once each (for ``update-ldcache``)."""
        return tuple(dict.fromkeys(posixpath.dirname(p) for p in self.libraries))


class DriverRoot:
    """A driver installation as the agent sees it: ``root`` is the driver root's ``/``.

    ``kernel_release`` (default: the running kernel's) and ``firmware_class_path`` (the kernel's
    custom firmware directory setting, read from the agent's own ``/sys``) place the firmware.
    """

    def __init__(
        self,
        root: Path,
        *,
        kernel_release: str | None = None,
        firmware_class_path: Path = FIRMWARE_CLASS_PATH,
    ) -> None:
        self.root = root
        self._release = os.uname().release if kernel_release is None else kernel_release
        self._firmware_class_path = firmware_class_path

    def find(self, version: str, bus_ids: Iterable[str] = ()) -> DriverFiles:
        """The files of driver ``version``, and the DRM nodes of the GPUs at ``bus_ids``.

        Blocking (file system reads). An empty or malformed version finds no libraries or
        firmware (the toolkit refuses to guess one).
        """
        if not version or "/" in version or version in (".", ".."):
            libraries: tuple[str, ...] = ()
            firmware: tuple[str, ...] = ()
        else:
            libraries = self._libraries(version)
            firmware = self._firmware(version)
        binaries = self._binaries()
        ipc = tuple(p for p in IPC_PATHS if self.resolve(p) is not None)
        sources = {}
        for path in (*binaries, *ipc, *firmware):
            real = self.resolve(path)
            if real is not None and real != path:
                sources[path] = real
        return DriverFiles(
            version=version,
            libraries=libraries,
            library_links=self._library_links(libraries),
            binaries=binaries,
            ipc=ipc,
            firmware=firmware,
            drm=MappingProxyType({b: self._drm(b) for b in bus_ids}),
            sources=MappingProxyType(sources),
        )

    # ----- resolution inside the root ------------------------------------------------------------
    def resolve(self, path: str) -> str | None:
        """``path`` with every symbolic link followed inside the root, or None if it is absent.

        Absolute link targets are taken relative to the root, and ``..`` stops at it, so nothing
        outside the root is ever reached (as when the root is mounted at a different place).
        """
        pending = [p for p in path.split("/") if p]
        done: list[str] = []
        links = 0
        while pending:
            part = pending.pop(0)
            if part == ".":
                continue
            if part == "..":
                if done:
                    done.pop()
                continue
            here = self.root.joinpath(*done, part)
            try:
                mode = here.lstat().st_mode
            except OSError:
                return None
            if stat.S_ISLNK(mode):
                links += 1
                if links > _MAX_LINKS:
                    return None
                try:
                    target = os.readlink(here)
                except OSError:
                    return None
                if target.startswith("/"):
                    done = []
                pending[:0] = [p for p in target.split("/") if p]
                continue
            done.append(part)
        return "/" + "/".join(done)

    def _host(self, path: str) -> Path:
        return self.root.joinpath(path.lstrip("/"))

    def _list(self, directory: str) -> list[str]:
        try:
            return sorted(os.listdir(self._host(directory)))
        except OSError:
            return []

    def _is_file(self, path: str, *, executable: bool = False) -> bool:
        try:
            mode = self._host(path).stat().st_mode
        except OSError:
            return False
        return stat.S_ISREG(mode) and (not executable or bool(mode & 0o111))

    # ----- libraries -----------------------------------------------------------------------------
    def _search_dirs(self) -> list[str]:
        return list(dict.fromkeys([*LIBRARY_DIRS, *self._ld_so_conf_dirs(), *TRUSTED_DIRS]))

    def _ld_so_conf_dirs(self, conf: str = "/etc/ld.so.conf", depth: int = 0) -> list[str]:
        """Directories named by ``ld.so.conf`` and the files it includes (globs from /etc)."""
        resolved = self.resolve(conf)
        if resolved is None or depth > _MAX_INCLUDE_DEPTH:
            return []
        try:
            text = self._host(resolved).read_text(encoding="utf-8", errors="replace")
        except OSError:
            return []
        dirs: list[str] = []
        for raw in text.splitlines():
            line = raw.split("#", 1)[0].strip()
            if line.startswith("include") and line[7:8].isspace():
                for pattern in line[8:].split():
                    absolute = posixpath.join("/etc", pattern)
                    base = str(self.root).rstrip("/")
                    for found in sorted(glob.glob(base + absolute)):
                        dirs.extend(self._ld_so_conf_dirs(found[len(base) :] or "/", depth + 1))
            elif line.startswith("/"):
                dirs.append(line.split("=", 1)[0].rstrip("/") or "/")
        return dirs

    def _library_dir(self, version: str) -> str | None:
        for anchor in ANCHOR_LIBRARIES:
            for directory in self._search_dirs():
                found = self.resolve(f"{directory}/{anchor}.{version}")
                if found is not None and self._is_file(found):
                    return posixpath.dirname(found)
        return None

    def _libraries(self, version: str) -> tuple[str, ...]:
        directory = self._library_dir(version)
        if directory is None:
            return ()
        found: list[str] = []
        for where in (directory, f"{directory}/vdpau"):
            for name in self._list(where):
                if fnmatch.fnmatchcase(name, f"*.so.{version}"):
                    found.append(f"{where}/{name}")
        for pattern in LEGACY_LIBRARIES:
            found.extend(
                f"{directory}/{n}" for n in self._list(directory) if fnmatch.fnmatchcase(n, pattern)
            )
        libraries = []
        for path in found:
            real = self.resolve(path)
            if real is not None and self._is_file(real):
                libraries.append(real)
        return tuple(dict.fromkeys(libraries))

    def _library_links(self, libraries: Sequence[str]) -> tuple[Symlink, ...]:
        """The host's links to the libraries (same directory), then the toolkit's extra links."""
        mounted = set(libraries)
        links: dict[str, Symlink] = {}
        for directory in dict.fromkeys(posixpath.dirname(p) for p in libraries):
            for name in self._list(directory):
                path = f"{directory}/{name}"
                if path in mounted or not self._host(path).is_symlink():
                    continue
                target = self.resolve(path)
                if target in mounted and posixpath.dirname(target) == directory:
                    links[path] = Symlink(_link_target(self._host(path), target), path)
        for library in libraries:
            directory, name = posixpath.split(library)
            for extra in _toolkit_links(name):
                link = f"{directory}/{extra.link}"
                links.setdefault(link, Symlink(extra.target, link))
        return tuple(links[k] for k in sorted(links))

    # ----- binaries, firmware, DRM ---------------------------------------------------------------
    def _binaries(self) -> tuple[str, ...]:
        found = []
        for name in BINARIES:
            for directory in EXECUTABLE_DIRS:
                path = f"{directory}/{name}"
                real = self.resolve(path)
                if real is not None and self._is_file(real, executable=True):
                    found.append(path)
                    break
        return tuple(found)

    def _firmware_dirs(self) -> list[str]:
        dirs = []
        try:
            custom = self._firmware_class_path.read_text(encoding="utf-8").strip()
        except OSError:
            custom = ""
        if custom.startswith("/"):
            dirs.append(custom.rstrip("/"))
        release = self._release
        dirs += [f"/lib/firmware/updates/{release}", "/lib/firmware/updates"]
        dirs += [f"/lib/firmware/{release}", "/lib/firmware"]
        return dirs

    def _firmware(self, version: str) -> tuple[str, ...]:
        found = []
        for directory in self._firmware_dirs():
            where = f"{directory}/nvidia/{version}"
            for name in self._list(where):
                real = self.resolve(f"{where}/{name}")
                if fnmatch.fnmatchcase(name, "gsp*.bin") and real and self._is_file(real):
                    found.append(f"{where}/{name}")
        return tuple(dict.fromkeys(found))

    def _drm(self, bus_id: str) -> DrmNodes:
        """``/dev/dri/cardN`` and ``renderDN`` of the GPU at NVML bus ID ``bus_id``."""
        address = sysfs_address(bus_id)
        nodes: list[str] = []
        links: list[Symlink] = []
        for kind in ("card", "render"):
            link = f"/dev/dri/by-path/pci-{address}-{kind}"
            target = self.resolve(link)
            if target is None or not target.startswith("/dev/dri/"):
                continue
            try:
                if not stat.S_ISCHR(self._host(target).stat().st_mode):
                    continue
            except OSError:
                continue
            nodes.append(target)
            links.append(Symlink(f"../{posixpath.basename(target)}", link))
        return DrmNodes(tuple(nodes), tuple(links))


def sysfs_address(bus_id: str) -> str:
    """NVML's ``00000000:18:00.0`` as sysfs and udev spell it: ``0000:18:00.0``."""
    domain, _, rest = bus_id.lower().partition(":")
    try:
        return f"{int(domain, 16):04x}:{rest}"
    except ValueError:
        return bus_id.lower()


def _link_target(link: Path, resolved: str) -> str:
    """What a recreated link points at: the host link's own target when it names a sibling."""
    try:
        target = os.readlink(link)
    except OSError:
        target = ""
    return target if target and "/" not in target else posixpath.basename(resolved)


def _toolkit_links(name: str) -> tuple[Symlink, ...]:
    """The toolkit's extra links for a library file ``name`` (targets and link names only)."""
    if name.startswith("libcuda.so."):
        return (Symlink("libcuda.so.1", "libcuda.so"),)
    if name.startswith("libGLX_nvidia.so."):
        return (Symlink(name, "libGLX_indirect.so.0"),)
    if name.startswith("libnvidia-opticalflow.so."):
        return (Symlink("libnvidia-opticalflow.so.1", "libnvidia-opticalflow.so"),)
    return ()
