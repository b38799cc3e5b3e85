"""What /metrics says: dcgm-exporter's names for GPU telemetry, ``gpuagent_`` for our own.

The exposition has two parts:

* the **device part** — every dcgm-exporter series and the per-GPU ``gpuagent_`` families — depends
  only on the snapshot, so it is rendered once per snapshot version and cached, with its gzip
  stream once a gzip scrape has asked for it (:mod:`gpuagent.web.devicepart`), from label blocks
  kept while only readings change (:mod:`gpuagent.web.layout`). A scrape renders it a family at a
  time (:meth:`MetricsRenderer.devices_async`), handing the event loop back every
  :data:`SLICE_S` seconds, so a new version's render never holds the loop long; concurrent
  scrapes of one version share one render;
* the **agent part** — counters, pod-resources freshness, scrape durations — is small and rendered
  on every scrape.

Nothing here calls NVML or the kubelet: a scrape reads the store's snapshot and in-memory counters.
The families themselves are :mod:`gpuagent.web.dcgm` (dcgm-exporter's, rendered here), and ours:
:mod:`gpuagent.web.gpufamilies` (per GPU), :mod:`gpuagent.web.agentfamilies` (the agent's own) and
:mod:`gpuagent.web.usage` (per container).
"""

from __future__ import annotations

import asyncio
import platform
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence

from gpuagent.domain.devices import PodRef, Telemetry
from gpuagent.domain.plan import Plan
from gpuagent.domain.snapshot import Snapshot
from gpuagent.domain.usage import ContainerUsage
from gpuagent.state.counters import AgentCounters
from gpuagent.web.agentfamilies import (
    config_families,
    dra_families,
    dra_state_families,
    kube_families,
    nvml_families,
    pod_resources_families,
)
from gpuagent.web.dcgm import (
    DCGM_FAMILIES,
    INSTANCE_SCOPE,
    LAST_XID,
    DcgmMetric,
    LastXid,
    xid_message,
)
from gpuagent.web.devicepart import DevicePart, hand_back
from gpuagent.web.exposition import Family, escape_label, format_value, header, render, single
from gpuagent.web.gpufamilies import health_families
from gpuagent.web.histogram import SCRAPE_BUCKETS, Histogram
from gpuagent.web.layout import Layout, build_layout, identity, layout_steps
from gpuagent.web.mpsfamilies import mps_families
from gpuagent.web.usage import SHARED_DCGM, accounting_families, render_usage

__all__ = ["SLICE_S", "MetricsRenderer"]

DEFAULT_SERVED = Plan().served_resources
#: The longest a render or compression holds the event loop before handing it back (seconds).
SLICE_S = 0.001


