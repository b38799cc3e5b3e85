"""What a simulated node is made of, and ``--simulate N`` (the parts of a ``--sim-config`` document
are validated by :mod:`~gpuagent.gpu.sim.layout`, the document itself by
:mod:`~gpuagent.gpu.sim.config`)."""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import pynvml

from gpuagent.domain.errors import SettingError
from gpuagent.gpu.sim.host import COMPUTE_CLASS, SimHost
from gpuagent.gpu.sim.profiles import (
    DEFAULT_PROFILE,
    GpuProfile,
    MigProfile,
    gpu_instance_id,
    place_mig,
)
from gpuagent.gpu.sim.resting import AtRest

MAX_GPUS = 64
MAX_NVSWITCHES = 16
#: The NVSwitches' PCI buses (``00000000:E0:00.0`` onwards), clear of the GPUs' buses.
NVSWITCH_FIRST_BUS = 0xE0
#: /proc/driver/nvidia-caps/mig-minors: GPU-instance and compute-instance IDs it has entries for,
#: and the GPU minors it covers at least (the kernel module lists 32 GPUs).
CAPS_GPU_INSTANCES = 15
CAPS_COMPUTE_INSTANCES = 8
CAPS_GPUS = 32
DRIVER_VERSION = "580.95.05"
CUDA_DRIVER_VERSION = 13000
#: The first driver branch with the recovery-action field (230) and its event (0x8000).
RECOVERY_ACTION_BRANCH = 565

#: How long a call takes in the simulated driver when nothing else is configured: what one real
#: H200 took (driver 580.159.04, persistence mode on, idle; medians of warm calls, from
#: ../shared/reference/real-h200/ — its README's table and its capture). Calls it answered within
#: microseconds take :data:`DEFAULT_LATENCY_S`. A capture of a real node (``capture:`` in
#: ``--sim-config``) replaces them with what that node answered.
DEFAULT_LATENCY_S = 0.000_005
DEFAULT_CALL_LATENCY_S: Mapping[str, float] = MappingProxyType(
    {
        "nvmlInitWithFlags": 0.013,
        "nvmlShutdown": 0.001,
        "nvmlErrorString": 0.0,
        "nvmlEventSetWait_v2": 0.0,  # the wait has a timeout of its own
        "nvmlDeviceGetTotalEnergyConsumption": 0.003_19,  # the counter moves more slowly
        "nvmlDeviceGetProcessUtilization": 0.002_41,  # even when it answers NOT_FOUND
        "nvmlDeviceGetProcessesUtilizationInfo": 0.002_5,  # (2.3-2.9 ms with no process)
        "nvmlDeviceGetViolationStatus": 0.000_61,
        "nvmlDeviceGetPcieReplayCounter": 0.000_17,
        "nvmlDeviceGetFieldValues": 0.000_46,  # the agent's 30 slots; see DEFAULT_FIELD_LATENCY_S
        "nvmlGpmSampleGet": 0.000_04,
        "nvmlGpmMigSampleGet": 0.000_04,
        "nvmlGpmMetricsGet": 0.001_9,  # seven metrics between two samples
        "nvmlDeviceSetMigMode": 0.2,  # MIG management: hundreds of ms to make an instance
        "nvmlDeviceCreateGpuInstanceWithPlacement": 0.25,
        "nvmlGpuInstanceCreateComputeInstance": 0.1,
        "nvmlComputeInstanceDestroy": 0.05,
        "nvmlGpuInstanceDestroy": 0.1,
    }
)
#: What asking ``nvmlDeviceGetFieldValues`` for a field adds to the call, by field ID: the energy
#: counter costs as much through a field as through its own call (3.2 ms on the H200). The two
#: violation-time fields are inferred, not measured alone: the agent's field-values call took
#: 1.4 ms a poll there (mean of 63), the capture's without them 0.46 ms, and the violation-status
#: call they stand for 0.61-1.1 ms. A capture with ``field_costs`` measures each field.
DEFAULT_FIELD_LATENCY_S: Mapping[int, float] = MappingProxyType(
    {
        int(pynvml.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION): 0.003_2,
        int(pynvml.NVML_FI_DEV_PERF_POLICY_POWER): 0.000_47,
        int(pynvml.NVML_FI_DEV_PERF_POLICY_THERMAL): 0.000_47,
    }
)

_UUID_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "https://gpuagent.invalid/sim")


class SimConfigError(SettingError):
    """A simulated-node description is invalid; ``key`` is the dotted path of the offending value.

    ``str(error)`` is ``"<key>: <reason>"``, e.g. ``"gpus[1].memory_mib: must be an integer"``.
    """


