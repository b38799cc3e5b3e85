"""The node's CDI spec: what the container runtime injects for ``k8s.device-plugin.nvidia.com/gpu``.

With the ``cdi-annotations`` or ``cdi-cri`` strategies, ``Allocate`` answers with CDI names
(:func:`gpuagent.domain.containers.cdi_name`) and the runtime looks them up in the specs under
``/var/run/cdi``. This module builds that spec from a snapshot and the driver's files
(:mod:`gpuagent.nodefiles.driverfiles`) — one device per GPU and per MIG device, under each
naming (UUID and index, so whichever ``--device-id-strategy`` is set, the names ``Allocate``
returns resolve), and ``all`` — and writes it atomically when it changes.

What a container gets, as with the spec NVIDIA's device plugin writes through the container
toolkit's library:

* every device: the driver's control nodes; the driver's libraries, binaries, IPC sockets and GSP
  firmware, bind-mounted read-only from the driver root; ``NVIDIA_VISIBLE_DEVICES=void`` so the
  legacy runtime hook stands aside; two ``createContainer`` hooks of the toolkit's hook binary —
  ``create-symlinks`` (the libraries' SONAME links, ``libcuda.so``) and ``update-ldcache`` (the
  library directories into the container's linker cache);
* each GPU: its ``/dev/nvidiaN`` and DRM nodes (with their ``/dev/dri/by-path`` links); each MIG
  device: its parent's node and its ``/dev/nvidia-caps`` nodes.

The hook binary is ``nvidia-ctk`` (``nvidia-ctk hook <name> …``, NVIDIA's plugin's default) or
``nvidia-cdi-hook`` (``nvidia-cdi-hook <name> …``, the toolkit's newer one), by its file name.
Only hooks every toolkit since 1.12 has are used. ``cdiVersion`` is the lowest that expresses the
spec (CDI's ``MinimumRequiredVersion`` rules).

Alternatively the devices can be those of the toolkit's own generated spec (``nvidia.com/gpu``,
``nvidia-ctk cdi generate``): then the agent writes nothing and :func:`toolkit_devices` tells
which of the names it hands out the toolkit's specs define.
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from gpuagent.domain.containers import (
    CDI_CLASS,
    CDI_KIND,
    CDI_SPEC_DIR,
    CDI_VENDOR,
    CONTROL_NODES,
)
from gpuagent.domain.devices import Gpu, IdStrategy
from gpuagent.domain.naming import mig_index
from gpuagent.domain.snapshot import Snapshot
from gpuagent.nodefiles.atomicfile import remove_if_present, write_if_changed
from gpuagent.nodefiles.driverfiles import DriverFiles, DrmNodes, Symlink

__all__ = [
    "DEFAULT_CDI_DIR",
    "DEFAULT_HOOK_PATH",
    "SPEC_FILE_NAME",
    "TOOLKIT_KIND",
    "TOOLKIT_SPEC_DIRS",
    "build_spec",
    "device_names",
    "minimum_version",
    "render_spec",
    "sync_spec",
    "toolkit_devices",
]

DEFAULT_CDI_DIR = Path(CDI_SPEC_DIR)
# CDI's GenerateSpecName: "<vendor>-<class>", as NVIDIA's plugin names its file.
SPEC_FILE_NAME = f"{CDI_VENDOR}-{CDI_CLASS}.json"
ALL_DEVICES = "all"
VOID_ENV = "NVIDIA_VISIBLE_DEVICES=void"
DEFAULT_HOOK_PATH = "/usr/bin/nvidia-ctk"  # NVIDIA's plugin's --nvidia-cdi-hook-path default
MOUNT_OPTIONS = ("ro", "nosuid", "nodev", "rbind", "rprivate")  # the toolkit's, for every mount
CREATE_CONTAINER = "createContainer"
# The toolkit's own spec: kind and the directories a CDI registry reads, in priority order.
TOOLKIT_KIND = "nvidia.com/gpu"
TOOLKIT_SPEC_DIRS = (Path("/etc/cdi"), Path("/var/run/cdi"))

Spec = dict[str, Any]


def build_spec(
    snapshot: Snapshot,
    *,
    dev_root: str = "/",
    control_nodes: Iterable[str] = CONTROL_NODES,
    names: Sequence[IdStrategy] = (IdStrategy.UUID, IdStrategy.INDEX),
    driver: DriverFiles | None = None,
    driver_root: str | None = None,
    hook_path: str = DEFAULT_HOOK_PATH,
) -> Spec | None:
    """The CDI spec for the snapshot's GPUs, or ``None`` when there are none.

    ``control_nodes`` are the :data:`~gpuagent.domain.containers.CONTROL_NODES` present on the
    host; ``names`` the device namings to emit (both by default); ``driver`` the driver's files
    (none: device nodes only), found under ``driver_root`` on the host (default ``dev_root``);
    ``hook_path`` the host path of the toolkit's hook binary. Health and telemetry do not enter
    the spec, so it only changes when devices or the driver do.
    """
    gpus = sorted(snapshot.gpus, key=lambda g: g.index)
    if not gpus:
        return None
    files_root = dev_root if driver_root is None else driver_root
    hooks = _Hooks(hook_path)
    drm: Mapping[str, DrmNodes] = driver.drm if driver is not None else {}
    devices: list[Spec] = []
    every_node: list[str] = []
    every_link: list[Symlink] = []
    for gpu in gpus:
        gpu_nodes, gpu_links = _gpu_nodes(gpu, drm)
        every_node.extend(gpu_nodes)
        every_link.extend(gpu_links)
        for name in device_names(gpu.uuid, str(gpu.index), names):
            devices.append(_device(name, gpu_nodes, gpu_links, dev_root, hooks))
        for position, mig in enumerate(gpu.mig_devices):
            mig_nodes = (gpu.device_node, *mig.device_nodes)
            every_node.extend(mig.device_nodes)
            for name in device_names(mig.uuid, mig_index(gpu.index, position), names):
                devices.append(_device(name, mig_nodes, (), dev_root, hooks))
    devices.append(_device(ALL_DEVICES, every_node, every_link, dev_root, hooks))
    present = set(control_nodes)
    edits: Spec = {
        "env": [VOID_ENV],
        "deviceNodes": [_node(p, dev_root) for p in CONTROL_NODES if p in present],
    }
    if driver is not None:
        edits.update(_driver_edits(driver, files_root, hooks))
    spec: Spec = {"cdiVersion": "", "kind": CDI_KIND, "devices": devices, "containerEdits": edits}
    spec["cdiVersion"] = minimum_version(spec)
    return spec


def device_names(uuid: str, index: str, strategies: Sequence[IdStrategy]) -> list[str]:
    """A device's CDI device names under each naming, once each."""
    by = {IdStrategy.UUID: uuid, IdStrategy.INDEX: index}
    return list(dict.fromkeys(by[s] for s in strategies))


