"""The device model: what the agent knows about each GPU and the node (:class:`NodeState`), as
immutable values, and each device as a resource advertises it to the kubelet (:class:`Device`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import IntEnum, StrEnum
from types import MappingProxyType

from gpuagent.domain.drashare import ClaimShare
from gpuagent.domain.migshapes import MigPartitions, Placement
from gpuagent.domain.mps import MpsState
from gpuagent.domain.usage import ProcessReading, Usage

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
#: What a DRA driver's claimed devices are kept under in :class:`Attribution` (no extended
#: resource name has a colon): see :mod:`gpuagent.domain.drapods`.
DRA_CLAIMED = "dra:"


class IdStrategy(StrEnum):
    """How a GPU is named to the kubelet (`--device-id-strategy`)."""

    UUID = "uuid"
    INDEX = "index"


@dataclass(frozen=True, slots=True)
class Condition:
    """One reason a GPU is unhealthy, e.g. ``Condition("xid", "79")`` or ``Condition("lost")``."""

    kind: str
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.kind} {self.detail}" if self.detail else self.kind


@dataclass(frozen=True, slots=True)
class GpuHealth:
    """A GPU's health: healthy exactly when no condition is active.

    ``strikes`` counts failed liveness checks in a row (one bad reading is not a verdict; the
    health policy decides how many are).
    """

    conditions: tuple[Condition, ...] = ()
    strikes: int = 0

    @property
    def healthy(self) -> bool:
        return not self.conditions

    @property
    def reason(self) -> str:
        """Human-readable reason, empty while healthy."""
        return ", ".join(str(c) for c in self.conditions)

    @property
    def kubelet_health(self) -> str:
        return HEALTHY if self.healthy else UNHEALTHY


@dataclass(frozen=True, slots=True)
class Telemetry:
    """One poll's readings for a GPU, in dcgm-exporter's units.

    ``None`` means the GPU or driver does not offer the value (it is then absent from /metrics).
    Counters (energy, PCIe replays, NVLink traffic, remapped rows) only grow while the driver runs.
    """

    temperature_c: float | None = None
    memory_temperature_c: float | None = None
    power_w: float | None = None
    energy_mj: float | None = None
    sm_clock_mhz: float | None = None
    mem_clock_mhz: float | None = None
    gpu_util_pct: float | None = None
    mem_util_pct: float | None = None
    enc_util_pct: float | None = None
    dec_util_pct: float | None = None
    fb_used_mib: float | None = None
    fb_free_mib: float | None = None
    fb_reserved_mib: float | None = None
    pcie_replays: float | None = None
    nvlink_bandwidth_total: float | None = None
    remapped_rows_correctable: float | None = None
    remapped_rows_uncorrectable: float | None = None
    row_remap_pending: float | None = None
    row_remap_failure: float | None = None
    ecc_sbe_volatile: float | None = None
    ecc_dbe_volatile: float | None = None
    # Profiling metrics through NVML GPM (Hopper and newer): ratios 0..1, PCIe in bytes/s.
    gr_engine_active: float | None = None
    sm_active: float | None = None
    sm_occupancy: float | None = None
    tensor_active: float | None = None
    dram_active: float | None = None
    pcie_tx_bytes: float | None = None
    pcie_rx_bytes: float | None = None
    # Time clocks were held down, ns since the driver loaded (NVML perf-policy violation counters).
    power_violation_ns: float | None = None
    thermal_violation_ns: float | None = None
    # NVLink error counters, all links together, since the driver loaded.
    nvlink_crc_flit_errors: float | None = None
    nvlink_crc_data_errors: float | None = None
    nvlink_replay_errors: float | None = None
    nvlink_recovery_errors: float | None = None


@dataclass(frozen=True, slots=True)
class MigAttributes:
    """What a MIG device holds (NVML ``nvmlDeviceGetAttributes``): SMs and shared engines."""

    multiprocessors: int = 0
    copy_engines: int = 0
    decoders: int = 0
    encoders: int = 0
    jpeg_engines: int = 0
    ofa_engines: int = 0


@dataclass(frozen=True, slots=True)
class MigDevice:
    """A MIG device: one compute instance inside one GPU instance of a MIG-enabled GPU."""

    uuid: str
    parent_index: int
    gpu_instance_id: int
    compute_instance_id: int
    profile: str
    memory_mib: int
    # The /dev/nvidia-caps nodes a container needs for this device (GI and CI access).
    device_nodes: tuple[str, ...] = ()
    telemetry: Telemetry = Telemetry()
    # None where the driver does not offer the attributes (GFD's MIG labels then lack them).
    attributes: MigAttributes | None = None
    # Conditions of this instance alone (an XID the driver attributed to it); the parent GPU's
    # conditions apply to it too: see :meth:`Gpu.health_of`.
    health: GpuHealth = GpuHealth()
    # Its GPU instance's profile ID and placement, where the driver said (None: not read).
    profile_id: int | None = None
    placement: Placement | None = None


@dataclass(frozen=True, slots=True)
class Gpu:
    """A full GPU as discovered from the driver, with its current health and telemetry."""

    index: int
    uuid: str
    minor: int
    name: str
    memory_mib: int
    pci_bus_id: str
    numa_node: int | None = None
    health: GpuHealth = GpuHealth()
    telemetry: Telemetry = Telemetry()
    xid_counts: Mapping[int, int] = field(default_factory=lambda: MappingProxyType({}))
    last_xid: int | None = None
    # GFD's family name of the architecture ("hopper", "ampere", "ada-lovelace"; "" unknown)
    architecture: str = ""
    # CUDA compute capability "major.minor" ("9.0"; "" unknown)
    compute_capability: str = ""
    # Whether the GPU supports MIG, as the driver answered at discovery (None: not known)
    mig_capable: bool | None = None
    mig_enabled: bool = False
    mig_devices: tuple[MigDevice, ...] = ()
    # The MIG the GPU could be partitioned into (read only where MIG is made on demand).
    mig_partitions: MigPartitions | None = None
    # The last poll's per-process readings (None until read, or while the GPU does not answer).
    processes: ProcessReading | None = None

    @classmethod
    def undescribed(cls, index: int, uuid: str, condition: Condition) -> Gpu:
        """A GPU known by index and UUID only, unhealthy for ``condition`` until described."""
        return cls(
            index=index,
            uuid=uuid,
            minor=index,
            name="",
            memory_mib=0,
            pci_bus_id="",
            health=GpuHealth((condition,)),
        )

    def device_id(self, strategy: IdStrategy) -> str:
        """The ID the kubelet sees for this GPU."""
        return self.uuid if strategy is IdStrategy.UUID else str(self.index)

    @property
    def device_node(self) -> str:
        """Path of the GPU's character device inside a container."""
        return f"/dev/nvidia{self.minor}"

    @property
    def overall_health(self) -> GpuHealth:
        """The whole GPU's health: its own conditions and those of any of its MIG devices."""
        extra = tuple(c for m in self.mig_devices for c in m.health.conditions)
        return GpuHealth(self.health.conditions + extra) if extra else self.health

    def health_of(self, mig: MigDevice) -> GpuHealth:
        """A MIG device's health as the kubelet sees it: the GPU's conditions, then its own."""
        if not mig.health.conditions:
            return self.health
        if not self.health.conditions:
            return mig.health
        return GpuHealth(self.health.conditions + mig.health.conditions)