@dataclass(frozen=True)
class SimMigSpec:
    """One MIG device of a simulated GPU: a GPU instance and the compute instance spanning it.

    ``start`` is the placement's first memory slice; ``memory_mib`` is the profile's memory,
    scaled by the GPU's configured memory over its model's.
    """

    profile: MigProfile
    gpu_instance_id: int
    compute_instance_id: int
    start: int
    memory_mib: int
    uuid: str

    @property
    def name(self) -> str:
        """The profile name, e.g. ``"3g.40gb"``."""
        return self.profile.name


@dataclass(frozen=True)
class SimGpuSpec:
    """One simulated GPU: what the config chose plus the identity derived from its profile.

    ``name`` is what NVML reports (the profile's model name unless the config named an unknown
    model); everything not configurable comes from ``profile``. ``mig`` lists the configured MIG
    profiles; ``mig_devices`` the MIG devices they became, in GPU-instance ID order (MIG mode is
    enabled exactly when there are some). ``pci_class``: the GPU's PCI class code (a 3D
    controller unless its display is on). ``nvlink``: whether the driver exposes the GPU's NVLinks
    (false: a PCIe card without a bridge, or a GPU passed through to a VM without them — every
    NVLink call and field answers NOT_SUPPORTED, as on the real H200 VM). ``at_rest``: the
    readings of a captured GPU, which a replay holds (None: the synthetic load).
    """

    index: int
    name: str
    memory_mib: int
    numa_node: int
    mig: tuple[str, ...]
    uuid: str
    pci_bus_id: str
    minor: int
    profile: GpuProfile
    mig_devices: tuple[SimMigSpec, ...] = ()
    pci_class: str = COMPUTE_CLASS
    nvlink: bool = True
    at_rest: AtRest | None = None

    @property
    def nvlink_slots(self) -> int:
        """How many NVLinks the driver shows for the GPU (active or not)."""
        return self.profile.nvlink_count if self.nvlink else 0

    @property
    def architecture(self) -> int:
        """NVML architecture constant (``NVML_DEVICE_ARCH_*``)."""
        return self.profile.architecture

    @property
    def pci_address(self) -> tuple[int, int, int, int]:
        """Domain, bus, device and function of ``pci_bus_id`` (``00000000:00:06.0``)."""
        domain, bus, rest = self.pci_bus_id.split(":")
        device, function = rest.split(".")
        return int(domain, 16), int(bus, 16), int(device, 16), int(function, 16)


@dataclass(frozen=True)
class SimLatency:
    """How long the simulated driver takes: per call (seconds) and once per GPU when it is cold.

    ``cold_start_s`` is spent by the first call that touches a GPU after ``nvmlInit``, as a GPU
    without persistence mode is brought up (seconds on a Hopper board); other calls on that GPU
    wait for it. ``fields``: what asking for some field IDs adds to an
    ``nvmlDeviceGetFieldValues``. Latencies are wall-clock sleeps outside the driver's lock, so
    calls on different GPUs overlap, as they do on a real driver.
    """

    default_s: float = DEFAULT_LATENCY_S
    calls: Mapping[str, float] = field(default_factory=lambda: DEFAULT_CALL_LATENCY_S)
    cold_start_s: float = 0.0
    fields: Mapping[int, float] = field(default_factory=lambda: DEFAULT_FIELD_LATENCY_S)

    def of(self, symbol: str) -> float:
        """Seconds one call of C symbol ``symbol`` takes."""
        return self.calls.get(symbol, self.default_s)

    def of_fields(self, field_ids: Iterable[int]) -> float:
        """Seconds that asking for ``field_ids`` adds to an ``nvmlDeviceGetFieldValues`` call."""
        return sum(self.fields.get(f, 0.0) for f in set(field_ids))


