"""What /metrics says: dcgm-exporter's names for GPU telemetry, ``gpuagent_`` for our own.

The exposition has two parts:

* the **device part** — every dcgm-exporter series and the per-GPU ``gpuagent_`` families — depends
  only on the snapshot, so it is rendered once per snapshot version and cached, with its gzip
  stream once a gzip scrape has asked for it (see :class:`DevicePart`);
* the **agent part** — counters, pod-resources freshness, scrape durations — is small and rendered
  on every scrape.

Nothing here calls NVML or the kubelet: a scrape reads the store's snapshot and in-memory counters.
The families themselves are :mod:`gpuagent.web.dcgm` (dcgm-exporter's) and below (ours).
"""

from __future__ import annotations

import platform
import struct
import time
import zlib
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass

from gpuagent.domain.attribution import Target, attributions, by_device
from gpuagent.domain.devices import Allocated, Gpu, MigDevice, PodRef, Snapshot
from gpuagent.domain.plan import Plan
from gpuagent.domain.usage import ContainerUsage
from gpuagent.state.counters import (
    AgentCounters,
    DraCounters,
    NvmlCallStats,
    PodResourcesStats,
    ReloadStats,
)
from gpuagent.web.dcgm import (
    DCGM_METRICS,
    INSTANCE_SCOPE,
    XID_ERRORS,
    XID_ERRORS_HELP,
    xid_action,
    xid_label,
    xid_message,
)
from gpuagent.web.exposition import Family, escape_label, format_value, header, label_pairs, render
from gpuagent.web.histogram import SCRAPE_BUCKETS, Histogram
from gpuagent.web.usage import SHARED_DCGM, accounting_families, render_usage

__all__ = ["DevicePart", "MetricsRenderer"]

DEFAULT_SERVED = Plan().served_resources
_GZIP_HEADER = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff"  # deflate, no name, no mtime


class DevicePart:
    """The device part of one snapshot version, as byte chunks, and (once asked) its gzip stream.

    The (large) device part is compressed once per version, ending on a sync flush; each gzip
    scrape then compresses only its (small) agent part and appends it, with the trailer (CRC-32
    and size of the whole), to the cached prefix.
    """

    __slots__ = ("_crc", "_deflated", "chunks", "size", "version")

    def __init__(self, version: int, chunks: Iterable[bytes] = ()) -> None:
        self.version = version
        self.chunks = list(chunks)
        self.size = sum(map(len, self.chunks))
        self._deflated: bytes | None = None
        self._crc = 0

    @property
    def text(self) -> bytes:
        return b"".join(self.chunks)

    def gzip(self, tail: bytes) -> list[bytes]:
        """Chunks that together are the gzip stream of the device part followed by ``tail``."""
        if self._deflated is None:
            text = self.text
            compressor = zlib.compressobj(1, zlib.DEFLATED, -15)
            self._deflated = compressor.compress(text) + compressor.flush(zlib.Z_SYNC_FLUSH)
            self._crc = zlib.crc32(text)
        compressor = zlib.compressobj(1, zlib.DEFLATED, -15)
        end = compressor.compress(tail) + compressor.flush()
        trailer = struct.pack(
            "<II", zlib.crc32(tail, self._crc), (self.size + len(tail)) & 0xFFFFFFFF
        )
        return [_GZIP_HEADER, self._deflated, end + trailer]


@dataclass(frozen=True, slots=True)
class _Series:
    """One series' device and label blocks (one per container holding it, or one unattributed).

    ``gpu`` and ``mig`` are positions in ``snapshot.gpus`` and that GPU's ``mig_devices``.
    """

    target: Target
    gpu: int
    mig: int | None
    blocks: tuple[bytes, ...]
    refs: tuple[PodRef, ...] = ()  # the container of each block (none when unattributed)


@dataclass(frozen=True, slots=True)
class _Layout:
    """What stays put while only readings change: series, label blocks and identity families."""

    gpus: tuple[object, ...]
    driver: str
    allocated: tuple[Allocated, ...]
    served: frozenset[str]
    device_ids: int  # device IDs of served resources the kubelet lists as held
    series: tuple[_Series, ...]
    static: bytes


