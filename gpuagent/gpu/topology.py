"""GPU-to-GPU topology from the driver: PCIe common ancestor and NVLink link counts per pair.

Read once at discovery (the agent keeps the result in the store); never per RPC, unlike NVIDIA's
plugin, which queries NVML on every preferred-allocation call (k8s-device-plugin #774) and fails
every call once one GPU is lost (#2038). :func:`read_topology` never raises: what cannot be read
leaves that pair's ``p2p`` at ``None`` and its ``nvlinks`` at 0, logged once per read.

NVLink counting walks every link of every GPU (``nvmlDeviceGetNvLinkState``, then
``nvmlDeviceGetNvLinkRemoteDeviceType`` and ``nvmlDeviceGetNvLinkRemotePciInfo_v2`` of each active
link) and sorts the far ends by kind:

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

This module and :mod:`gpuagent.gpu.mig` are, with :mod:`gpuagent.gpu.nvml`, the ones that import
:mod:`pynvml`; NVML errors never leave them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

import pynvml
import structlog

from gpuagent.domain.devices import Link, P2PLevel, Topology

log = structlog.get_logger("gpuagent.topology")

_ABSENT = (pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
#: Link numbers past the GPU's last link (the driver's answer varies by version).
_NO_SUCH_LINK = (pynvml.NVML_ERROR_INVALID_ARGUMENT, pynvml.NVML_ERROR_NOT_SUPPORTED)

BusKey = tuple[int, int, int, int]


def read_topology(handles: Mapping[int, Any]) -> Topology:
    """Every pair ``a < b`` of the GPUs in ``handles`` (NVML index → device handle), linked.

    ``p2p`` is NVML's common ancestor of the pair as a :class:`P2PLevel`; ``nvlinks`` the pair's
    NVLink links, direct or through NVSwitches (see the module docstring). A GPU that is lost or
    cannot be read leaves all of its pairs at ``p2p=None, nvlinks=0``; a call the driver does not
    offer leaves what it would have told at ``None``/0. Problems are logged once per read.
    Blocking; run it on a worker thread.
    """
    return _Reader(handles).read()


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


class _GpuLinks:
    """What one GPU's link walk found."""

    def __init__(self) -> None:
        self.peers: Counter[int] = Counter()  # GPU index -> direct links
        self.switches: Counter[BusKey] = Counter()  # NVSwitch bus -> links into it


