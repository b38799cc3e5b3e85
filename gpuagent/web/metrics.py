"""What /metrics says: dcgm-exporter's names for GPU telemetry, ``gpuagent_`` for our own."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gpuagent.domain.devices import Gpu, Snapshot, Telemetry
from gpuagent.web.exposition import Family, label_block, render

# (metric name, type, HELP as dcgm-exporter writes it, reading)
_DCGM: tuple[tuple[str, str, str, Callable[[Telemetry], float | None]], ...] = (
    ("DCGM_FI_DEV_SM_CLOCK", "gauge", "SM clock frequency (in MHz).", lambda t: t.sm_clock_mhz),
    ("DCGM_FI_DEV_MEM_CLOCK", "gauge", "Memory clock frequency (in MHz).",
     lambda t: t.mem_clock_mhz),
    ("DCGM_FI_DEV_GPU_TEMP", "gauge", "GPU temperature (in C).", lambda t: t.temperature_c),
    ("DCGM_FI_DEV_POWER_USAGE", "gauge", "Power draw (in W).", lambda t: t.power_w),
    ("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "counter",
     "Total energy consumption since boot (in mJ).", lambda t: t.energy_mj),
    ("DCGM_FI_DEV_GPU_UTIL", "gauge", "GPU utilization (in %).", lambda t: t.gpu_util_pct),
    ("DCGM_FI_DEV_MEM_COPY_UTIL", "gauge", "Memory utilization (in %).",
     lambda t: t.mem_util_pct),
    ("DCGM_FI_DEV_FB_FREE", "gauge", "Framebuffer memory free (in MiB).",
     lambda t: t.fb_free_mib),
    ("DCGM_FI_DEV_FB_USED", "gauge", "Framebuffer memory used (in MiB).",
     lambda t: t.fb_used_mib),
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class AgentCounters:
    """The agent's own counters that live outside the device snapshot."""

    registrations: int = 0
    allocations: int = 0


class MetricsRenderer:
    """Renders a snapshot; the GPU part is cached per snapshot version."""

    def __init__(self, hostname: str, version: str) -> None:
        self._hostname = hostname
        self._version = version
        self._cached_version = -1
        self._cached = ""

    def render(self, snapshot: Snapshot, counters: AgentCounters) -> str:
        if snapshot.version != self._cached_version:
            self._cached = self._render_devices(snapshot)
            self._cached_version = snapshot.version
        return self._cached + self._render_agent(snapshot, counters)

    def _render_devices(self, snapshot: Snapshot) -> str:
        driver = snapshot.driver.version
        dcgm = [Family(name, kind, help_text) for name, kind, help_text, _ in _DCGM]
        xid_last = Family(
            "DCGM_FI_DEV_XID_ERRORS", "gauge", "Value of the last XID error encountered."
        )
        healthy = Family(
            "gpuagent_gpu_healthy",
            "gauge",
            "Whether the kubelet is told the GPU is Healthy (1) or Unhealthy (0).",
        )
        condition = Family(
            "gpuagent_gpu_condition",
            "gauge",
            "Active reasons a GPU is unhealthy (1 while active).",
        )
        xids = Family(
            "gpuagent_xid_errors_total", "counter", "XID errors reported by the driver, per XID."
        )
        for gpu in snapshot.gpus:
            block = label_block(self._dcgm_labels(gpu, driver))
            for family, (_, _, _, read) in zip(dcgm, _DCGM, strict=True):
                value = read(gpu.telemetry)
                if value is not None:
                    family.add(block, value)
            if gpu.last_xid is not None:
                xid_last.add(block, gpu.last_xid)
            own = (("gpu", str(gpu.index)), ("uuid", gpu.uuid))
            healthy.add(own, 1 if gpu.health.healthy else 0)
            for c in gpu.health.conditions:
                condition.add((*own, ("condition", c.kind), ("detail", c.detail)), 1)
            for xid, count in sorted(gpu.xid_counts.items()):
                xids.add((*own, ("xid", str(xid))), count)
        return render([*dcgm, xid_last, healthy, condition, xids])

    def _dcgm_labels(self, gpu: Gpu, driver: str) -> list[tuple[str, str]]:
        return [
            ("gpu", str(gpu.index)),
            ("UUID", gpu.uuid),
            ("pci_bus_id", gpu.pci_bus_id),
            ("device", f"nvidia{gpu.minor}"),
            ("modelName", gpu.name),
            ("Hostname", self._hostname),
            ("DCGM_FI_DRIVER_VERSION", driver),
        ]

    def _render_agent(self, snapshot: Snapshot, counters: AgentCounters) -> str:
        info = Family("gpuagent_build_info", "gauge", "gpuagent version and the driver it runs on.")
        info.add((("version", self._version), ("driver_version", snapshot.driver.version)), 1)
        up = Family("gpuagent_driver_up", "gauge", "Whether the NVIDIA driver answers (1) or not.")
        up.add((), 1 if snapshot.driver.up else 0)
        gpus = Family("gpuagent_gpus", "gauge", "GPUs discovered on this node.")
        gpus.add((), len(snapshot.gpus))
        registered = Family(
            "gpuagent_kubelet_registered", "gauge", "Whether the device plugin is registered."
        )
        registered.add((), 1 if snapshot.registered else 0)
        registrations = Family(
            "gpuagent_kubelet_registrations_total",
            "counter",
            "Successful registrations with the kubelet.",
        )
        registrations.add((), counters.registrations)
        allocations = Family(
            "gpuagent_allocations_total", "counter", "Allocate calls answered successfully."
        )
        allocations.add((), counters.allocations)
        return render([info, up, gpus, registered, registrations, allocations])
