"""What the node's CDI spec holds, and where it is kept: pure, from the snapshot, the container
settings and the driver's files as found (:mod:`~gpuagent.nodefiles.cdidriver`).

:class:`CdiTarget` says where and how the spec is kept (the agent's own, ``write``; or the NVIDIA
container toolkit's, ``toolkit``, only checked); :func:`node_spec` is the agent's own spec, and
:func:`spec_key` what it depends on (the devices as described and where the nodes are: not the
health, not the readings); :func:`expected_toolkit_names` the names the toolkit's spec must
define for what ``Allocate`` hands out.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from gpuagent.domain.containers import ContainerSettings
from gpuagent.domain.naming import mig_index
from gpuagent.domain.snapshot import Snapshot
from gpuagent.nodefiles.cdi import TOOLKIT_SPEC_DIRS, Spec, build_spec, device_names
from gpuagent.nodefiles.driverfiles import DriverFiles

__all__ = [
    "TOOLKIT",
    "WRITE",
    "CdiTarget",
    "expected_toolkit_names",
    "node_spec",
    "spec_key",
]

WRITE = "write"
TOOLKIT = "toolkit"


@dataclass(frozen=True, slots=True)
class CdiTarget:
    """Where and how the CDI spec is kept.

    ``driver_root`` is the driver root as the host (and so the container runtime) sees it,
    ``read_root`` where the agent reads it (a mount of it in the agent's container, or the same
    path); ``hook_path`` the host path of the toolkit's hook binary.
    """

    spec_dir: Path
    mode: str = WRITE
    driver_root: str = "/"
    read_root: Path = Path("/")
    hook_path: str = "/usr/bin/nvidia-ctk"
    toolkit_dirs: Sequence[Path] = TOOLKIT_SPEC_DIRS
    kernel_release: str | None = None


def node_spec(
    snapshot: Snapshot, containers: ContainerSettings, target: CdiTarget, files: DriverFiles
) -> Spec | None:
    """The agent's own CDI spec for ``snapshot``: its device nodes, and the driver's ``files``
    (found under the target's driver root) as the host sees them."""
    return build_spec(
        snapshot,
        dev_root=containers.dev_root,
        control_nodes=containers.control_nodes,
        driver=files,
        driver_root=target.driver_root,
        hook_path=target.hook_path,
    )


def spec_key(
    snapshot: Snapshot, containers: ContainerSettings, described: Callable[[Snapshot], object]
) -> object:
    """What the node's spec depends on: the devices as described and where the nodes are."""
    return (described(snapshot), containers.dev_root, containers.control_nodes)


def expected_toolkit_names(snapshot: Snapshot, containers: ContainerSettings) -> list[str]:
    """The device names ``Allocate`` hands out, which the toolkit's spec must define."""
    names: list[str] = []
    strategy = (containers.id_strategy,)
    for gpu in sorted(snapshot.gpus, key=lambda g: g.index):
        names += device_names(gpu.uuid, str(gpu.index), strategy)
        for position, mig in enumerate(gpu.mig_devices):
            names += device_names(mig.uuid, mig_index(gpu.index, position), strategy)
    return names
