"""GPU-to-GPU topology from the driver: PCIe common ancestor and NVLink link counts per pair.

Read once at discovery (the agent keeps the result in the store); never per RPC, unlike NVIDIA's
plugin, which queries NVML on every preferred-allocation call (k8s-device-plugin #774) and fails
every call once one GPU is lost (#2038). :func:`read_topology` never raises: what cannot be read
leaves that pair's ``p2p`` at ``None`` and its ``nvlinks`` at 0, logged once per read.

NVLink counting walks every link of every GPU and sorts the far ends by kind. The walk reads the
link count and every link's state in ONE ``nvmlDeviceGetFieldValues`` call
(``NVML_FI_DEV_NVLINK_LINK_COUNT``, ``NVML_FI_DEV_NVLINK_GET_STATE`` per link; per-link
``nvmlDeviceGetNvLinkState`` only on a driver without those fields), then for each active link
``nvmlDeviceGetNvLinkRemotePciInfo_v2``, and ``nvmlDeviceGetNvLinkRemoteDeviceType`` only when the
far end is not one of the GPUs (to tell an NVSwitch from anything else). On an 8-GPU board with 18
links each that is about 150 calls instead of 450:

* a GPU: the link joins the two GPUs directly (matched by PCI bus ID among the given GPUs);
* an NVSwitch: the link is the GPU's port into the switch fabric. Two GPUs on the same switch talk
  over as many links as the smaller of their link counts into it, so a pair's count through the
  fabric is the sum over shared switches of that minimum — 18 for any two GPUs of an HGX H100
  board (18 links each over four switches), 12 on HGX A100; what ``nvidia-smi topo -m`` shows as
  ``NV18``/``NV12``. Switch links are never taken for a direct pair;
* anything else (an IBM NPU, an unknown device, a GPU the agent does not manage) is ignored.

A pair's ``nvlinks`` is its direct links plus its links through switches, counted from both GPUs'
walks and taking the smaller count, so the result is symmetric even if the driver is not. When the
remote device type is not offered, a link whose far end is one of the GPUs counts as direct and
any other far end is ignored (a switch cannot be told from a foreign device without it).

The read splits into per-GPU work (:meth:`TopologyReader.walk`, :meth:`TopologyReader.ancestors`)
that start-up runs on each GPU's own worker at once, and :meth:`TopologyReader.assemble`;
:func:`read_topology` does all of it in turn. NVML errors never leave this module.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

import pynvml
import structlog

from gpuagent.domain.devices import Link, P2PLevel, Topology
from gpuagent.gpu.calls import ABSENT, NO_GPU, NvmlCalls, describe

log = structlog.get_logger("gpuagent.topology")

#: Link numbers past the GPU's last link (the driver's answer varies by version).
_NO_SUCH_LINK = (pynvml.NVML_ERROR_INVALID_ARGUMENT, pynvml.NVML_ERROR_NOT_SUPPORTED)
MAX_LINKS = int(pynvml.NVML_NVLINK_MAX_LINKS)

BusKey = tuple[int, int, int, int]


def read_topology(
    handles: Mapping[int, Any],
    calls: NvmlCalls | None = None,
    buses: Mapping[int, str] | None = None,
) -> Topology:
    """Every pair ``a < b`` of the GPUs in ``handles`` (NVML index → device handle), linked.

    ``p2p`` is NVML's common ancestor of the pair as a :class:`P2PLevel`; ``nvlinks`` the pair's
    NVLink links, direct or through NVSwitches (see the module docstring). A GPU that is lost or
    cannot be read leaves all of its pairs at ``p2p=None, nvlinks=0``; a call the driver does not
    offer leaves what it would have told at ``None``/0. Problems are logged once per read.
    ``buses``: the GPUs' PCI bus IDs where already known (discovery read them), else read here.
    Blocking; run it on a worker thread.
    """
    reader = TopologyReader(handles, calls or NvmlCalls(), buses)
    walks = {index: reader.walk(index) for index in reader.indexes}
    levels = {pair: level for index in reader.indexes for pair, level in reader.ancestors(index)}
    return reader.assemble(walks, levels)


def bus_key(bus_id: str | bytes) -> BusKey | None:
    """``(domain, bus, device, function)`` of a PCI bus ID in any of NVML's spellings, or None.

    ``"00000000:18:00.0"``, ``"0000:18:00.0"`` and ``"18:00.0"`` are the same device.
    """
    text = bus_id.decode(errors="replace") if isinstance(bus_id, bytes) else bus_id
    parts = text.strip().split(":")
    if len(parts) == 2:
        parts.insert(0, "0")
    if len(parts) != 3 or "." not in parts[2]:
        return None
    dev, _, fn = parts[2].partition(".")
    try:
        return int(parts[0], 16), int(parts[1], 16), int(dev, 16), int(fn, 16)
    except ValueError:
        return None


def p2p_level(value: int) -> P2PLevel | None:
    """NVML's ``NVML_TOPOLOGY_*`` as a :class:`P2PLevel` (they share values), None if unknown."""
    try:
        return P2PLevel(int(value))
    except ValueError:
        return None


