"""What /metrics says: dcgm-exporter's names for GPU telemetry, ``gpuagent_`` for our own.

The exposition has two parts:

* the **device part** — every dcgm-exporter series and the per-GPU ``gpuagent_`` families — depends
  only on the snapshot, so it is rendered once per snapshot version and cached (also as a gzip
  stream prefix, see :class:`DevicePart`);
* the **agent part** — counters, pod-resources freshness, scrape durations — is small and rendered
  on every scrape.

Nothing here calls NVML or the kubelet: a scrape reads the store's snapshot and in-memory counters.
"""

from __future__ import annotations

import bisect
import os
import platform
import struct
import time
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from gpuagent.domain import xids
from gpuagent.domain.attribution import Target, attributions
from gpuagent.domain.devices import Gpu, MigDevice, PodRef, Snapshot, Telemetry
from gpuagent.web.exposition import Family, escape_label, format_value, header, label_pairs, render

__all__ = [
    "DCGM_METRICS",
    "SCRAPE_BUCKETS",
    "AgentCounters",
    "DcgmMetric",
    "DevicePart",
    "Histogram",
    "MetricsRenderer",
    "NvmlCallStats",
    "PodResourcesStats",
    "xid_message",
]

T = TypeVar("T")

GPU_SCOPE = "gpu"  # a reading of the whole GPU: a MIG series repeats its parent's value
INSTANCE_SCOPE = "instance"  # a reading of the GPU instance: a MIG series shows its own value


@dataclass(frozen=True, slots=True)
class DcgmMetric:
    """A dcgm-exporter family: name, type and HELP as dcgm-exporter writes them; its reading."""

    name: str
    kind: str
    help: str
    read: Callable[[Telemetry], float | None]
    scope: str = GPU_SCOPE