class MetricsRenderer:
    """Renders snapshots for /metrics; the device part is cached per snapshot version.

    ``hostname_label`` is ``Hostname`` (dcgm-exporter before May 2026), ``hostname`` (after), or
    ``None`` to leave the label out (dcgm-exporter's ``--no-hostname``). ``container_shares``: a
    full GPU's dcgm-exporter series carry each holding container's own reading where NVML has it
    per process (``--dcgm-container-shares``, see :mod:`gpuagent.web.usage`). ``accounting``:
    whether per-container accounting runs (``--container-accounting``), as
    ``gpuagent_container_accounting_enabled`` says.
    """

    def __init__(
        self,
        hostname: str,
        version: str,
        *,
        hostname_label: str | None = "Hostname",
        monotonic: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        container_shares: bool = False,
        kubernetes: bool = True,
        accounting: bool = True,
    ) -> None:
        self.hostname = hostname
        self.accounting = accounting
        # Off Kubernetes (--kubernetes=false) there is no kubelet: no registration families.
        self.kubernetes = kubernetes
        self.container_shares = container_shares
        self.version = version
        self.hostname_label = hostname_label
        self.monotonic = monotonic
        self.wall = wall
        self.scrapes = Histogram(SCRAPE_BUCKETS)
        self.device_renders = 0
        self.layouts = 0
        self._cached: DevicePart | None = None
        self._layout: _Layout | None = None

    def devices(self, snapshot: Snapshot, served: Collection[str] = DEFAULT_SERVED) -> DevicePart:
        """The device part for ``snapshot``, rendered only when its version is new.

        ``served`` are the resource names of the plan ``snapshot`` was taken under (its pods are
        attributed by them): a new plan is a new snapshot version.
        """
        cached = self._cached
        if cached is not None and cached.version == snapshot.version:
            return cached
        part = DevicePart(snapshot.version, self._render_device_chunks(snapshot, served))
        self._cached = part
        self.device_renders += 1
        return part

    def agent(
        self, snapshot: Snapshot, counters: AgentCounters, served: Collection[str] = DEFAULT_SERVED
    ) -> bytes:
        """The agent part, rendered fresh on each scrape."""
        return self._render_agent(snapshot, counters, served).encode()

    def render(
        self, snapshot: Snapshot, counters: AgentCounters, served: Collection[str] = DEFAULT_SERVED
    ) -> str:
        """The whole exposition as text (the HTTP handler writes the two parts separately)."""
        device_part = self.devices(snapshot, served).text
        return (device_part + self.agent(snapshot, counters, served)).decode()

    # ----- device part -------------------------------------------------------------------------
    def _layout_for(self, snapshot: Snapshot, served: Collection[str]) -> _Layout:
        gpus = tuple(_identity(gpu) for gpu in snapshot.gpus)
        driver = snapshot.driver.version
        allocated = snapshot.pods.allocated
        cached = self._layout
        if (
            cached is not None
            and cached.gpus == gpus
            and cached.driver == driver
            and (cached.allocated is allocated or cached.allocated == allocated)
            and cached.served == served
        ):
            return cached
        mapping = by_device(allocated, served)
        pods = attributions(snapshot, mapping)
        tail = ""
        if self.hostname_label is not None:
            tail += f',{self.hostname_label}="{escape_label(self.hostname)}"'
        tail += f',DCGM_FI_DRIVER_VERSION="{escape_label(driver)}"'
        series = []
        for position, gpu in enumerate(snapshot.gpus):
            base = label_pairs(
                (
                    ("gpu", str(gpu.index)),
                    ("UUID", gpu.uuid),
                    ("pci_bus_id", gpu.pci_bus_id),
                    ("device", f"nvidia{gpu.index}"),  # dcgm-exporter: the index, not the minor
                    ("modelName", gpu.name),
                )
            )
            instances = _gpu_instances(gpu) if gpu.mig_enabled else []
            if not instances:
                target = Target(gpu.index)
                refs = pods.get(target, ())
                series.append(_Series(target, position, None, _blocks(base + tail, refs), refs))
                continue
            for mig_position, mig in instances:
                target = Target(gpu.index, mig.gpu_instance_id)
                labels = (
                    f'{base},GPU_I_PROFILE="{escape_label(mig.profile)}"'
                    f',GPU_I_ID="{mig.gpu_instance_id}"{tail}'
                )
                series.append(
                    _Series(target, position, mig_position, _blocks(labels, pods.get(target, ())))
                )
        layout = _Layout(
            gpus=gpus,
            driver=driver,
            allocated=allocated,
            served=frozenset(served),
            device_ids=len(mapping),
            series=tuple(series),
            static=self._render_identity_families(snapshot, pods).encode(),
        )
        self._layout = layout
        self.layouts += 1
        return layout

    def _render_device_chunks(self, snapshot: Snapshot, served: Collection[str]) -> Iterator[bytes]:
        """The device part, one family per chunk."""
        layout = self._layout_for(snapshot, served)
        gpus = snapshot.gpus
        readings = [
            (
                gpus[s.gpu].telemetry,
                gpus[s.gpu].telemetry
                if s.mig is None
                else gpus[s.gpu].mig_devices[s.mig].telemetry,
                s.blocks,
            )
            for s in layout.series
        ]
        shares = self._shares(snapshot, layout) if self.container_shares else {}
        for metric in DCGM_METRICS:
            name, read, own = metric.name.encode(), metric.read, metric.scope == INSTANCE_SCOPE
            share = SHARED_DCGM.get(metric.name)
            parts: list[bytes] = []
            for n, (whole, instance, blocks) in enumerate(readings):
                value = read(instance if own else whole)
                if value is None:
                    continue
                held = shares.get(n)
                if held and share is not None:
                    # Each container's own reading (the GPU's where NVML has none for it).
                    for block, usage in zip(blocks, held, strict=True):
                        mine = share(usage) if usage is not None else None
                        own_value = value if mine is None else mine
                        parts.append(
                            b"%s{%s} %s\n" % (name, block, format_value(own_value).encode())
                        )
                    continue
                # One sample per label block, all with the same value: one C-level join.
                end = b"} " + format_value(value).encode() + b"\n"
                parts.append(name + b"{" + (end + name + b"{").join(blocks) + end)
            if parts:
                yield header(metric.name, metric.kind, metric.help).encode() + b"".join(parts)
            if metric.name == "DCGM_FI_DEV_DEC_UTIL":
                xid = self._render_xid_last(snapshot, layout)
                if xid:
                    yield xid
        yield self._render_health_families(snapshot).encode()
        yield layout.static
        host = ""
        if self.hostname_label is not None:
            host = f',{self.hostname_label}="{escape_label(self.hostname)}"'
        yield render_usage(snapshot, host).encode()

    @staticmethod
    def _shares(snapshot: Snapshot, layout: _Layout) -> dict[int, list[ContainerUsage | None]]:
        """Per series position (full GPUs held by containers): each block's container usage."""
        usage = {
            (u.gpu, PodRef(u.namespace, u.pod, u.container)): u
            for u in snapshot.usage.containers
            if u.gpu_instance is None
        }
        if not usage:
            return {}
        return {
            n: [usage.get((s.target.gpu, ref)) for ref in s.refs]
            for n, s in enumerate(layout.series)
            if s.mig is None and s.refs
        }

    @staticmethod
    def _render_xid_last(snapshot: Snapshot, layout: _Layout) -> bytes:
        name = XID_ERRORS.encode()
        parts: list[bytes] = []
        for s in layout.series:
            xid = snapshot.gpus[s.gpu].last_xid or 0
            end = (
                f',err_code="{xid}",err_msg="{escape_label(xid_message(xid))}"}} {xid}\n'
            ).encode()
            parts.append(name + b"{" + (end + name + b"{").join(s.blocks) + end)
        if not parts:
            return b""
        return header(XID_ERRORS, "gauge", XID_ERRORS_HELP).encode() + b"".join(parts)

    @staticmethod
    def _render_health_families(snapshot: Snapshot) -> str:
        healthy = Family(
            "gpuagent_gpu_healthy",
            "gauge",
            "Whether the GPU and every MIG device of it are Healthy (1) or not (0), as the "
            "kubelet is told.",
        )
        condition = Family(
            "gpuagent_gpu_condition",
            "gauge",
            "Active reasons a GPU is unhealthy (1 while active); gpu_instance and "
            "compute_instance name a MIG device when the reason is that device's alone.",
        )
        mig_healthy = Family(
            "gpuagent_mig_device_healthy",
            "gauge",
            "Whether the kubelet is told the MIG device is Healthy (1) or Unhealthy (0).",
        )
        xids = Family(
            "gpuagent_xid_errors_total",
            "counter",
            'XID errors reported by the driver, per XID of NVIDIA\'s catalog (xid="other": any '
            "other value), with the catalog's immediate action.",
        )
        for gpu in snapshot.gpus:
            own = (("gpu", str(gpu.index)), ("uuid", gpu.uuid))
            healthy.add(own, 1 if gpu.overall_health.healthy else 0)
            for c in gpu.health.conditions:
                condition.add((*own, ("condition", c.kind), ("detail", c.detail)), 1)
            for m in gpu.mig_devices:
                instance = (
                    ("gpu_instance", str(m.gpu_instance_id)),
                    ("compute_instance", str(m.compute_instance_id)),
                )
                mig_healthy.add(
                    (*own, ("mig_uuid", m.uuid), *instance), 1 if gpu.health_of(m).healthy else 0
                )
                for c in m.health.conditions:
                    condition.add((*own, ("condition", c.kind), ("detail", c.detail), *instance), 1)
            per_label: dict[str, tuple[int, str]] = {}
            for xid, count in gpu.xid_counts.items():
                label = xid_label(xid)
                total, _ = per_label.get(label, (0, ""))
                per_label[label] = (total + count, xid_action(xid))
            for label, (count, action) in sorted(
                per_label.items(), key=lambda kv: _xid_order(kv[0])
            ):
                xids.add((*own, ("xid", label), ("action", action)), count)
        return render([healthy, condition, mig_healthy, xids])

    @staticmethod
    def _render_identity_families(
        snapshot: Snapshot, pods: dict[Target, tuple[PodRef, ...]]
    ) -> str:
        info = Family(
            "gpuagent_gpu_info",
            "gauge",
            "A GPU the agent serves, with its identity (value 1).",
        )
        mig = Family(
            "gpuagent_mig_device_info",
            "gauge",
            "A MIG device of a MIG-enabled GPU, with its identity (value 1).",
        )
        allocated = Family(
            "gpuagent_device_allocated",
            "gauge",
            "A container holding a GPU or MIG device, per the kubelet's pod-resources API "
            "(value 1; the gpu_instance label is empty for a full GPU).",
        )
        by_index = {gpu.index: gpu for gpu in snapshot.gpus}
        for gpu in snapshot.gpus:
            own = (("gpu", str(gpu.index)), ("uuid", gpu.uuid))
            info.add(
                (
                    *own,
                    ("pci_bus_id", gpu.pci_bus_id),
                    ("device", f"nvidia{gpu.index}"),  # joins the dcgm-exporter series
                    ("device_node", gpu.device_node),
                    ("model_name", gpu.name),
                    ("numa_node", "" if gpu.numa_node is None else str(gpu.numa_node)),
                    ("mig_enabled", "true" if gpu.mig_enabled else "false"),
                ),
                1,
            )
            for m in gpu.mig_devices:
                mig.add(
                    (
                        *own,
                        ("mig_uuid", m.uuid),
                        ("profile", m.profile),
                        ("gpu_instance", str(m.gpu_instance_id)),
                        ("compute_instance", str(m.compute_instance_id)),
                    ),
                    1,
                )
        for target, refs in sorted(pods.items()):
            parent = by_index.get(target.gpu)
            if parent is None:
                continue
            instance = "" if target.gpu_instance is None else str(target.gpu_instance)
            for ref in refs:
                allocated.add(
                    (
                        ("gpu", str(target.gpu)),
                        ("uuid", parent.uuid),
                        ("gpu_instance", instance),
                        ("namespace", ref.namespace),
                        ("pod", ref.pod),
                        ("container", ref.container),
                    ),
                    1,
                )
        return render([info, mig, allocated])

    # ----- agent part --------------------------------------------------------------------------
    def _render_agent(
        self, snapshot: Snapshot, counters: AgentCounters, served: Collection[str]
    ) -> str:
        families = [
            _single("gpuagent_build_info", "gauge",
                    "gpuagent's version, the Python it runs on, the NVIDIA driver and the node "
                    "(value 1).",
                    (("version", self.version), ("python_version", platform.python_version()),
                     ("driver_version", snapshot.driver.version), ("node", self.hostname)), 1),
            _single("gpuagent_driver_up", "gauge",
                    "Whether the NVIDIA driver answers (1) or not (0).", (),
                    1 if snapshot.driver.up else 0),
            _single("gpuagent_gpus", "gauge", "GPUs discovered on this node.", (),
                    len(snapshot.gpus)),
        ]  # fmt: skip
        if self.kubernetes:
            families += [
                _single("gpuagent_kubelet_registered", "gauge",
                        "Whether the device plugin is registered with the kubelet (1) or not (0).",
                        (), 1 if snapshot.registered else 0),
                _single("gpuagent_kubelet_registrations_total", "counter",
                        "Successful registrations with the kubelet.", (), counters.registrations),
                _single("gpuagent_allocations_total", "counter",
                        "Allocate calls answered successfully.", (), counters.allocations),
            ]  # fmt: skip
        families.extend(_config_families(snapshot.plan_generation, counters.reloads))
        devices = self._layout_for(snapshot, served).device_ids
        families.extend(self._pod_resources_families(snapshot, counters.pod_resources, devices))
        families.extend(_nvml_families(counters.nvml))
        families.extend(_dra_families(counters.dra))
        families.extend(accounting_families(self.accounting, counters.log_links, counters.cri))
        scrape = Family(
            "gpuagent_scrape_duration_seconds",
            "histogram",
            "Time to answer a /metrics request, from the request to the last byte handed to the "
            "socket (earlier scrapes; this one is not included).",
        )
        scrape.add_histogram((), self.scrapes.cumulative(), self.scrapes.total, self.scrapes.count)
        families.append(scrape)
        return render(families)

    def _pod_resources_families(
        self, snapshot: Snapshot, stats: PodResourcesStats | None, device_ids: int
    ) -> list[Family]:
        if stats is None:
            return []
        pods = snapshot.pods
        out = [
            _single("gpuagent_pod_resources_up", "gauge",
                    "Whether the last pod-resources List succeeded (1) or not (0).", (),
                    1 if pods.refreshed_at is not None and not pods.error else 0),
            _single("gpuagent_pod_resources_socket_present", "gauge",
                    "Whether the kubelet pod-resources socket exists (1) or not (0).", (),
                    1 if stats.socket_present else 0),
            _single("gpuagent_pod_resources_requests_total", "counter",
                    "pod-resources List calls made.", (), stats.requests),
            _single("gpuagent_pod_resources_errors_total", "counter",
                    "pod-resources List calls that failed (socket absent, kubelet down, error).",
                    (), stats.errors),
            _single("gpuagent_pod_resources_devices", "gauge",
                    "Device IDs in the last known pod-resources mapping.", (),
                    device_ids),
        ]  # fmt: skip
        if pods.refreshed_at is not None:
            age = max(0.0, self.monotonic() - pods.refreshed_at)
            out.append(
                _single("gpuagent_pod_resources_age_seconds", "gauge",
                        "Seconds since the pod attribution was last refreshed successfully.",
                        (), round(age, 3))
            )  # fmt: skip
            out.append(
                _single("gpuagent_pod_resources_last_success_timestamp_seconds", "gauge",
                        "Unix time of the last successful pod-resources List.", (),
                        round(self.wall() - age, 3))
            )  # fmt: skip
        return out


