"""The device model: what the agent knows about each GPU, as immutable values."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from types import MappingProxyType

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"


class IdStrategy(Enum):
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
    """A GPU's health: healthy exactly when no condition is active."""

    conditions: tuple[Condition, ...] = ()

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
    """One poll's readings for a GPU. ``None`` means the driver does not offer the value."""

    temperature_c: float | None = None
    power_w: float | None = None
    sm_clock_mhz: float | None = None
    mem_clock_mhz: float | None = None
    gpu_util_pct: float | None = None
    mem_util_pct: float | None = None
    fb_used_mib: float | None = None
    fb_free_mib: float | None = None
    energy_mj: float | None = None


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

    def device_id(self, strategy: IdStrategy) -> str:
        """The ID the kubelet sees for this GPU."""
        return self.uuid if strategy is IdStrategy.UUID else str(self.index)

    @property
    def device_node(self) -> str:
        """Path of the GPU's character device inside a container."""
        return f"/dev/nvidia{self.minor}"


@dataclass(frozen=True, slots=True)
class DriverState:
    """Whether the driver answered, and what it said when it did not."""

    up: bool = False
    version: str = ""
    error: str = ""


@dataclass(frozen=True, slots=True)
class Snapshot:
    """An immutable view of everything the agent knows, stamped with a version.

    Every change produces a new snapshot with a higher version; readers never see a partial update.
    """

    version: int = 0
    gpus: tuple[Gpu, ...] = ()
    driver: DriverState = DriverState()
    discovered: bool = False
    registered: bool = False

    def gpu(self, index: int) -> Gpu | None:
        for gpu in self.gpus:
            if gpu.index == index:
                return gpu
        return None

    def by_device_id(self, strategy: IdStrategy) -> dict[str, Gpu]:
        return {gpu.device_id(strategy): gpu for gpu in self.gpus}