# dcgm-exporter's default counters (etc/default-counters.csv) that Telemetry carries, in that
# file's order, then off-by-default ones we have values for (ECC, SM activity, remap pending).
DCGM_METRICS: tuple[DcgmMetric, ...] = (
    DcgmMetric("DCGM_FI_DEV_SM_CLOCK", "gauge", "SM clock frequency (in MHz).",
               lambda t: t.sm_clock_mhz),
    DcgmMetric("DCGM_FI_DEV_MEM_CLOCK", "gauge", "Memory clock frequency (in MHz).",
               lambda t: t.mem_clock_mhz),
    DcgmMetric("DCGM_FI_DEV_MEMORY_TEMP", "gauge", "Memory temperature (in C).",
               lambda t: t.memory_temperature_c),
    DcgmMetric("DCGM_FI_DEV_GPU_TEMP", "gauge", "GPU temperature (in C).",
               lambda t: t.temperature_c),
    DcgmMetric("DCGM_FI_DEV_POWER_USAGE", "gauge", "Power draw (in W).", lambda t: t.power_w),
    DcgmMetric("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "counter",
               "Total energy consumption since boot (in mJ).", lambda t: t.energy_mj),
    DcgmMetric("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "counter", "Total number of PCIe retries.",
               lambda t: t.pcie_replays),
    DcgmMetric("DCGM_FI_DEV_GPU_UTIL", "gauge", "GPU utilization (in %).",
               lambda t: t.gpu_util_pct, INSTANCE_SCOPE),
    DcgmMetric("DCGM_FI_DEV_MEM_COPY_UTIL", "gauge", "Memory utilization (in %).",
               lambda t: t.mem_util_pct, INSTANCE_SCOPE),
    DcgmMetric("DCGM_FI_DEV_ENC_UTIL", "gauge", "Encoder utilization (in %).",
               lambda t: t.enc_util_pct),
    DcgmMetric("DCGM_FI_DEV_DEC_UTIL", "gauge", "Decoder utilization (in %).",
               lambda t: t.dec_util_pct),
    # DCGM_FI_DEV_XID_ERRORS comes here in dcgm-exporter's order; rendered on its own below.
    DcgmMetric("DCGM_FI_DEV_FB_FREE", "gauge", "Framebuffer memory free (in MiB).",
               lambda t: t.fb_free_mib, INSTANCE_SCOPE),
    DcgmMetric("DCGM_FI_DEV_FB_USED", "gauge", "Framebuffer memory used (in MiB).",
               lambda t: t.fb_used_mib, INSTANCE_SCOPE),
    DcgmMetric("DCGM_FI_DEV_FB_RESERVED", "gauge", "Framebuffer memory reserved (in MiB).",
               lambda t: t.fb_reserved_mib, INSTANCE_SCOPE),
    DcgmMetric("DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", "counter",
               "Total number of NVLink bandwidth counters for all lanes.",
               lambda t: t.nvlink_bandwidth_total),
    DcgmMetric("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", "counter",
               "Number of remapped rows for uncorrectable errors",
               lambda t: t.remapped_rows_uncorrectable),
    DcgmMetric("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "counter",
               "Number of remapped rows for correctable errors",
               lambda t: t.remapped_rows_correctable),
    DcgmMetric("DCGM_FI_DEV_ROW_REMAP_FAILURE", "gauge", "Whether remapping of rows has failed",
               lambda t: t.row_remap_failure),
    DcgmMetric("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "gauge",
               "Ratio of time the graphics engine is active.",
               lambda t: t.gr_engine_active, INSTANCE_SCOPE),
    DcgmMetric("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "gauge",
               "Ratio of cycles the tensor (HMMA) pipe is active.",
               lambda t: t.tensor_active, INSTANCE_SCOPE),
    DcgmMetric("DCGM_FI_PROF_DRAM_ACTIVE", "gauge",
               "Ratio of cycles the device memory interface is active sending or receiving data.",
               lambda t: t.dram_active, INSTANCE_SCOPE),
    DcgmMetric("DCGM_FI_PROF_PCIE_TX_BYTES", "gauge",
               "The rate of data transmitted over the PCIe bus - including both protocol headers "
               "and data payloads - in bytes per second.", lambda t: t.pcie_tx_bytes),
    DcgmMetric("DCGM_FI_PROF_PCIE_RX_BYTES", "gauge",
               "The rate of data received over the PCIe bus - including both protocol headers "
               "and data payloads - in bytes per second.", lambda t: t.pcie_rx_bytes),
    # Off by default in dcgm-exporter; exported here whenever the driver offers them.
    DcgmMetric("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "counter",
               "Total number of single-bit volatile ECC errors.", lambda t: t.ecc_sbe_volatile),
    DcgmMetric("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "counter",
               "Total number of double-bit volatile ECC errors.", lambda t: t.ecc_dbe_volatile),
    DcgmMetric("DCGM_FI_DEV_ROW_REMAP_PENDING", "gauge", "Whether remapping of rows is pending",
               lambda t: t.row_remap_pending),
    DcgmMetric("DCGM_FI_PROF_SM_ACTIVE", "gauge",
               "The ratio of cycles an SM has at least 1 warp assigned.",
               lambda t: t.sm_active, INSTANCE_SCOPE),
    DcgmMetric("DCGM_FI_PROF_SM_OCCUPANCY", "gauge",
               "The ratio of number of warps resident on an SM.",
               lambda t: t.sm_occupancy, INSTANCE_SCOPE),
)  # fmt: skip

XID_ERRORS = "DCGM_FI_DEV_XID_ERRORS"
XID_ERRORS_HELP = "Value of the last XID error encountered."


def xid_message(xid: int) -> str:
    """``err_msg`` for an XID, from NVIDIA's XID catalog (the health policy's table)."""
    if xid == 0:
        return "No Error"
    entry = xids.lookup(xid)
    return "Unknown Error" if entry.text == xids.UNKNOWN_TEXT else entry.text