class P2PLevel(IntEnum):
    """How two GPUs reach each other over PCIe (NVML's topology levels; lower is closer)."""

    INTERNAL = 0  # the same board (multi-GPU boards)
    SINGLE = 10  # one PCIe switch
    MULTIPLE = 20  # several PCIe switches, no host bridge
    HOSTBRIDGE = 30  # the same host bridge
    NODE = 40  # host bridges within one NUMA node
    SYSTEM = 50  # across NUMA nodes (SMP interconnect)


@dataclass(frozen=True, slots=True)
class Link:
    """How GPUs ``a`` < ``b`` are connected: PCIe level and direct NVLink link count."""

    a: int
    b: int
    p2p: P2PLevel | None = None
    nvlinks: int = 0


@dataclass(frozen=True, slots=True)
class Topology:
    """Pairwise GPU connectivity, read once at discovery (never per RPC)."""

    links: tuple[Link, ...] = ()

    def between(self, a: int, b: int) -> Link | None:
        lo, hi = min(a, b), max(a, b)
        for link in self.links:
            if link.a == lo and link.b == hi:
                return link
        return None


@dataclass(frozen=True, slots=True)
class PodRef:
    """A container that holds a device, per the kubelet's pod-resources API."""

    namespace: str
    pod: str
    container: str


@dataclass(frozen=True, slots=True)
class Allocated:
    """One container's devices of one resource, as the pod-resources API lists them; ``claim``:
    the ResourceClaim (``<namespace>/<name>``) a DRA device is held through."""

    namespace: str
    pod: str
    container: str
    resource: str
    device_ids: tuple[str, ...]
    claim: str = ""


def claimed_resource(driver: str) -> str:
    """The resource name a DRA driver's claimed devices are kept under."""
    return DRA_CLAIMED + driver


@dataclass(frozen=True, slots=True)
class Attribution:
    """What the kubelet last said about which containers hold which devices, and how fresh.

    ``allocated`` lists every device-plugin resource as the kubelet reported it; which of them
    are this agent's depends on the plan (:func:`gpuagent.domain.attribution.by_device`).
    """

    allocated: tuple[Allocated, ...] = ()
    refreshed_at: float | None = None  # monotonic seconds of the last successful List
    error: str = ""