def minimum_version(spec: Mapping[str, Any]) -> str:
    """The lowest ``cdiVersion`` whose schema expresses ``spec`` (CDI's own rules, 0.3.0 to 0.6.0).

    0.6.0: annotations, or a ``.`` in the kind's class; 0.5.0: a device name not starting with a
    letter, or a device node with ``hostPath``; 0.4.0: a mount with ``type``; else 0.3.0.
    """
    devices = list(spec.get("devices", ()))
    kind = str(spec.get("kind", ""))
    if spec.get("annotations") or any(d.get("annotations") for d in devices):
        return "0.6.0"
    if "." in kind.partition("/")[2]:
        return "0.6.0"
    edits = [spec.get("containerEdits") or {}, *(d.get("containerEdits") or {} for d in devices)]
    if any(not str(d.get("name", "a"))[:1].isalpha() for d in devices):
        return "0.5.0"
    if any(n.get("hostPath") for e in edits for n in e.get("deviceNodes", ())):
        return "0.5.0"
    if any(m.get("type") for e in edits for m in e.get("mounts", ())):
        return "0.4.0"
    return "0.3.0"


def render_spec(spec: Mapping[str, Any]) -> bytes:
    """The spec as the JSON written to disk (stable: same spec, same bytes)."""
    return (json.dumps(spec, indent=2) + "\n").encode()