def _single(
    name: str, kind: str, help_text: str, labels: tuple[tuple[str, str], ...], value: float
) -> Family:
    family = Family(name, kind, help_text)
    family.add(labels, value)
    return family


def _config_families(generation: int, reloads: ReloadStats) -> list[Family]:
    total = Family(
        "gpuagent_config_reloads_total",
        "counter",
        "Configuration reloads (SIGHUP or a changed config file), by result: changed (applied), "
        "unchanged (nothing to apply), invalid (refused; the running configuration stays).",
    )
    for result in ("changed", "unchanged", "invalid"):
        total.add((("result", result),), getattr(reloads, result))
    return [
        _single("gpuagent_config_generation", "gauge",
                "Reloads that changed the running configuration since the agent started.", (),
                generation),
        _single("gpuagent_config_last_reload_successful", "gauge",
                "Whether the last configuration reload was applied (1; also before any) or "
                "refused as invalid (0).", (), 1 if reloads.last_successful else 0),
        total,
    ]  # fmt: skip


def _dra_families(dra: DraCounters | None) -> list[Family]:
    if dra is None:
        return []
    return [
        _single("gpuagent_dra_api_up", "gauge",
                "Whether the last ResourceSlice publication reached the API server (1) or not (0).",
                (), 1 if dra.api_up else 0),
        _single("gpuagent_dra_api_errors_total", "counter",
                "ResourceSlice publications that failed (API server unreachable or refusing).",
                (), dra.api_errors),
        _single("gpuagent_dra_slice_writes_total", "counter",
                "ResourceSlices created or replaced.", (), dra.slice_writes),
        _single("gpuagent_dra_slice_generation", "gauge",
                "Generation of the node's ResourceSlice pool as last published.", (),
                dra.slice_generation),
        _single("gpuagent_dra_devices", "gauge",
                "Devices this node serves through DRA.", (), dra.devices),
        _single("gpuagent_dra_unpublished_gpus", "gauge",
                "GPUs given to DRA whose devices are in no published ResourceSlice, so offered "
                "through neither API.", (), dra.unpublished_gpus),
        _single("gpuagent_dra_registered", "gauge",
                "Whether the kubelet accepted the DRA plugin (1) or not (0).", (),
                1 if dra.registered else 0),
        _single("gpuagent_dra_prepared_claims", "gauge",
                "ResourceClaims prepared on this node (checkpointed).", (), dra.prepared_claims),
        _single("gpuagent_dra_prepares_total", "counter",
                "Claims prepared by NodePrepareResources.", (), dra.prepares),
        _single("gpuagent_dra_prepare_errors_total", "counter",
                "Claims NodePrepareResources could not prepare.", (), dra.prepare_errors),
        _single("gpuagent_dra_unprepares_total", "counter",
                "Claims unprepared by NodeUnprepareResources.", (), dra.unprepares),
    ]  # fmt: skip