@dataclass(frozen=True)
class SimNode:
    """A simulated node: its GPUs, NVLink wiring and driver.

    ``nvlinks`` are direct GPU-to-GPU links ``(gpu_a, gpu_b, link_count)``; ``nvswitch_links`` are
    links from a GPU to an NVSwitch ``(gpu, switch, link_count)`` (see :func:`node_with_nvswitches`;
    not offered by ``--sim-config``). A GPU's links are numbered in that order: direct ones first.

    ``cap_sys_admin``: whether the simulated agent runs with CAP_SYS_ADMIN, which a real driver
    requires for aggregate (parent GPU) memory reads under MIG. The default is the base manifest's
    privileges: without it, those reads answer NO_PERMISSION.
    ``absent_calls``/``absent_fields``: C symbols and field IDs this driver answers with
    NOT_SUPPORTED (from a capture). ``supported_events``: the event mask the GPUs report, ``None``
    for what the driver version offers. ``numa_from_nvml``: whether the driver answers
    ``nvmlDeviceGetNumaNodeId``, which nvml.h says "only applies to platforms where the GPUs are
    NUMA nodes" (Grace Hopper, Grace Blackwell); elsewhere (the default: x86 HGX boards, VMs) it
    answers NOT_SUPPORTED, as the real H200 did, and the NUMA node is the host's (``host``).
    """

    gpus: tuple[SimGpuSpec, ...]
    nvlinks: tuple[tuple[int, int, int], ...] = ()
    driver_version: str = DRIVER_VERSION
    cuda_driver_version: int = CUDA_DRIVER_VERSION
    nvswitch_links: tuple[tuple[int, int, int], ...] = ()
    cap_sys_admin: bool = False
    latency: SimLatency = field(default_factory=SimLatency)
    absent_calls: frozenset[str] = frozenset()
    absent_fields: frozenset[int] = frozenset()
    supported_events: int | None = None
    numa_from_nvml: bool = False
    host: SimHost = field(default_factory=SimHost)

    @property
    def driver_branch(self) -> int:
        """The driver's major version (``580`` for ``580.95.05``; 0 if unreadable)."""
        head = self.driver_version.split(".", 1)[0]
        return int(head) if head.isdigit() else 0

    @property
    def has_recovery_action(self) -> bool:
        """Whether this driver has the recovery-action field (230) and event (0x8000): R565+."""
        return self.driver_branch >= RECOVERY_ACTION_BRANCH

    @property
    def nvswitches(self) -> int:
        """How many NVSwitches the node has."""
        return 1 + max((switch for _, switch, _ in self.nvswitch_links), default=-1)

    def switch_links_of(self, gpu: int) -> tuple[tuple[int, int], ...]:
        """``(switch, link_count)`` for every NVSwitch connection of ``gpu``."""
        return tuple((switch, count) for g, switch, count in self.nvswitch_links if g == gpu)

    def links_of(self, gpu: int) -> tuple[tuple[int, int], ...]:
        """``(peer, link_count)`` for every NVLink connection of ``gpu``, in configuration order."""
        peers: list[tuple[int, int]] = []
        for a, b, count in self.nvlinks:
            if a == gpu:
                peers.append((b, count))
            elif b == gpu:
                peers.append((a, count))
        return tuple(peers)


def switch_bus_id(switch: int) -> str:
    """The PCI bus ID of NVSwitch number ``switch``."""
    return f"00000000:{NVSWITCH_FIRST_BUS + switch:02X}:00.0"