class GpuLinks:
    """What one GPU's link walk found."""

    def __init__(self) -> None:
        self.peers: Counter[int] = Counter()  # GPU index -> direct links
        self.switches: Counter[BusKey] = Counter()  # NVSwitch bus -> links into it


Pair = tuple[int, int]


class TopologyReader:
    """One read of the topology, with its once-per-read log bookkeeping.

    :meth:`walk` and :meth:`ancestors` may run for different GPUs on different threads at once.
    """

    def __init__(
        self,
        handles: Mapping[int, Any],
        calls: NvmlCalls,
        buses: Mapping[int, str] | None = None,
    ) -> None:
        self._handles = dict(sorted(handles.items()))
        self._calls = calls
        self._lock = threading.Lock()
        self._unreadable: set[int] = set()  # lost or unidentifiable GPUs: all pairs unknown
        self._no_nvlink_api = False
        self._no_state_fields = False
        self._no_remote_type = False
        self._no_ancestor = False
        self._buses = self._bus_ids(buses or {})
        self._by_bus = {bus: index for index, bus in self._buses.items()}

    @property
    def indexes(self) -> tuple[int, ...]:
        return tuple(self._handles)

    def assemble(
        self, walks: Mapping[int, GpuLinks | None], levels: Mapping[Pair, P2PLevel | None]
    ) -> Topology:
        """The topology from every GPU's walk and every pair's P2P level (missing: unknown)."""
        links = []
        indexes = list(self._handles)
        for i, a in enumerate(indexes):
            for b in indexes[i + 1 :]:
                if a in self._unreadable or b in self._unreadable:
                    links.append(Link(a=a, b=b))
                else:
                    links.append(
                        Link(a=a, b=b, p2p=levels.get((a, b)), nvlinks=_nvlinks(a, b, walks))
                    )
        return Topology(links=tuple(links))

    # ----- per GPU -----------------------------------------------------------------------------
    def _bus_ids(self, known: Mapping[int, str]) -> dict[int, BusKey]:
        buses: dict[int, BusKey] = {}
        for index, handle in self._handles.items():
            text: str | bytes | None = known.get(index)
            if not text:
                try:
                    text = self._calls.call(index, pynvml.nvmlDeviceGetPciInfo, handle).busId
                except pynvml.NVMLError as exc:
                    self._gpu_failed(index, "pci info", exc)
                    continue
            key = bus_key(text or "")
            if key is None:
                self._unreadable.add(index)
                self._once("bad bus id", index, "gpu has an unreadable pci bus id", gpu=index)
                continue
            buses[index] = key
        return buses

    def walk(self, index: int) -> GpuLinks | None:
        """GPU ``index``'s NVLink peers and switch ports; None when its links could not be read."""
        found = GpuLinks()
        if index not in self._buses:
            return found
        if self._no_nvlink_api:
            return None
        handle = self._handles[index]
        try:
            active = self._active_links(index, handle)
        except pynvml.NVMLError as exc:
            self._walk_failed(index, "nvlink state", exc)
            return None
        if active is None:
            return None
        for link in active:
            try:
                kind, remote = self._far_end(index, handle, link)
            except pynvml.NVMLError as exc:
                if exc.value == pynvml.NVML_ERROR_NOT_SUPPORTED:
                    self._once(
                        "no remote",
                        None,
                        "nvlink remote not offered; such links are not counted",
                        gpu=index,
                        error=describe(exc),
                    )
                    continue
                self._walk_failed(index, "nvlink remote", exc)
                return None
            self._count(index, found, kind, remote)
        return found

    def ancestors(self, index: int) -> list[tuple[Pair, P2PLevel | None]]:
        """The P2P level of every pair ``(index, b)`` with ``b > index`` (both readable)."""
        found = []
        for b in self._handles:
            if b > index and index not in self._unreadable and b not in self._unreadable:
                found.append(((index, b), self._p2p(index, b)))
        return found

    def _walk_failed(self, index: int, what: str, exc: pynvml.NVMLError) -> None:
        if exc.value == pynvml.NVML_ERROR_FUNCTION_NOT_FOUND:
            self._nvlink_api_missing(exc)
        else:
            self._gpu_failed(index, what, exc)

    def _active_links(self, index: int, handle: Any) -> list[int] | None:
        """The GPU's active links, from one field-values call where the driver offers it."""
        if not self._no_state_fields:
            fields = [(pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT, 0)] + [
                (pynvml.NVML_FI_DEV_NVLINK_GET_STATE, link) for link in range(MAX_LINKS)
            ]
            try:
                slots = self._calls.call(index, pynvml.nvmlDeviceGetFieldValues, handle, fields)
            except pynvml.NVMLError as exc:
                if exc.value not in ABSENT:
                    raise
                self._no_state_fields = True
                return self._active_links_one_by_one(index, handle)
            codes = [int(slot.nvmlReturn) for slot in slots]
            if pynvml.NVML_ERROR_GPU_IS_LOST in codes:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
            if codes[1] in ABSENT:
                self._no_state_fields = True  # an older driver: ask link by link
            elif codes[0] == pynvml.NVML_SUCCESS:
                count = min(int(slots[0].value.uiVal), MAX_LINKS)
                return [
                    link
                    for link in range(count)
                    if codes[1 + link] == pynvml.NVML_SUCCESS
                    and int(slots[1 + link].value.uiVal) == pynvml.NVML_FEATURE_ENABLED
                ]
        return self._active_links_one_by_one(index, handle)

    def _active_links_one_by_one(self, index: int, handle: Any) -> list[int] | None:
        active = []
        for link in range(MAX_LINKS):
            try:
                state = self._calls.call(index, pynvml.nvmlDeviceGetNvLinkState, handle, link)
            except pynvml.NVMLError as exc:
                if exc.value == pynvml.NVML_ERROR_FUNCTION_NOT_FOUND:
                    raise
                if exc.value in _NO_SUCH_LINK:
                    if link == 0:  # no NVLink at all: a PCIe-only GPU, or the call is refused
                        self._once(
                            "no nvlink",
                            None,
                            "nvlink not offered by this gpu or driver",
                            level="info",
                            gpu=index,
                            error=describe(exc),
                        )
                    break  # past the GPU's last link
                raise
            if state == pynvml.NVML_FEATURE_ENABLED:
                active.append(link)
        return active

    def _far_end(self, index: int, handle: Any, link: int) -> tuple[int | None, BusKey | None]:
        """``(NVML_NVLINK_DEVICE_TYPE_* or None, remote bus)`` of one active link."""
        info = self._calls.call(index, pynvml.nvmlDeviceGetNvLinkRemotePciInfo, handle, link)
        remote = bus_key(info.busId)
        if remote is not None and remote in self._by_bus:
            return pynvml.NVML_NVLINK_DEVICE_TYPE_GPU, remote  # one of ours: no need to ask
        return self._remote_type(index, handle, link), remote

    def _remote_type(self, index: int, handle: Any, link: int) -> int | None:
        """NVML_NVLINK_DEVICE_TYPE_* of the link's far end, None when the driver cannot say."""
        if self._no_remote_type:
            return None
        try:
            return int(
                self._calls.call(index, pynvml.nvmlDeviceGetNvLinkRemoteDeviceType, handle, link)
            )
        except pynvml.NVMLError as exc:
            if exc.value not in ABSENT:
                raise
            if exc.value == pynvml.NVML_ERROR_FUNCTION_NOT_FOUND:
                self._no_remote_type = True
            self._once(
                "no remote type",
                None,
                "nvlink remote device type not offered; links to non-gpus are ignored",
                gpu=index,
                error=describe(exc),
            )
            return None

    def _count(self, index: int, found: GpuLinks, kind: int | None, remote: BusKey | None) -> None:
        if remote is None:
            self._once("bad remote", index, "nvlink remote has an unreadable bus id", gpu=index)
            return
        if kind == pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH:
            found.switches[remote] += 1
            return
        peer = self._by_bus.get(remote)
        if kind in (None, pynvml.NVML_NVLINK_DEVICE_TYPE_GPU) and peer is not None:
            if peer != index:
                found.peers[peer] += 1
            return
        if kind == pynvml.NVML_NVLINK_DEVICE_TYPE_GPU and not self._unreadable:
            # (With an unreadable GPU, its bus is unknown: the peer may well be that one.)
            self._once(
                "foreign peer", index, "nvlink to a gpu the agent does not manage", gpu=index
            )

    # ----- per pair ----------------------------------------------------------------------------
    def _p2p(self, a: int, b: int) -> P2PLevel | None:
        if self._no_ancestor:
            return None
        try:
            value = self._calls.call(
                a,
                pynvml.nvmlDeviceGetTopologyCommonAncestor,
                self._handles[a],
                self._handles[b],
            )
        except pynvml.NVMLError as exc:
            if exc.value == pynvml.NVML_ERROR_FUNCTION_NOT_FOUND:
                self._no_ancestor = True
            if exc.value in ABSENT:
                self._once(
                    "no ancestor",
                    None,
                    "pcie common ancestor not offered; p2p levels unknown",
                    error=describe(exc),
                )
            else:
                self._once(
                    "ancestor failed",
                    (a, b),
                    "pcie common ancestor failed",
                    gpus=[a, b],
                    error=describe(exc),
                )
            return None
        level = p2p_level(value)
        if level is None:
            self._once("odd ancestor", value, "unknown pcie topology level", level=value)
        return level

    # ----- logging -----------------------------------------------------------------------------
    def _gpu_failed(self, index: int, what: str, exc: pynvml.NVMLError) -> None:
        with self._lock:
            self._unreadable.add(index)
        if exc.value == pynvml.NVML_ERROR_GPU_IS_LOST:
            self._once("lost", index, "gpu lost; its topology is unknown", gpu=index)
        else:
            self._once(
                "failed",
                index,
                "gpu topology unreadable",
                gpu=index,
                call=what,
                error=describe(exc),
            )

    def _nvlink_api_missing(self, exc: pynvml.NVMLError) -> None:
        self._no_nvlink_api = True
        self._once(
            "no nvlink api",
            None,
            "nvlink queries not offered; nvlink counts are 0",
            error=describe(exc),
        )

    def _once(
        self, kind: str, key: object, event: str, *, level: str = "warning", **fields: Any
    ) -> None:
        """Log ``event`` unless ``(kind, key)`` was logged already (once per backend)."""
        self._calls.note(("topology", kind, key), event, level=level, **fields)


def _nvlinks(a: int, b: int, walks: Mapping[int, GpuLinks | None]) -> int:
    wa, wb = walks.get(a), walks.get(b)
    if wa is None or wb is None:
        return 0
    direct = min(wa.peers[b], wb.peers[a])
    switched = sum(min(wa.switches[s], wb.switches[s]) for s in _shared(wa, wb))
    return direct + switched


def _shared(wa: GpuLinks, wb: GpuLinks) -> Iterable[BusKey]:
    return wa.switches.keys() & wb.switches.keys()


__all__ = ["NO_GPU", "GpuLinks", "TopologyReader", "bus_key", "p2p_level", "read_topology"]