def _nvml_families(calls: tuple[NvmlCallStats, ...]) -> list[Family]:
    if not calls:
        return []
    seconds = Family(
        "gpuagent_nvml_call_duration_seconds",
        "summary",
        "Time spent in NVML calls, per kind of call.",
    )
    errors = Family(
        "gpuagent_nvml_call_errors_total", "counter", "NVML calls that failed, per kind of call."
    )
    for stats in sorted(calls, key=lambda s: s.call):
        block = "{" + label_pairs((("call", stats.call),)) + "}"
        seconds.samples.append(f"{seconds.name}_sum{block} {format_value(stats.seconds)}\n")
        seconds.samples.append(f"{seconds.name}_count{block} {stats.count}\n")
        errors.add(block, stats.errors)
    return [seconds, errors]


def _xid_order(label: str) -> tuple[int, int]:
    """Catalog XIDs by number, then ``other``."""
    return (0, int(label)) if label.isdigit() else (1, 0)


def _identity(gpu: Gpu) -> object:
    """What a GPU's series labels depend on (not its readings or health)."""
    return (
        gpu.index,
        gpu.uuid,
        gpu.minor,
        gpu.name,
        gpu.pci_bus_id,
        gpu.numa_node,
        gpu.mig_enabled,
        tuple(
            (m.uuid, m.gpu_instance_id, m.compute_instance_id, m.profile) for m in gpu.mig_devices
        ),
    )


def _gpu_instances(gpu: Gpu) -> list[tuple[int, MigDevice]]:
    """One MIG device per GPU instance (dcgm-exporter reports GPU instances, not CIs)."""
    seen: dict[int, tuple[int, MigDevice]] = {}
    for position, mig in enumerate(gpu.mig_devices):
        seen.setdefault(mig.gpu_instance_id, (position, mig))
    return [seen[gi] for gi in sorted(seen)]


_EMPTY_POD = ',container="",namespace="",pod=""'


def _blocks(labels: str, refs: tuple[PodRef, ...]) -> tuple[bytes, ...]:
    if not refs:
        return ((labels + _EMPTY_POD).encode(),)
    return tuple(
        (
            f'{labels},container="{escape_label(r.container)}"'
            f',namespace="{escape_label(r.namespace)}",pod="{escape_label(r.pod)}"'
        ).encode()
        for r in refs
    )
