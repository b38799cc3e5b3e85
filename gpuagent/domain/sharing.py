"""NVIDIA's ``sharing`` block as a whole: time-slicing or MPS, and MPS's own rules.

``sharing.mps`` has the shape of ``sharing.timeSlicing`` (NVIDIA's ``ReplicatedResources``) and
replicates devices by the same rules (:class:`~gpuagent.domain.timeslicing.TimeSlicing`), with
NVIDIA's MPS differences (NVIDIA/k8s-device-plugin v0.20, ``api/config/v1/config.go``,
``cmd/mps-control-daemon/mps/device.go``, ``cmd/nvidia-device-plugin/main.go``):
``failRequestsGreaterThanOne`` is true unless set; a server takes at most 48 clients per GPU, so
at most 48 replicas; MIG devices cannot be shared through MPS. Where NVIDIA's plugin is silent
or quietly ignores what it was given, this refuses with the key at fault: both blocks at once
(NVIDIA uses ``mps`` and drops ``timeSlicing`` without a word), a device list naming MIG devices,
and rules naming one resource with different replica counts (one daemon serves a resource, with
one active thread percentage for all its clients).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpuagent.domain.errors import SettingError
from gpuagent.domain.timeslicing import ReplicaRule, TimeSlicing

__all__ = ["MAX_MPS_REPLICAS", "MPS_KEY", "MpsSharing", "Sharing"]

MPS_KEY = "sharing.mps"
#: Clients an MPS server takes per GPU since Volta (NVIDIA's ``maxClients``; 16 before Volta).
MAX_MPS_REPLICAS = 48


@dataclass(frozen=True, slots=True)
class MpsSharing:
    """``sharing.mps``, validated on construction; a :class:`SettingError` names the key."""

    resources: tuple[ReplicaRule, ...] = ()
    rename_by_default: bool = False
    fail_requests_greater_than_one: bool = True
    rules: TimeSlicing = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        rules = TimeSlicing(
            resources=self.resources,
            rename_by_default=self.rename_by_default,
            fail_requests_greater_than_one=self.fail_requests_greater_than_one,
            key=MPS_KEY,
        )
        replicas: dict[str, tuple[int, int]] = {}
        for i, rule in enumerate(rules.resources):
            where = f"{MPS_KEY}.resources[{i}]"
            if rule.replicas > MAX_MPS_REPLICAS:
                raise SettingError(
                    f"{where}.replicas",
                    f"an MPS server takes at most {MAX_MPS_REPLICAS} clients per GPU, "
                    f"got {rule.replicas}",
                )
            if isinstance(rule.devices, tuple):
                migs = [d for d in rule.devices if ":" in d or d.startswith("MIG-")]
                if migs:
                    raise SettingError(
                        f"{where}.devices",
                        f"{', '.join(migs)}: MIG devices cannot be shared through MPS",
                    )
            first = replicas.setdefault(rule.name, (i, rule.replicas))
            if first[1] != rule.replicas:
                raise SettingError(
                    f"{where}.replicas",
                    f"{rule.name} is shared through one MPS daemon with one active thread "
                    f"percentage: every rule naming it needs the same replicas "
                    f"({first[1]} in resources[{first[0]}], {rule.replicas} here)",
                )
        object.__setattr__(self, "resources", rules.resources)
        object.__setattr__(self, "rules", rules)

    @property
    def enabled(self) -> bool:
        return bool(self.resources)


@dataclass(frozen=True, slots=True)
class Sharing:
    """The whole ``sharing`` block: time-slicing or MPS (never both), or neither."""

    time_slicing: TimeSlicing = field(default_factory=TimeSlicing)
    mps: MpsSharing = field(default_factory=MpsSharing)

    def __post_init__(self) -> None:
        if self.time_slicing.enabled and self.mps.enabled:
            raise SettingError(
                "sharing",
                "timeSlicing and mps both share devices; keep one (NVIDIA's plugin would use "
                "mps and ignore timeSlicing)",
            )

    @property
    def strategy(self) -> str:
        """GFD's ``sharing-strategy`` value: ``mps``, ``time-slicing`` or ``none``."""
        if self.mps.enabled:
            return "mps"
        return "time-slicing" if self.time_slicing.enabled else "none"

    @property
    def replication(self) -> TimeSlicing:
        """The rules replicating devices: MPS's when it shares, else time-slicing's."""
        return self.mps.rules if self.mps.enabled else self.time_slicing