@dataclass(frozen=True, slots=True)
class Registration:
    """One resource's registration with the kubelet: done, or why not (a short reason)."""

    registered: bool = False
    error: str = ""


@dataclass(frozen=True, slots=True)
class CdiSpec:
    """The node's CDI spec as this agent keeps it, for the devices the kubelet may be offered.

    ``devices``: the ``(UUID, index name)`` of each GPU and MIG device the spec on disk defines
    (under both namings); ``written``: a write has been tried since start (so the first device
    list need not wait any longer); ``error``: why the last write failed, if it did (the file on
    disk is then the one written before, or none).
    """

    devices: frozenset[tuple[str, str]] = frozenset()
    written: bool = False
    error: str = ""


@dataclass(frozen=True, slots=True)
class DriverState:
    """Whether the driver answered, and what it said when it did not."""

    up: bool = False
    version: str = ""
    error: str = ""
    # The CUDA version the driver supports, (major, minor) — e.g. (13, 0); None when unknown.
    cuda_version: tuple[int, int] | None = None
    # While the driver is brought up and GPUs discovered: what the agent is waiting for.
    waiting: str = ""


@dataclass(frozen=True, slots=True)
class NodeState:
    """Everything the agent knows about the node, as one immutable value.

    The store keeps it inside a :class:`~gpuagent.domain.snapshot.Snapshot` (with the plan it is
    served under, stamped with a version); everything below the plan reads it as this.
    """

    gpus: tuple[Gpu, ...] = ()
    driver: DriverState = DriverState()
    discovered: bool = False
    # Per resource the agent serves: its registration with the kubelet, kept by its endpoint.
    registrations: Mapping[str, Registration] = field(default_factory=lambda: MappingProxyType({}))
    topology: Topology = Topology()
    pods: Attribution = Attribution()
    # Per-container use of the GPUs, from the processes' readings (see domain/accounting.py).
    usage: Usage = field(default_factory=Usage)
    # The CDI spec this agent writes, as on disk; None when it writes none (so nothing waits).
    cdi: CdiSpec | None = None
    # The MPS control daemons the agent keeps, and how each is doing.
    mps: MpsState = field(default_factory=MpsState)
    # The prepared DRA claims' shares of GPUs (--dra-sharing mps), as the DRA side keeps them.
    shares: tuple[ClaimShare, ...] = ()
    # DRA's kubelet plugin's registration (the plugin watcher's verdict, or why the plugin is not
    # served), kept by its endpoint; None when DRA is off.
    dra_registration: Registration | None = None
    # The names of the devices in the ResourceSlices last published (None: none yet), kept by the
    # slice publisher.
    dra_published: frozenset[str] | None = None

    @property
    def registered(self) -> bool:
        """Whether every resource served is registered with the kubelet (and there is one)."""
        return bool(self.registrations) and all(r.registered for r in self.registrations.values())

    def gpu(self, index: int) -> Gpu | None:
        for gpu in self.gpus:
            if gpu.index == index:
                return gpu
        return None

    def by_device_id(self, strategy: IdStrategy) -> dict[str, Gpu]:
        return {gpu.device_id(strategy): gpu for gpu in self.gpus}


@dataclass(frozen=True, slots=True)
class Device:
    """One device of a resource, as advertised.

    ``id`` is what the kubelet sees (``replica`` annotated); :meth:`name` is what the container
    is told, per ``--device-id-strategy``. ``gpu`` and ``minor`` are the physical GPU's index and
    minor number; a MIG device also has its profile and its ``/dev/nvidia-caps`` nodes.
    """

    id: str
    uuid: str
    index: str
    gpu: int
    gpu_uuid: str
    minor: int
    healthy: bool = True
    reason: str = ""
    numa_node: int | None = None
    replica: int | None = None
    replicas: int = 1
    mig_profile: str = ""
    caps: tuple[str, ...] = ()
    memory_mib: int = 0

    @property
    def health(self) -> str:
        return HEALTHY if self.healthy else UNHEALTHY

    @property
    def is_mig(self) -> bool:
        return bool(self.mig_profile)

    @property
    def is_replica(self) -> bool:
        return self.replica is not None

    def name(self, strategy: IdStrategy) -> str:
        """The device's name for the container: its UUID, or ``"i"`` / ``"i:j"``."""
        return self.uuid if strategy is IdStrategy.UUID else self.index

    @property
    def device_nodes(self) -> tuple[str, ...]:
        """The character devices this device needs in a container (besides the control nodes)."""
        return (f"/dev/nvidia{self.minor}", *self.caps)
