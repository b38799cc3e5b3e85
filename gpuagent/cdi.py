"""The node's CDI spec: what the container runtime injects for ``k8s.device-plugin.nvidia.com/gpu``.

With the ``cdi-annotations`` or ``cdi-cri`` strategies, ``Allocate`` answers with CDI names
(:func:`gpuagent.domain.containers.cdi_name`) and the runtime looks them up in the specs under
``/var/run/cdi``. This module builds that spec from a snapshot — one device per GPU and per MIG
device, under each naming (UUID and index, so whichever ``--device-id-strategy`` is set, the names
``Allocate`` returns resolve), and ``all`` — and writes it atomically when it changes.

The spec carries device nodes (the GPU's ``/dev/nvidiaN``, a MIG device's ``/dev/nvidia-caps``
nodes, the driver's control nodes) under the host's dev root, and
``NVIDIA_VISIBLE_DEVICES=void`` so the legacy runtime hook stands aside. Driver libraries are not
mounted: on nodes where the image does not bring them, the NVIDIA container toolkit's own spec
(``nvidia-ctk cdi generate``) or its runtime hook provides them.
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from gpuagent.atomicfile import remove_if_present, write_if_changed
from gpuagent.domain.containers import CDI_CLASS, CDI_KIND, CDI_VENDOR, CONTROL_NODES
from gpuagent.domain.devices import IdStrategy, Snapshot
from gpuagent.domain.naming import mig_index

__all__ = [
    "CDI_VERSION",
    "DEFAULT_CDI_DIR",
    "SPEC_FILE_NAME",
    "build_spec",
    "render_spec",
    "sync_spec",
]

CDI_VERSION = "0.6.0"
DEFAULT_CDI_DIR = Path("/var/run/cdi")
# CDI's GenerateSpecName: "<vendor>-<class>", as NVIDIA's plugin names its file.
SPEC_FILE_NAME = f"{CDI_VENDOR}-{CDI_CLASS}.json"
ALL_DEVICES = "all"
VOID_ENV = "NVIDIA_VISIBLE_DEVICES=void"

Spec = dict[str, Any]


def build_spec(
    snapshot: Snapshot,
    *,
    dev_root: str = "/",
    control_nodes: Iterable[str] = CONTROL_NODES,
    names: Sequence[IdStrategy] = (IdStrategy.UUID, IdStrategy.INDEX),
) -> Spec | None:
    """The CDI spec for the snapshot's GPUs, or ``None`` when there are none.

    ``control_nodes`` are the :data:`~gpuagent.domain.containers.CONTROL_NODES` present on the
    host; ``names`` the device namings to emit (both by default). Health and telemetry do not
    enter the spec, so it only changes when devices do.
    """
    gpus = sorted(snapshot.gpus, key=lambda g: g.index)
    if not gpus:
        return None
    devices: list[dict[str, Any]] = []
    every: list[str] = []
    for gpu in gpus:
        gpu_nodes = (f"/dev/nvidia{gpu.minor}",)
        every.extend(gpu_nodes)
        for name in _names(gpu.uuid, str(gpu.index), names):
            devices.append(_device(name, gpu_nodes, dev_root))
        for position, mig in enumerate(gpu.mig_devices):
            mig_nodes = (*gpu_nodes, *mig.device_nodes)
            every.extend(mig.device_nodes)
            for name in _names(mig.uuid, mig_index(gpu.index, position), names):
                devices.append(_device(name, mig_nodes, dev_root))
    devices.append(_device(ALL_DEVICES, every, dev_root))
    present = set(control_nodes)
    common = [p for p in CONTROL_NODES if p in present]
    return {
        "cdiVersion": CDI_VERSION,
        "kind": CDI_KIND,
        "devices": devices,
        "containerEdits": {
            "env": [VOID_ENV],
            "deviceNodes": [_node(p, dev_root) for p in common],
        },
    }


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


def _names(uuid: str, index: str, strategies: Sequence[IdStrategy]) -> list[str]:
    by = {IdStrategy.UUID: uuid, IdStrategy.INDEX: index}
    return list(dict.fromkeys(by[s] for s in strategies))


def _node(path: str, dev_root: str) -> dict[str, str]:
    return {"path": path, "hostPath": posixpath.join(dev_root, path.lstrip("/"))}


def _device(name: str, nodes: Iterable[str], dev_root: str) -> dict[str, Any]:
    return {
        "name": name,
        "containerEdits": {"deviceNodes": [_node(p, dev_root) for p in dict.fromkeys(nodes)]},
    }