def mig_memory_mib(shape: MigProfile, profile: GpuProfile, memory_mib: int) -> int:
    """Memory of a ``shape`` instance on a ``profile`` GPU configured with ``memory_mib``.

    The profile's size scaled by the configured memory over the model's (the same at defaults), so
    every instance keeps its share of the GPU.
    """
    return max(1, shape.memory_mib * memory_mib // profile.memory_mib)


def mig_uuid(gpu_uuid: str, gpu_instance: int, compute_instance: int, made: int = 0) -> str:
    """A MIG device's UUID: fixed for a configured one (``made`` 0); one the driver made (its
    ``made``-th) is new each time, as on a real driver."""
    key = f"{gpu_uuid}/{gpu_instance}/{compute_instance}" + (f"#{made}" if made else "")
    return f"MIG-{uuid.uuid5(_UUID_NAMESPACE, key)}"


def _mig_devices(
    profile: GpuProfile, names: tuple[str, ...], memory_mib: int, gpu_uuid: str
) -> tuple[SimMigSpec, ...]:
    profiles = [profile.mig_profile(name) for name in names]
    shapes = [p for p in profiles if p is not None]
    starts = place_mig(shapes)
    if len(shapes) != len(names) or starts is None:
        raise ValueError(f"invalid MIG layout {names!r} for {profile.key}")  # validated by _mig
    devices = []
    for shape, start in zip(shapes, starts, strict=True):
        gi = gpu_instance_id(start, shape.memory_slices)
        devices.append(
            SimMigSpec(
                profile=shape,
                gpu_instance_id=gi,
                compute_instance_id=0,
                start=start,
                memory_mib=mig_memory_mib(shape, profile, memory_mib),
                uuid=mig_uuid(gpu_uuid, gi, 0),
            )
        )
    return tuple(sorted(devices, key=lambda d: d.gpu_instance_id))


def gpu_spec(
    index: int,
    count: int,
    profile: GpuProfile,
    *,
    name: str | None = None,
    memory_mib: int | None = None,
    numa_node: int | None = None,
    mig: tuple[str, ...] = (),
) -> SimGpuSpec:
    reported = profile.model_name if name is None else name
    memory = profile.memory_mib if memory_mib is None else memory_mib
    gpu_uuid = f"GPU-{uuid.uuid5(_UUID_NAMESPACE, f'{reported}/{index}')}"
    return SimGpuSpec(
        index=index,
        name=reported,
        memory_mib=memory,
        numa_node=(0 if index < (count + 1) // 2 else 1) if numa_node is None else numa_node,
        mig=mig,
        uuid=gpu_uuid,
        pci_bus_id=f"00000000:{0x10 + 3 * index:02X}:00.0",
        minor=index,
        profile=profile,
        mig_devices=_mig_devices(profile, mig, memory, gpu_uuid) if mig else (),
    )


def node_from_count(n: int) -> SimNode:
    """``--simulate N``: N H100 80GB HBM3 SXM GPUs on an HGX-like board.

    Every pair is joined by NVLink (the profile's links shared evenly over the peers, at least
    one each), the first half of the GPUs sits on NUMA node 0 and the rest on NUMA node 1.
    """
    if type(n) is not int or not 1 <= n <= MAX_GPUS:
        raise SimConfigError(
            "simulate", f"must be a number of GPUs from 1 to {MAX_GPUS}, got {n!r}"
        )
    profile = DEFAULT_PROFILE
    gpus = tuple(gpu_spec(i, n, profile) for i in range(n))
    per_pair = max(1, profile.nvlink_count // (n - 1)) if n > 1 else 0
    links = tuple((a, b, per_pair) for a in range(n) for b in range(a + 1, n))
    return SimNode(gpus=gpus, nvlinks=links)


def node_with_nvswitches(n: int, switches: int = 4) -> SimNode:
    """N H100 GPUs joined only through ``switches`` NVSwitches, as on an HGX H100 board.

    Each GPU spreads its 18 links over the switches (5, 5, 4, 4 for four), so any two GPUs reach
    each other over 18 links through the fabric; no link joins two GPUs directly. NUMA nodes split
    like ``--simulate N``. For tests and programmatic use; ``--sim-config`` has no such key.
    """
    if type(n) is not int or not 1 <= n <= MAX_GPUS:
        raise SimConfigError(
            "simulate", f"must be a number of GPUs from 1 to {MAX_GPUS}, got {n!r}"
        )
    if type(switches) is not int or not 1 <= switches <= MAX_NVSWITCHES:
        raise SimConfigError("nvswitches", f"must be from 1 to {MAX_NVSWITCHES}, got {switches!r}")
    profile = DEFAULT_PROFILE
    per_switch = [
        profile.nvlink_count // switches + (1 if k < profile.nvlink_count % switches else 0)
        for k in range(switches)
    ]
    links = tuple(
        (gpu, k, count) for gpu in range(n) for k, count in enumerate(per_switch) if count > 0
    )
    gpus = tuple(gpu_spec(i, n, profile) for i in range(n))
    return SimNode(gpus=gpus, nvswitch_links=links)


def mig_minors_text(node: SimNode) -> str:
    """The node's ``/proc/driver/nvidia-caps/mig-minors``, as the NVIDIA kernel module writes it.

    ``config 1``, ``monitor 2``, then for every GPU minor (at least 32) and every possible GPU
    instance (0-14) ``gpu<minor>/gi<gi>/access <N>`` followed by its compute instances (0-7)
    ``gpu<minor>/gi<gi>/ci<ci>/access <N+1+ci>``: 135 consecutive minors per GPU from 3 on, so the
    last line of a 32-GPU file is ``gpu31/gi14/ci7/access 4322``.
    """
    gpus = max(CAPS_GPUS, 1 + max((g.minor for g in node.gpus), default=0))
    lines = ["config 1", "monitor 2"]
    minor = 3
    for gpu in range(gpus):
        for gi in range(CAPS_GPU_INSTANCES):
            lines.append(f"gpu{gpu}/gi{gi}/access {minor}")
            minor += 1
            for ci in range(CAPS_COMPUTE_INSTANCES):
                lines.append(f"gpu{gpu}/gi{gi}/ci{ci}/access {minor}")
                minor += 1
    return "\n".join(lines) + "\n"