class MetricsRenderer:
    """Renders snapshots for /metrics; the device part is cached per snapshot version.

    ``hostname_label`` is ``Hostname`` (dcgm-exporter before May 2026), ``hostname`` (after), or
    ``None`` to leave the label out (dcgm-exporter's ``--no-hostname``). ``series_per_container``:
    a device's dcgm-exporter series are copied once per container holding it
    (``--dcgm-series-per-container``; by default a device has one series, see
    :mod:`gpuagent.web.layout`). ``container_shares``: those copies carry each container's own
    reading where NVML has it per process (``--dcgm-container-shares``, which implies the copies;
    see :mod:`gpuagent.web.usage`). ``accounting``: whether per-container accounting runs
    (``--container-accounting``), as ``gpuagent_container_accounting_enabled`` says.
    ``detailed``: the agent's own families in full (``--detailed-agent-metrics``, see
    :mod:`gpuagent.web.agentfamilies`), and the dcgm-exporter families marked ``detailed``.
    """

    def __init__(
        self,
        hostname: str,
        version: str,
        *,
        hostname_label: str | None = "Hostname",
        monotonic: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        series_per_container: bool = False,
        container_shares: bool = False,
        kubernetes: bool = True,
        accounting: bool = True,
        detailed: bool = False,
    ) -> None:
        self.hostname = hostname
        self.accounting = accounting
        # Off Kubernetes (--kubernetes=false) there is no kubelet: no registration families.
        self.kubernetes = kubernetes
        self.container_shares = container_shares
        self.series_per_container = series_per_container or container_shares
        self.detailed = detailed
        self.dcgm_families = tuple(f for f in DCGM_FAMILIES if detailed or not f.detailed)
        self.version = version
        self.hostname_label = hostname_label
        self.monotonic = monotonic
        self.wall = wall
        self.scrapes = Histogram(SCRAPE_BUCKETS)
        self.device_renders = 0
        self.layouts = 0
        self._cached: DevicePart | None = None
        self._layout: Layout | None = None
        self._rendering: dict[int, asyncio.Task[DevicePart]] = {}

    def devices(self, snapshot: Snapshot, served: Collection[str] = DEFAULT_SERVED) -> DevicePart:
        """The device part for ``snapshot``, rendered only when its version is new (at once:
        :meth:`devices_async` is what a scrape on the event loop uses).

        ``served`` are the resource names of the plan ``snapshot`` was taken under (its pods are
        attributed by them): a new plan is a new snapshot version.
        """
        cached = self._cached
        if cached is not None and cached.version == snapshot.version:
            return cached
        chunks = self._render_device_chunks(snapshot, served)
        return self._keep(DevicePart(snapshot.version, chunks))

    async def devices_async(
        self, snapshot: Snapshot, served: Collection[str] = DEFAULT_SERVED
    ) -> DevicePart:
        """:meth:`devices`, rendered a family at a time with the event loop handed back every
        :data:`SLICE_S`; scrapes of a version being rendered wait for that one render."""
        cached = self._cached
        if cached is not None and cached.version == snapshot.version:
            return cached
        task = self._rendering.get(snapshot.version)
        if task is None:
            task = asyncio.create_task(self._render_async(snapshot, served), name="metrics-render")
            self._rendering[snapshot.version] = task
            task.add_done_callback(lambda _: self._rendering.pop(snapshot.version, None))
        # Shielded: a scrape that goes away does not cancel the render the others wait for.
        return await asyncio.shield(task)

    async def _render_async(self, snapshot: Snapshot, served: Collection[str]) -> DevicePart:
        if self._cached_layout(snapshot, served) is None:
            # A new layout (the pods, the GPUs or the plan changed), ~6 ms at 50 containers a
            # GPU, is built in steps with the loop handed back between them (on a worker thread
            # it kept the GIL from the loop for up to the 5 ms switch interval).
            steps = layout_steps(
                snapshot, served, _identities(snapshot), self._host,
                per_container=self.series_per_container,
            )  # fmt: skip
            while True:
                try:
                    next(steps)
                except StopIteration as done:
                    self._set_layout(done.value)
                    break
                await hand_back()
        chunks = []
        began = time.perf_counter()
        for chunk in self._render_device_chunks(snapshot, served):
            chunks.append(chunk)
            if time.perf_counter() - began >= SLICE_S:
                await hand_back()
                began = time.perf_counter()
        return self._keep(DevicePart(snapshot.version, chunks))

    def _keep(self, part: DevicePart) -> DevicePart:
        """Cache ``part`` unless a newer version's is cached already (renders may overlap)."""
        cached = self._cached
        if cached is None or cached.version <= part.version:
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
    @property
    def _host(self) -> str:
        """The host label, with its leading comma (empty without one)."""
        if self.hostname_label is None:
            return ""
        return f',{self.hostname_label}="{escape_label(self.hostname)}"'

    def _cached_layout(self, snapshot: Snapshot, served: Collection[str]) -> Layout | None:
        """The layout of ``snapshot`` if the one kept still is (only readings changed)."""
        gpus = _identities(snapshot)
        allocated = snapshot.pods.allocated
        cached = self._layout
        if (
            cached is not None
            and cached.gpus == gpus
            and cached.driver == snapshot.driver.version
            and (cached.allocated is allocated or cached.allocated == allocated)
            and cached.served == served
            and cached.dra == snapshot.plan.dra
        ):
            return cached
        return None

    def _layout_for(self, snapshot: Snapshot, served: Collection[str]) -> Layout:
        cached = self._cached_layout(snapshot, served)
        if cached is not None:
            return cached
        layout = build_layout(
            snapshot,
            served,
            _identities(snapshot),
            self._host,
            per_container=self.series_per_container,
        )
        self._set_layout(layout)
        return layout

    def _set_layout(self, layout: Layout) -> None:
        self._layout = layout
        self.layouts += 1

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
        for dcgm in self.dcgm_families:
            if isinstance(dcgm, LastXid):
                chunk = self._render_xid_last(snapshot, layout)
            else:
                chunk = self._render_dcgm(dcgm, readings, shares)
            if chunk:
                yield chunk
        yield health_families(snapshot).encode()
        yield layout.static
        for family in render_usage(snapshot):
            yield family.encode()
        # Of the snapshot alone: the MPS daemons, the DRA claims' shares, the DRA side's state.
        state = render(
            [*mps_families(snapshot, detailed=self.detailed), *dra_state_families(snapshot)]
        )
        if state:
            yield state.encode()

    @staticmethod
    def _render_dcgm(
        metric: DcgmMetric,
        readings: Sequence[tuple[Telemetry, Telemetry, tuple[bytes, ...]]],
        shares: Mapping[int, list[ContainerUsage | None]],
    ) -> bytes:
        """``metric``'s family: a sample per label block of each series that has a reading
        (``readings``: each series' GPU telemetry, its own, its label blocks); with ``shares``,
        each container's own reading where NVML has one per process."""
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
                    parts.append(b"%s{%s} %s\n" % (name, block, format_value(own_value).encode()))
                continue
            # One sample per label block, all with the same value: one C-level join.
            end = b"} " + format_value(value).encode() + b"\n"
            parts.append(name + b"{" + (end + name + b"{").join(blocks) + end)
        if not parts:
            return b""
        return header(metric.name, metric.kind, metric.help).encode() + b"".join(parts)

    @staticmethod
    def _shares(snapshot: Snapshot, layout: Layout) -> dict[int, list[ContainerUsage | None]]:
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
    def _render_xid_last(snapshot: Snapshot, layout: Layout) -> bytes:
        name = LAST_XID.name.encode()
        parts: list[bytes] = []
        for s in layout.series:
            xid = snapshot.gpus[s.gpu].last_xid or 0
            end = (
                f',err_code="{xid}",err_msg="{escape_label(xid_message(xid))}"}} {xid}\n'
            ).encode()
            parts.append(name + b"{" + (end + name + b"{").join(s.blocks) + end)
        if not parts:
            return b""
        return header(LAST_XID.name, LAST_XID.kind, LAST_XID.help).encode() + b"".join(parts)

    # ----- agent part --------------------------------------------------------------------------
    def _render_agent(
        self, snapshot: Snapshot, counters: AgentCounters, served: Collection[str]
    ) -> str:
        families = [
            single("gpuagent_build_info", "gauge",
                   "gpuagent's version, the Python it runs on, the NVIDIA driver and the node "
                   "(value 1).",
                   (("version", self.version), ("python_version", platform.python_version()),
                    ("driver_version", snapshot.driver.version), ("node", self.hostname)), 1),
            single("gpuagent_driver_up", "gauge",
                   "Whether the NVIDIA driver answers (1) or not (0).", (),
                   1 if snapshot.driver.up else 0),
            single("gpuagent_gpus", "gauge", "GPUs discovered on this node.", (),
                   len(snapshot.gpus)),
        ]  # fmt: skip
        detailed = self.detailed
        if self.kubernetes:
            families.append(
                single("gpuagent_kubelet_registered", "gauge",
                       "Whether the device plugin is registered with the kubelet (1) or not (0).",
                       (), 1 if snapshot.registered else 0)
            )  # fmt: skip
        if self.kubernetes and detailed:
            families += [
                single("gpuagent_kubelet_registrations_total", "counter",
                       "Successful registrations with the kubelet.", (), counters.registrations),
                single("gpuagent_allocations_total", "counter",
                       "Allocate calls answered successfully.", (), counters.allocations),
            ]  # fmt: skip
        families.extend(
            config_families(snapshot.plan.generation, counters.reloads, detailed=detailed)
        )
        devices = self._layout_for(snapshot, served).device_ids
        families.extend(
            pod_resources_families(
                snapshot, counters.pod_resources, devices, self.monotonic, self.wall,
                detailed=detailed,
            )
        )  # fmt: skip
        families.extend(nvml_families(counters.nvml, detailed=detailed))
        api = counters.api
        families.extend(dra_families(counters.dra, api.get("resource_slices"), detailed=detailed))
        families.extend(kube_families(counters.kube, api.get("node_health"), detailed=detailed))
        families.extend(
            accounting_families(
                self.accounting, counters.log_links, counters.cri, detailed=detailed
            )
        )
        scrape = Family(
            "gpuagent_scrape_duration_seconds",
            "histogram",
            "Time to answer a /metrics request, from the request to the last byte handed to the "
            "socket (earlier scrapes; this one is not included).",
        )
        scrape.add_histogram((), self.scrapes.cumulative(), self.scrapes.total, self.scrapes.count)
        families.append(scrape)
        return render(families)


def _identities(snapshot: Snapshot) -> tuple[object, ...]:
    """What the GPUs' series labels depend on (see :func:`identity`)."""
    return tuple(identity(gpu) for gpu in snapshot.gpus)
