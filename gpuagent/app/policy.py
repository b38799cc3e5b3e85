"""What more than one part decides from the settings and the node: which GPUs ``--dra-gpus``
names that the node lacks (at start and at each reload), where the CDI spec goes and how the
driver's files are found (the node's spec and DRA's claims), and where the node's ``/sys`` and
``/proc`` are (a simulated node has its own)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpuagent.config import Settings
from gpuagent.config.planning import driver_root_as_read

if TYPE_CHECKING:  # the node files' modules are imported off the loop (see app/part.py)
    from gpuagent.domain.dra import DraGpus
    from gpuagent.domain.snapshot import Snapshot
    from gpuagent.gpu import sim
    from gpuagent.nodefiles.cdicontent import CdiTarget

__all__ = ["absent_dra_gpus", "cdi_target", "dra_node_spec", "proc_root", "sysfs_root"]


def absent_dra_gpus(gpus: DraGpus, snapshot: Snapshot, count: int) -> str | None:
    """Why ``gpus`` (``--dra-gpus``) cannot be served on the node of ``snapshot`` (``count``
    GPUs): the GPUs it names that the node does not have; None when there are none (so far)."""
    absent = gpus.absent(snapshot.gpus, count)
    if not absent:
        return None
    has = f"GPU indexes 0-{count - 1}" if count else "no GPUs"
    if any(not ref.isdigit() for ref in absent):
        uuids = ", ".join(g.uuid for g in sorted(snapshot.gpus, key=lambda g: g.index))
        has += f" and UUIDs {uuids}" if uuids else ""
    named = ", ".join(f"GPU {ref}" if ref.isdigit() else ref for ref in absent)
    return f"names {named}, which this node does not have (it has {has})"


def cdi_target(settings: Settings) -> CdiTarget:
    """Where the CDI spec goes and how the driver's files are found (node spec and DRA claims)."""
    from gpuagent.nodefiles.cdicontent import CdiTarget  # noqa: PLC0415

    return CdiTarget(
        spec_dir=settings.cdi_spec_dir,
        mode=settings.cdi_spec,
        driver_root=str(settings.nvidia_driver_root),
        read_root=driver_root_as_read(settings),
        hook_path=settings.nvidia_cdi_hook_path,
    )


def sysfs_root(given: Path | None, simulator: sim.SimDriver | None) -> Path:
    """Where the host's /sys is read: ``given``, else a simulated node's own host (its GPUs' PCI
    classes and NUMA nodes, its DMI product name: read as a real node's are), else /sys."""
    if given is not None:
        return given
    return simulator.sys_root if simulator is not None else Path("/sys")


def dra_node_spec(settings: Settings) -> Callable[[Snapshot], Mapping[str, Any] | None]:
    """The node's CDI spec as DRA's claims edit it: it follows the serving plan's container
    settings, as the node spec does, and is built again only when the devices, the driver or
    those settings change."""
    from gpuagent.nodefiles.cdidriver import NodeSpecs  # noqa: PLC0415

    specs = NodeSpecs(cdi_target(settings))
    return lambda snapshot: specs.get(snapshot, snapshot.plan.serving.containers)


def proc_root(simulator: sim.SimDriver | None) -> Path:
    """The node's ``/proc``, where the kernel and the driver's kernel module write what the agent
    reads (the MIG capabilities' minors, the boot ID): the host's, or the simulated node's own
    (the real backend is handed the path, never the simulator)."""
    return Path("/proc") if simulator is None else simulator.proc_root