# Scrape durations: from a cached 8-GPU scrape (~0.1 ms) to a slow, first render of a huge node.
SCRAPE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class Histogram:
    """A cumulative histogram of observations, cheap enough to feed on every scrape."""

    __slots__ = ("_counts", "bounds", "count", "total")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self._counts = [0] * len(self.bounds)
        self.count = 0
        self.total = 0.0

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(self.bounds, value)
        if i < len(self._counts):
            self._counts[i] += 1
        self.count += 1
        self.total += value

    def cumulative(self) -> list[tuple[float, int]]:
        out, running = [], 0
        for bound, n in zip(self.bounds, self._counts, strict=True):
            running += n
            out.append((bound, running))
        return out


@dataclass(frozen=True, slots=True)
class PodResourcesStats:
    """The pod-resources client's own counters (the mapping itself is in the snapshot)."""

    requests: int = 0
    errors: int = 0
    socket_present: bool = False


@dataclass(frozen=True, slots=True)
class NvmlCallStats:
    """Calls into NVML of one kind: how many, how long in total, how many failed."""

    call: str
    count: int
    seconds: float
    errors: int


@dataclass(frozen=True, slots=True)
class AgentCounters:
    """The agent's own counters that live outside the device snapshot."""

    registrations: int = 0
    allocations: int = 0
    pod_resources: PodResourcesStats | None = None
    nvml: tuple[NvmlCallStats, ...] = ()


# Device parts are gzip-compressed in segments of about this size, each by its own raw-deflate
# compressor ending on a sync flush, so segments can be compressed in parallel threads (zlib
# releases the GIL) while the event loop is still rendering the next families; the segments,
# a gzip header and trailer (CRC-32 and size of the whole) make one valid gzip stream.
GZIP_SEGMENT_BYTES = 1024 * 1024
# Below this size, compressing inline is cheaper than a hand-off to the threads.
INLINE_GZIP_BYTES = 256 * 1024
_GZIP_HEADER = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff"  # deflate, no name, no mtime
_compressors: ThreadPoolExecutor | None = None


def _compress_pool() -> ThreadPoolExecutor:
    global _compressors  # noqa: PLW0603 - one lazily started pool per process
    if _compressors is None:
        workers = max(1, min(4, os.cpu_count() or 1))
        _compressors = ThreadPoolExecutor(workers, thread_name_prefix="gpuagent-gzip")
    return _compressors


def _deflate_segment(data: bytes) -> bytes:
    compressor = zlib.compressobj(1, zlib.DEFLATED, -15)
    return compressor.compress(data) + compressor.flush(zlib.Z_SYNC_FLUSH)


def _crc(chunks: list[bytes]) -> int:
    crc = 0
    for chunk in chunks:
        crc = zlib.crc32(chunk, crc)
    return crc