class _Reader:
    """One read of the topology, with its once-per-read log bookkeeping."""

    def __init__(self, handles: Mapping[int, Any]) -> None:
        self._handles = dict(sorted(handles.items()))
        self._unreadable: set[int] = set()  # lost or unidentifiable GPUs: all pairs unknown
        self._logged: set[tuple[str, object]] = set()
        self._no_nvlink_api = False
        self._no_remote_type = False
        self._no_ancestor = False

    def read(self) -> Topology:
        buses = self._bus_ids()
        by_bus = {bus: index for index, bus in buses.items()}
        walks = {index: self._walk(index, by_bus) for index in buses}
        links = []
        indexes = list(self._handles)
        for i, a in enumerate(indexes):
            for b in indexes[i + 1 :]:
                links.append(self._link(a, b, walks))
        return Topology(links=tuple(links))

    # ----- per GPU -----------------------------------------------------------------------------
    def _bus_ids(self) -> dict[int, BusKey]:
        buses: dict[int, BusKey] = {}
        for index, handle in self._handles.items():
            try:
                info = pynvml.nvmlDeviceGetPciInfo(handle)
            except pynvml.NVMLError as exc:
                self._gpu_failed(index, "pci info", exc)
                continue
            key = bus_key(info.busId)
            if key is None:
                self._unreadable.add(index)
                self._once("bad bus id", index, "gpu has an unreadable pci bus id", gpu=index)
                continue
            buses[index] = key
        return buses

    def _walk(self, index: int, by_bus: Mapping[BusKey, int]) -> _GpuLinks | None:
        """The GPU's NVLink peers and switch ports; None when its links could not be read."""
        found = _GpuLinks()
        if self._no_nvlink_api or index in self._unreadable:
            return None if self._no_nvlink_api else found
        handle = self._handles[index]
        for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
            try:
                active = pynvml.nvmlDeviceGetNvLinkState(handle, link)
            except pynvml.NVMLError as exc:
                if exc.value == pynvml.NVML_ERROR_FUNCTION_NOT_FOUND:
                    self._nvlink_api_missing(exc)
                    return None
                if exc.value in _NO_SUCH_LINK:
                    if link == 0:  # no NVLink at all: a PCIe-only GPU, or the call is refused
                        self._once(
                            "no nvlink",
                            None,
                            "nvlink not offered by this gpu or driver",
                            level="info",
                            gpu=index,
                            error=_describe(exc),
                        )
                    break  # past the GPU's last link
                self._gpu_failed(index, "nvlink state", exc)
                return None
            if active != pynvml.NVML_FEATURE_ENABLED:
                continue
            try:
                kind = self._remote_type(index, handle, link)
                remote = bus_key(pynvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link).busId)
            except pynvml.NVMLError as exc:
                if exc.value == pynvml.NVML_ERROR_FUNCTION_NOT_FOUND:
                    self._nvlink_api_missing(exc)
                    return None
                if exc.value == pynvml.NVML_ERROR_NOT_SUPPORTED:
                    self._once(
                        "no remote",
                        None,
                        "nvlink remote not offered; such links are not counted",
                        gpu=index,
                        error=_describe(exc),
                    )
                    continue
                self._gpu_failed(index, "nvlink remote", exc)
                return None
            self._count(index, found, kind, remote, by_bus)
        return found

    def _remote_type(self, index: int, handle: Any, link: int) -> int | None:
        """NVML_NVLINK_DEVICE_TYPE_* of the link's far end, None when the driver cannot say."""
        if self._no_remote_type:
            return None
        try:
            return int(pynvml.nvmlDeviceGetNvLinkRemoteDeviceType(handle, link))
        except pynvml.NVMLError as exc:
            if exc.value not in _ABSENT:
                raise
            if exc.value == pynvml.NVML_ERROR_FUNCTION_NOT_FOUND:
                self._no_remote_type = True
            self._once(
                "no remote type",
                None,
                "nvlink remote device type not offered; links to non-gpus are ignored",
                gpu=index,
                error=_describe(exc),
            )
            return None

    def _count(
        self,
        index: int,
        found: _GpuLinks,
        kind: int | None,
        remote: BusKey | None,
        by_bus: Mapping[BusKey, int],
    ) -> None:
        if remote is None:
            self._once("bad remote", index, "nvlink remote has an unreadable bus id", gpu=index)
            return
        if kind == pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH:
            found.switches[remote] += 1
            return
        peer = by_bus.get(remote)
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
    def _link(self, a: int, b: int, walks: Mapping[int, _GpuLinks | None]) -> Link:
        if a in self._unreadable or b in self._unreadable:
            return Link(a=a, b=b)
        return Link(a=a, b=b, p2p=self._p2p(a, b), nvlinks=_nvlinks(a, b, walks))

    def _p2p(self, a: int, b: int) -> P2PLevel | None:
        if self._no_ancestor:
            return None
        try:
            value = pynvml.nvmlDeviceGetTopologyCommonAncestor(self._handles[a], self._handles[b])
        except pynvml.NVMLError as exc:
            if exc.value == pynvml.NVML_ERROR_FUNCTION_NOT_FOUND:
                self._no_ancestor = True
            if exc.value in _ABSENT:
                self._once(
                    "no ancestor",
                    None,
                    "pcie common ancestor not offered; p2p levels unknown",
                    error=_describe(exc),
                )
            else:
                self._once(
                    "ancestor failed",
                    (a, b),
                    "pcie common ancestor failed",
                    gpus=[a, b],
                    error=_describe(exc),
                )
            return None
        level = p2p_level(value)
        if level is None:
            self._once("odd ancestor", value, "unknown pcie topology level", level=value)
        return level

    # ----- logging -----------------------------------------------------------------------------
    def _gpu_failed(self, index: int, what: str, exc: pynvml.NVMLError) -> None:
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
                error=_describe(exc),
            )

    def _nvlink_api_missing(self, exc: pynvml.NVMLError) -> None:
        self._no_nvlink_api = True
        self._once(
            "no nvlink api",
            None,
            "nvlink queries not offered; nvlink counts are 0",
            error=_describe(exc),
        )

    def _once(
        self, kind: str, key: object, event: str, *, level: str = "warning", **fields: Any
    ) -> None:
        """Log ``event`` unless this read already logged ``(kind, key)``."""
        if (kind, key) in self._logged:
            return
        self._logged.add((kind, key))
        getattr(log, level)(event, **fields)


def _nvlinks(a: int, b: int, walks: Mapping[int, _GpuLinks | None]) -> int:
    wa, wb = walks.get(a), walks.get(b)
    if wa is None or wb is None:
        return 0
    direct = min(wa.peers[b], wb.peers[a])
    switched = sum(min(wa.switches[s], wb.switches[s]) for s in _shared(wa, wb))
    return direct + switched


def _shared(wa: _GpuLinks, wb: _GpuLinks) -> Iterable[BusKey]:
    return wa.switches.keys() & wb.switches.keys()


def _describe(error: pynvml.NVMLError) -> str:
    return f"{error} (NVML {error.value})"
