"""What the agent decides from its settings and its node, apart from the wiring: which GPUs
``--dra-gpus`` names that the node lacks, which of the host's files simulated GPUs may reach,
where the CDI spec goes, what container accounting cannot see, the driver backend (with MIG
made on demand, the DRA side's too), and the MPS control daemons' keeper."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from gpuagent.config import Settings
from gpuagent.config.planning import driver_root_as_read
from gpuagent.domain.containers import CDI_SPEC_DIR
from gpuagent.domain.dra import DraMig
from gpuagent.domain.drashare import DraSharing
from gpuagent.domain.mps import ComputeModeChoice, MpsDirs
from gpuagent.gpu.migcontrol import MigControl
from gpuagent.gpu.nvml import Nvml

if TYPE_CHECKING:  # the node files' modules are imported off the loop (see startup.py)
    from gpuagent.domain.dra import DraGpus
    from gpuagent.domain.serving import ResourceView
    from gpuagent.domain.snapshot import Snapshot
    from gpuagent.dra.side import DraSide
    from gpuagent.gpu import sim
    from gpuagent.nodefiles.cdicontent import CdiTarget
    from gpuagent.nodefiles.labelkeeper import NodeFiles
    from gpuagent.state.store import DeviceStore

__all__ = [
    "absent_dra_gpus",
    "cdi_target",
    "dra_node_spec",
    "keeps_cdi_spec",
    "keep_mps_daemons",
    "node_files",
    "warn_of_a_pid_namespace",
]

log = structlog.get_logger("gpuagent")


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


def node_files(
    store: DeviceStore, settings: Settings, *, sysfs_root: Path, simulated: bool
) -> NodeFiles:
    """The node's files this agent may write besides the CDI spec: simulated GPUs must not reach
    the host's real node-feature-discovery directory by default, and a simulated node's machine
    type is its host's (under ``sysfs_root``) unless ``--machine-type-file`` names another."""
    from gpuagent.nodefiles.hostfacts import DEFAULT_MACHINE_TYPE_FILE  # noqa: PLC0415
    from gpuagent.nodefiles.labelkeeper import LabelTarget, NodeFiles  # noqa: PLC0415
    from gpuagent.nodefiles.labels import DEFAULT_FEATURES_FILE  # noqa: PLC0415

    machine = settings.machine_type_file
    if simulated and machine == DEFAULT_MACHINE_TYPE_FILE:
        machine = sysfs_root / DEFAULT_MACHINE_TYPE_FILE.relative_to("/sys")
    labels: LabelTarget | None = LabelTarget(
        path=settings.node_labels_file, machine_type_file=machine, sysfs_root=sysfs_root
    )
    if not settings.node_labels or (
        simulated and settings.node_labels_file == DEFAULT_FEATURES_FILE
    ):
        labels = None
    return NodeFiles(store, labels=labels)


def keeps_cdi_spec(settings: Settings, *, simulated: bool) -> bool:
    """Whether this agent keeps the node's CDI spec: simulated GPUs must not reach the host's
    real CDI directory by default."""
    return not (simulated and settings.cdi_spec_dir == Path(CDI_SPEC_DIR))


def warn_of_a_pid_namespace() -> None:
    """With container accounting on: say so when the agent is PID 1 of its own PID namespace,
    where NVML lists no other container's processes."""
    if os.getpid() == 1:
        log.warning(
            "container accounting is on, but the agent is PID 1 of its own PID "
            "namespace: NVML lists no other container's processes (run it in the host's "
            "PID namespace, or set container-accounting: false)"
        )


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


def driver(
    settings: Settings,
    store: DeviceStore,
    dra: DraSide | None,
    sysfs_root: Path,
    mig_minors: Path,
) -> Nvml:
    """The NVML backend; with MIG made on demand (``--dra-mig dynamic``), the DRA side makes and
    destroys MIG devices through it, on a thread of its own (closed with the DRA side)."""
    dynamic = store.plan.dra.mig is DraMig.DYNAMIC
    processes = settings.container_accounting
    nvml = Nvml(sysfs_root, mig_minors, processes=processes, mig_shapes=dynamic)
    if dynamic and dra is not None:
        dra.manage_mig(MigControl(nvml, store))
    return nvml


async def keep_mps_daemons(
    settings: Settings, store: DeviceStore, view: ResourceView, nvml: Nvml
) -> None:
    """Keep the MPS control daemons the device plugin's resources and the GPUs shared through
    DRA need, for the agent's life.

    Nothing of MPS is imported until the plan first shares a resource or a DRA GPU through it
    (at start, or at a reload): most nodes never do, and the start before the registration stays
    lean. The GPUs' compute modes are set through ``nvml`` unless left as they are."""
    async for shared in store.watch(_shares_through_mps):
        if shared:
            break
    from gpuagent.gpu.computemode import ComputeModes  # noqa: PLC0415
    from gpuagent.mps.manager import MpsDaemons  # noqa: PLC0415

    modes = None
    if settings.mps_compute_mode is ComputeModeChoice.EXCLUSIVE_PROCESS:
        modes = ComputeModes(nvml)
    daemons = MpsDaemons(
        store,
        view,
        dirs=MpsDirs(str(settings.mps_root)),
        driver_root=driver_root_as_read(settings),
        compute_modes=modes,
    )
    await daemons.run()


def _shares_through_mps(snapshot: Snapshot) -> bool:
    plan = snapshot.plan
    return plan.serving.resources.mps.enabled or plan.dra.sharing is DraSharing.MPS