class DevicePart:
    """The device part of one snapshot version, as byte chunks, and (once asked) its gzip stream.

    The (large) device part is compressed once per version; each scrape then compresses only its
    (small) agent part and appends it, with the trailer, to the cached segments.
    """

    __slots__ = ("_crc", "_pending", "_segments", "_started", "chunks", "size", "version")

    def __init__(self, version: int) -> None:
        self.version = version
        self.chunks: list[bytes] = []
        self.size = 0
        self._started = False
        self._pending: list[bytes] = []  # appended since the last segment was cut
        self._segments: list[Future[bytes]] = []
        self._crc: Future[int] | None = None

    @property
    def text(self) -> bytes:
        return b"".join(self.chunks)

    def append(self, chunk: bytes) -> None:
        self.chunks.append(chunk)
        self.size += len(chunk)
        if self._started:
            self._pending.append(chunk)
            if sum(map(len, self._pending)) >= GZIP_SEGMENT_BYTES:
                self._cut(threaded=True)

    def start_gzip(self, *, threaded: bool) -> None:
        """Start compressing what is there; chunks appended later are compressed as they come.

        ``threaded``: in the compressor threads (see :meth:`finish_gzip`); else inline, now.
        """
        if self._started:
            return
        self._started = True
        if not threaded:
            self._segments = [_done(_deflate_segment(self.text))]
            self._crc = _done(zlib.crc32(self.text))
            return
        for chunk in self.chunks:
            self._pending.append(chunk)
            if sum(map(len, self._pending)) >= GZIP_SEGMENT_BYTES:
                self._cut(threaded=True)

    def finish_gzip(self) -> Future[int]:
        """Compress the rest (in the threads); the returned future is done when all segments are."""
        self.start_gzip(threaded=True)
        if self._crc is None:
            self._cut(threaded=True)
            segments, chunks = list(self._segments), list(self.chunks)

            def crc_after_segments() -> int:
                for segment in segments:
                    segment.result()
                return _crc(chunks)

            self._crc = _compress_pool().submit(crc_after_segments)
        return self._crc

    def _cut(self, *, threaded: bool) -> None:
        if not self._pending:
            return
        data = b"".join(self._pending)
        self._pending = []
        if threaded:
            self._segments.append(_compress_pool().submit(_deflate_segment, data))
        else:
            self._segments.append(_done(_deflate_segment(data)))

    @property
    def gzip_ready(self) -> bool:
        return self._crc is not None and self._crc.done()

    def gzip(self, tail: bytes) -> list[bytes]:
        """Chunks that together are the gzip stream of the device part followed by ``tail``."""
        if self._crc is None:
            self.start_gzip(threaded=False)
            self._cut(threaded=False)
            if self._crc is None:
                self._crc = _done(_crc(self.chunks))
        crc = self._crc.result()  # immediate once gzip_ready
        compressor = zlib.compressobj(1, zlib.DEFLATED, -15)
        end = compressor.compress(tail) + compressor.flush()
        trailer = struct.pack("<II", zlib.crc32(tail, crc), (self.size + len(tail)) & 0xFFFFFFFF)
        return [_GZIP_HEADER, *(s.result() for s in self._segments), end + trailer]


def _done(value: T) -> Future[T]:
    future: Future[T] = Future()
    future.set_result(value)
    return future


@dataclass(frozen=True, slots=True)
class _Series:
    """One series' device and label blocks (one per container holding it, or one unattributed).

    ``gpu`` and ``mig`` are positions in ``snapshot.gpus`` and that GPU's ``mig_devices``.
    """

    target: Target
    gpu: int
    mig: int | None
    blocks: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class _Layout:
    """What stays put while only readings change: series, label blocks and identity families."""

    gpus: tuple[object, ...]
    driver: str
    by_device: Mapping[str, tuple[PodRef, ...]]
    series: tuple[_Series, ...]
    static: bytes