def sync_spec(spec: Mapping[str, Any] | None, cdi_dir: Path = DEFAULT_CDI_DIR) -> bool:
    """Write ``spec`` to ``cdi_dir`` atomically if it changed; remove the file for ``None``.

    Returns whether the file changed. Raises :class:`OSError`.
    """
    path = cdi_dir / SPEC_FILE_NAME
    if spec is None:
        return remove_if_present(path)
    return write_if_changed(path, render_spec(spec))


def toolkit_devices(dirs: Sequence[Path] = TOOLKIT_SPEC_DIRS) -> frozenset[str] | None:
    """The device names of kind ``nvidia.com/gpu`` in the CDI specs under ``dirs``.

    Reads every ``*.json`` and ``*.yaml`` there, as a CDI registry does (the toolkit writes
    ``nvidia.yaml``); ``None`` when no spec of that kind is found. Unreadable or malformed files
    are skipped. Blocking.
    """
    names: set[str] = set()
    found = False
    for directory in dirs:
        try:
            paths = sorted(p for p in directory.iterdir() if p.suffix in (".json", ".yaml"))
        except OSError:
            continue
        for path in paths:
            try:
                document = yaml.safe_load(path.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, yaml.YAMLError):
                continue
            if not isinstance(document, dict) or document.get("kind") != TOOLKIT_KIND:
                continue
            found = True
            for device in document.get("devices") or ():
                if isinstance(device, dict) and isinstance(device.get("name"), str):
                    names.add(device["name"])
    return frozenset(names) if found else None


class _Hooks:
    """``createContainer`` hooks of the toolkit's hook binary, as its CLI spells them."""

    def __init__(self, path: str) -> None:
        self.path = path
        base = posixpath.basename(path)
        self._argv = [base, "hook"] if base == "nvidia-ctk" else [base]

    def hook(self, name: str, args: Iterable[str]) -> Spec:
        return {"hookName": CREATE_CONTAINER, "path": self.path, "args": [*self._argv, name, *args]}

    def symlinks(self, links: Iterable[Symlink]) -> Spec:
        return self.hook("create-symlinks", (a for s in links for a in ("--link", str(s))))

    def ldcache(self, folders: Iterable[str]) -> Spec:
        return self.hook("update-ldcache", (a for f in folders for a in ("--folder", f)))


def _gpu_nodes(
    gpu: Gpu, drm: Mapping[str, DrmNodes]
) -> tuple[tuple[str, ...], tuple[Symlink, ...]]:
    found = drm.get(gpu.pci_bus_id)
    if found is None:
        return (gpu.device_node,), ()
    return (gpu.device_node, *found.nodes), tuple(found.links)


def _driver_edits(driver: DriverFiles, root: str, hooks: _Hooks) -> Spec:
    paths = [*driver.libraries, *driver.binaries, *driver.ipc, *driver.firmware]
    edits: Spec = {"mounts": [_mount(p, driver.source(p), root) for p in dict.fromkeys(paths)]}
    hook_list = []
    if driver.library_links:
        hook_list.append(hooks.symlinks(driver.library_links))
    if driver.libraries:
        hook_list.append(hooks.ldcache(driver.library_dirs))
    if hook_list:
        edits["hooks"] = hook_list
    return edits


def _host(path: str, root: str) -> str:
    return posixpath.join(root, path.lstrip("/"))


def _mount(path: str, source: str, root: str) -> Spec:
    return {"hostPath": _host(source, root), "containerPath": path, "options": list(MOUNT_OPTIONS)}


def _node(path: str, dev_root: str) -> dict[str, str]:
    host = _host(path, dev_root)
    return {"path": path} if host == path else {"path": path, "hostPath": host}


def _device(
    name: str, nodes: Iterable[str], links: Sequence[Symlink], dev_root: str, hooks: _Hooks
) -> Spec:
    edits: Spec = {"deviceNodes": [_node(p, dev_root) for p in dict.fromkeys(nodes)]}
    if links:
        edits["hooks"] = [hooks.symlinks(dict.fromkeys(links))]
    return {"name": name, "containerEdits": edits}