class MetricsRenderer:
    """Renders snapshots for /metrics; the device part is cached per snapshot version.

    ``hostname_label`` is ``Hostname`` (dcgm-exporter before May 2026), ``hostname`` (after), or
    ``None`` to leave the label out (dcgm-exporter's ``--no-hostname``).
    """

    def __init__(
        self,
        hostname: str,
        version: str,
        *,
        hostname_label: str | None = "Hostname",
        monotonic: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.hostname = hostname
        self.version = version
        self.hostname_label = hostname_label
        self.monotonic = monotonic
        self.wall = wall
        self.scrapes = Histogram(SCRAPE_BUCKETS)
        self.device_renders = 0
        self.layouts = 0
        self._cached: DevicePart | None = None
        self._layout: _Layout | None = None

    def devices(self, snapshot: Snapshot, *, compress: bool = False) -> DevicePart:
        """The device part for ``snapshot``, rendered only when its version is new.

        ``compress``: a gzip scrape is waiting; a large part is compressed in the compressor
        thread while it is being rendered (see :meth:`DevicePart.start_gzip`).
        """
        cached = self._cached
        if cached is not None and cached.version == snapshot.version:
            return cached
        part = DevicePart(snapshot.version)
        chunks = self._render_device_chunks(snapshot)
        # Compress while rendering when the last version was large enough to be worth threads.
        if compress and cached is not None and cached.size >= INLINE_GZIP_BYTES:
            part.start_gzip(threaded=True)
        for chunk in chunks:
            part.append(chunk)
        self._cached = part
        self.device_renders += 1
        return part

    def agent(self, snapshot: Snapshot, counters: AgentCounters) -> bytes:
        """The agent part, rendered fresh on each scrape."""
        return self._render_agent(snapshot, counters).encode()

    def render(self, snapshot: Snapshot, counters: AgentCounters) -> str:
        """The whole exposition as text (the HTTP handler writes the two parts separately)."""
        return (self.devices(snapshot).text + self.agent(snapshot, counters)).decode()

    # ----- device part -------------------------------------------------------------------------
    def _layout_for(self, snapshot: Snapshot) -> _Layout:
        gpus = tuple(_identity(gpu) for gpu in snapshot.gpus)
        driver = snapshot.driver.version
        by_device = snapshot.pods.by_device
        cached = self._layout
        if (
            cached is not None
            and cached.gpus == gpus
            and cached.driver == driver
            and (cached.by_device is by_device or cached.by_device == by_device)
        ):
            return cached
        pods = attributions(snapshot)
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
                    ("device", f"nvidia{gpu.minor}"),
                    ("modelName", gpu.name),
                )
            )
            instances = _gpu_instances(gpu) if gpu.mig_enabled else []
            if not instances:
                target = Target(gpu.index)
                blocks = _blocks(base + tail, pods.get(target, ()))
                series.append(_Series(target, position, None, blocks))
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
            by_device=by_device,
            series=tuple(series),
            static=self._render_identity_families(snapshot, pods).encode(),
        )
        self._layout = layout
        self.layouts += 1
        return layout

    def _render_device_chunks(self, snapshot: Snapshot) -> Iterator[bytes]:
        """The device part, one family per chunk."""
        layout = self._layout_for(snapshot)
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
        for metric in DCGM_METRICS:
            name, read, own = metric.name.encode(), metric.read, metric.scope == INSTANCE_SCOPE
            parts: list[bytes] = []
            for whole, instance, blocks in readings:
                value = read(instance if own else whole)
                if value is None:
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
            own = (("gpu", str(gpu.index)), ("uuid", gpu.uuid))
            healthy.add(own, 1 if gpu.health.healthy else 0)
            for c in gpu.health.conditions:
                condition.add((*own, ("condition", c.kind), ("detail", c.detail)), 1)
            for xid, count in sorted(gpu.xid_counts.items()):
                xids.add((*own, ("xid", str(xid))), count)
        return render([healthy, condition, xids])

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
                    ("device", f"nvidia{gpu.minor}"),
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
    def _render_agent(self, snapshot: Snapshot, counters: AgentCounters) -> str:
        families = [
            _single("gpuagent_build_info", "gauge",
                    "gpuagent's version, the Python it runs on and the NVIDIA driver (value 1).",
                    (("version", self.version), ("python_version", platform.python_version()),
                     ("driver_version", snapshot.driver.version)), 1),
            _single("gpuagent_driver_up", "gauge",
                    "Whether the NVIDIA driver answers (1) or not (0).", (),
                    1 if snapshot.driver.up else 0),
            _single("gpuagent_gpus", "gauge", "GPUs discovered on this node.", (),
                    len(snapshot.gpus)),
            _single("gpuagent_kubelet_registered", "gauge",
                    "Whether the device plugin is registered with the kubelet (1) or not (0).",
                    (), 1 if snapshot.registered else 0),
            _single("gpuagent_kubelet_registrations_total", "counter",
                    "Successful registrations with the kubelet.", (), counters.registrations),
            _single("gpuagent_allocations_total", "counter",
                    "Allocate calls answered successfully.", (), counters.allocations),
        ]  # fmt: skip
        families.extend(self._pod_resources_families(snapshot, counters.pod_resources))
        families.extend(_nvml_families(counters.nvml))
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
        self, snapshot: Snapshot, stats: PodResourcesStats | None
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
                    len(pods.by_device)),
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
