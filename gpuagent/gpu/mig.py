"""MIG discovery from the driver: is MIG mode on, and which MIG devices does the GPU hold.

:func:`read_mig` reads, for one GPU, every MIG device (one compute instance of one GPU instance):
its ``MIG-`` UUID, GPU- and compute-instance IDs, memory, profile name as NVIDIA spells it, and
the ``/dev/nvidia-caps`` device nodes a container needs to use it.

Profile names follow go-nvlib (``pkg/nvlib/device/mig_profile.go``), which NVIDIA's device plugin
uses for its ``nvidia.com/mig-<profile>`` resources and which matches ``nvidia-smi``:

* ``<G>g.<GB>gb`` where G is the GPU instance's slice count, or ``<C>c.<G>g.<GB>gb`` when the
  compute instance has C < G slices;
* GB: the instance's share of the GPU's memory rounded **up** to the next eighth, times the GPU's
  memory in GiB rounded up, rounded to the nearest integer (halves up) — see :func:`mig_memory_gb`.
  An H100 80GB (81559 MiB, 80 GiB rounded up) ``1g`` instance of 9984 MiB is 0.122 of it → 1/8 →
  10 → ``1g.10gb``; an H200's (141 GiB) half is 70.5 → ``3g.71gb``;
* a suffix from the GPU-instance profile: ``+me`` (media extensions, ``*_REV1``), ``+me.all``,
  ``+gfx``, or ``-me`` (``*_NO_ME``). ``*_REV2`` (``1g.20gb`` on H100) has none: only its memory
  differs.

MIG support: as NVIDIA's go-nvlib decides it, a GPU supports MIG when ``nvmlDeviceGetMigMode``
answers (whatever the mode), and does not when the driver answers NOT_SUPPORTED (nvml.h: the
device does not support MIG mode) or lacks the call (FUNCTION_NOT_FOUND: a driver older than MIG).
See :class:`MigReading`.

Errors: MIG mode not offered (NOT_SUPPORTED, FUNCTION_NOT_FOUND) means not enabled; values the
driver does not offer degrade (no suffix, memory from another call), logged once. Any other NVML
error (NO_PERMISSION too, which nvml.h does not list for ``nvmlDeviceGetMigMode``), above all a
lost GPU, is raised as :class:`pynvml.NVMLError` for the caller's discovery to handle like any
other failing GPU: a GPU whose MIG mode is unknown is never advertised whole.

Privileges: under MIG a real driver answers the parent GPU's aggregate memory read with
NO_PERMISSION unless the caller has CAP_SYS_ADMIN (the base manifest drops every capability). The
names then take the GPU's memory from its largest GPU-instance profile (the full-GPU one), which
rounds to the same size; the caller gets that figure back to use as the GPU's memory.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import pynvml
import structlog

from gpuagent.domain.devices import MigAttributes, MigDevice
from gpuagent.domain.migshapes import Placement
from gpuagent.gpu.calls import ABSENT, NvmlCalls, describe

log = structlog.get_logger("gpuagent.mig")

MIG_MINORS_FILE = "driver/nvidia-caps/mig-minors"  # under a proc root (/proc)
DEFAULT_MIG_MINORS = Path("/proc") / MIG_MINORS_FILE
CAPS_DEVICE_DIR = "/dev/nvidia-caps"
MIB = 1024 * 1024
GIB = 1024 * MIB
_EIGHTHS = 8

_ABSENT = ABSENT
_NO_DEVICE_AT_INDEX = (pynvml.NVML_ERROR_NOT_FOUND, pynvml.NVML_ERROR_INVALID_ARGUMENT)
_LOOKUP_REFUSED = (*_ABSENT, pynvml.NVML_ERROR_NOT_FOUND, pynvml.NVML_ERROR_NO_PERMISSION)

#: Name suffix per GPU-instance profile (``NVML_GPU_INSTANCE_PROFILE_*``), as go-nvlib spells it.
PROFILE_SUFFIXES: Mapping[int, str] = {
    pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1: "+me",
    pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE_REV1: "+me",
    pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_ALL_ME: "+me.all",
    pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE_ALL_ME: "+me.all",
    pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_GFX: "+gfx",
    pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE_GFX: "+gfx",
    pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE_GFX: "+gfx",
    pynvml.NVML_GPU_INSTANCE_PROFILE_4_SLICE_GFX: "+gfx",
    pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_NO_ME: "-me",
    pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE_NO_ME: "-me",
}

_logged_files: set[Path] = set()
_parsed: dict[Path, tuple[tuple[int, int], dict[str, int]]] = {}
_logged_files_lock = threading.Lock()


def read_mig(
    index: int,
    handle: Any,
    minor: int,
    *,
    mig_minors: Path = DEFAULT_MIG_MINORS,
    calls: NvmlCalls | None = None,
    total_memory_bytes: int | None = None,
) -> tuple[bool, tuple[MigDevice, ...]]:
    """``(MIG mode enabled, its MIG devices)`` of the GPU with NVML index ``index``.

    ``handle`` is the GPU's NVML device handle and ``minor`` its device minor (``/dev/nvidia<N>``),
    which names its entries in the ``mig_minors`` file. Without that file (no driver caps, or not
    mounted into the agent's container) the devices have no ``device_nodes``; that is logged once
    per file. A GPU without MIG support, or with MIG mode off, is ``(False, ())``.
    ``total_memory_bytes``: the GPU's memory where already read (else read here, see the module
    docstring for what happens without the privilege to).

    Blocking; raises :class:`pynvml.NVMLError` for driver failures other than an absent value.
    """
    reading = read_mig_with_total(
        index,
        handle,
        minor,
        mig_minors=mig_minors,
        calls=calls or NvmlCalls(),
        total_memory_bytes=total_memory_bytes,
    )
    return reading.enabled, reading.devices


class MigReading(NamedTuple):
    """What discovery read of one GPU's MIG side.

    ``capable``: whether the GPU supports MIG; ``enabled``:
    MIG mode is on; ``devices``: its MIG devices; ``total_memory_bytes``: the GPU's memory as the
    names took it (None: not in MIG mode).
    """

    capable: bool
    enabled: bool
    devices: tuple[MigDevice, ...]
    total_memory_bytes: int | None


def read_mig_with_total(
    index: int,
    handle: Any,
    minor: int,
    *,
    calls: NvmlCalls,
    mig_minors: Path = DEFAULT_MIG_MINORS,
    total_memory_bytes: int | None = None,
    handles: dict[str, Any] | None = None,
    profiles: dict[int, tuple[int, Any]] | None = None,
) -> MigReading:
    """:func:`read_mig`, with whether the GPU supports MIG and its memory as the names took it.

    ``handles``, when given, receives each MIG device's NVML handle by its UUID (for its own
    telemetry). ``profiles``, when given, is the GPU's GPU-instance profile table (profile ID →
    its index and info) as read before, and receives it once read (MIG devices made on demand
    read the same GPU's devices again after each change).
    """
    # Any other answer (NO_PERMISSION too, which nvml.h does not list for this call) is raised:
    # a GPU whose MIG mode is unknown must not be advertised whole, so its discovery fails.
    mode = calls.optional(index, pynvml.nvmlDeviceGetMigMode, handle)
    if mode is None:  # NOT_SUPPORTED, FUNCTION_NOT_FOUND: no MIG on this GPU or driver
        return MigReading(False, False, (), None)
    current, _pending = mode
    if int(current) != pynvml.NVML_DEVICE_MIG_ENABLE:
        return MigReading(True, False, (), None)
    reader = _Reader(index, handle, minor, mig_minors, calls)
    if profiles:
        reader.known_profiles(profiles)
    total = total_memory_bytes or reader.total_memory_bytes()
    devices = reader.devices(total)
    if handles is not None:
        handles.update(reader.handles)
    if profiles is not None and not profiles:
        profiles.update(reader.profile_table())
    return MigReading(True, True, devices, total)


def mig_memory_gb(memory_mib: int, total_memory_bytes: int) -> int:
    """The ``<GB>`` of a MIG profile name: ``memory_mib`` of a GPU with ``total_memory_bytes``.

    The instance's share of the GPU is rounded up to the next eighth, multiplied by the GPU's
    memory in GiB rounded up, then rounded to the nearest integer, halves up — go-nvlib's
    ``getMigMemorySizeGB`` in exact integer arithmetic. 0 when the total is unknown.
    """
    if total_memory_bytes <= 0 or memory_mib <= 0:
        return 0
    eighths = -(-memory_mib * MIB * _EIGHTHS // total_memory_bytes)  # ceil
    total_gib = -(-total_memory_bytes // GIB)  # ceil
    return (2 * eighths * total_gib + _EIGHTHS) // (2 * _EIGHTHS)  # round(eighths * gib / 8)


def mig_profile_name(
    gpu_slices: int,
    compute_slices: int,
    memory_mib: int,
    total_memory_bytes: int,
    gi_profile: int | None = None,
) -> str:
    """NVIDIA's name of a MIG profile: ``"3g.40gb"``, ``"1c.3g.40gb"``, ``"1g.10gb+me"``.

    ``gpu_slices``/``compute_slices``/``memory_mib``: the GPU instance's and compute instance's
    slice counts and the instance's memory (``nvmlDeviceGetAttributes_v2``);
    ``total_memory_bytes``: the parent GPU's memory; ``gi_profile``: the GPU instance's
    ``NVML_GPU_INSTANCE_PROFILE_*``, which decides the suffix (none when unknown).
    """
    gb = mig_memory_gb(memory_mib, total_memory_bytes)
    suffix = "" if gi_profile is None else PROFILE_SUFFIXES.get(gi_profile, "")
    if compute_slices in (0, gpu_slices):
        return f"{gpu_slices}g.{gb}gb{suffix}"
    return f"{compute_slices}c.{gpu_slices}g.{gb}gb{suffix}"


def mig_attributes(attrs: Any) -> MigAttributes:
    """The SMs and shared engines of an ``nvmlDeviceAttributes_t`` (GFD's MIG labels)."""
    return MigAttributes(
        multiprocessors=int(attrs.multiprocessorCount),
        copy_engines=int(attrs.sharedCopyEngineCount),
        decoders=int(attrs.sharedDecoderCount),
        encoders=int(attrs.sharedEncoderCount),
        jpeg_engines=int(attrs.sharedJpegCount),
        ofa_engines=int(attrs.sharedOfaCount),
    )


def parse_mig_minors(text: str) -> dict[str, int]:
    """``/proc/driver/nvidia-caps/mig-minors`` as ``{capability: device minor}``.

    Each line is ``<capability> <minor>`` (``config 1``, ``gpu0/gi3/access 30``,
    ``gpu0/gi3/ci0/access 31``). Lines that are not exactly a name and a non-negative decimal
    number are skipped; a repeated name keeps its last minor.
    """
    minors: dict[str, int] = {}
    for line in text.splitlines():
        fields = line.split()
        if len(fields) != 2:
            continue
        name, value = fields
        if value.isascii() and value.isdigit():
            minors[name] = int(value)
    return minors


def mig_device_nodes(
    minors: Mapping[str, int], gpu_minor: int, gpu_instance: int, compute_instance: int
) -> tuple[str, ...]:
    """The ``/dev/nvidia-caps`` nodes of a MIG device: its GPU-instance and compute-instance access.

    Empty when either capability is missing from ``minors`` (a container needs both).
    """
    gi = minors.get(f"gpu{gpu_minor}/gi{gpu_instance}/access")
    ci = minors.get(f"gpu{gpu_minor}/gi{gpu_instance}/ci{compute_instance}/access")
    if gi is None or ci is None:
        return ()
    return (f"{CAPS_DEVICE_DIR}/nvidia-cap{gi}", f"{CAPS_DEVICE_DIR}/nvidia-cap{ci}")


def load_mig_minors(path: Path = DEFAULT_MIG_MINORS) -> dict[str, int] | None:
    """The parsed ``mig-minors`` file, or None when it cannot be read (logged once per path).

    Parsed again only when the file changes (its size or modification time): the kernel module
    writes it once, and MIG devices made on demand have it read after each change.
    """
    try:
        stat = path.stat()
        key = (stat.st_mtime_ns, stat.st_size)
        with _logged_files_lock:
            cached = _parsed.get(path)
        if cached is not None and cached[0] == key:
            return dict(cached[1])
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        with _logged_files_lock:
            first = path not in _logged_files
            _logged_files.add(path)
        if first:
            log.warning(
                "mig capability minors unreadable; mig devices get no device nodes",
                path=str(path),
                error=str(exc),
            )
        return None
    parsed = parse_mig_minors(text)
    with _logged_files_lock:
        _parsed[path] = (key, parsed)
    return dict(parsed)


class _Reader:
    """One GPU's MIG devices, with the lookups they share."""

    def __init__(
        self, index: int, handle: Any, minor: int, mig_minors: Path, calls: NvmlCalls
    ) -> None:
        self._calls = calls
        self.handles: dict[str, Any] = {}
        self._index = index
        self._handle = handle
        self._minor = minor
        self._minors_path = mig_minors
        self._minors: dict[str, int] | None = None
        self._minors_loaded = False
        self._profiles: dict[int, tuple[int, Any]] | None = None  # profile ID -> (index, info)
        self._info_version = 2

    def total_memory_bytes(self) -> int:
        """The GPU's memory: the aggregate read, else its largest GPU-instance profile's."""
        try:
            return int(self._call(pynvml.nvmlDeviceGetMemoryInfo, self._handle).total)
        except pynvml.NVMLError as exc:
            if exc.value != pynvml.NVML_ERROR_NO_PERMISSION:
                raise
            largest = max(
                (int(info.memorySizeMB) for _, info in self._profile_table().values()), default=0
            )
            if not largest:
                raise
            self._once(
                "total",
                "gpu memory unreadable without CAP_SYS_ADMIN; taken from its largest mig profile",
                exc,
            )
            return largest * MIB

    def _call(self, fn: Any, *args: Any) -> Any:
        return self._calls.call(self._index, fn, *args)

    def devices(self, total: int) -> tuple[MigDevice, ...]:
        try:
            count = int(self._call(pynvml.nvmlDeviceGetMaxMigDeviceCount, self._handle))
        except pynvml.NVMLError as exc:
            if exc.value not in _ABSENT:
                raise
            self._once("count", "mig devices cannot be listed", exc)
            return ()
        devices = []
        for i in range(count):
            try:
                mig = self._call(pynvml.nvmlDeviceGetMigDeviceHandleByIndex, self._handle, i)
            except pynvml.NVMLError as exc:
                if exc.value in _NO_DEVICE_AT_INDEX:
                    continue  # indexes may be sparse
                raise
            device = self._device(mig, total)
            self.handles[device.uuid] = mig
            devices.append(device)
        return tuple(devices)

    def _device(self, mig: Any, total: int) -> MigDevice:
        uuid = str(self._call(pynvml.nvmlDeviceGetUUID, mig))
        gi = int(self._call(pynvml.nvmlDeviceGetGpuInstanceId, mig))
        ci = int(self._call(pynvml.nvmlDeviceGetComputeInstanceId, mig))
        gi_profile, gi_info, placement = self._gpu_instance_profile(gi)
        attrs = self._attributes(mig)
        if attrs is not None:
            gpu_slices = int(attrs.gpuInstanceSliceCount)
            compute_slices = int(attrs.computeInstanceSliceCount)
            memory_mib = int(attrs.memorySizeMB)
        else:
            gpu_slices = compute_slices = 0 if gi_info is None else int(gi_info.sliceCount)
            memory_mib = int(self._call(pynvml.nvmlDeviceGetMemoryInfo, mig).total) // MIB
        profile = ""
        if gpu_slices:
            profile = mig_profile_name(gpu_slices, compute_slices, memory_mib, total, gi_profile)
        else:
            log.warning("mig profile unknown", gpu=self._index, uuid=uuid)
        return MigDevice(
            uuid=uuid,
            parent_index=self._index,
            gpu_instance_id=gi,
            compute_instance_id=ci,
            profile=profile,
            memory_mib=memory_mib,
            device_nodes=self._device_nodes(gi, ci),
            attributes=None if attrs is None else mig_attributes(attrs),
            profile_id=None if gi_info is None else int(gi_info.id),
            placement=placement,
        )

    def _attributes(self, mig: Any) -> Any:
        try:
            return self._call(pynvml.nvmlDeviceGetAttributes_v2, mig)
        except pynvml.NVMLError as exc:
            if exc.value not in _ABSENT:
                raise
            self._once("attributes", "mig device attributes not offered", exc)
            return None

    def _gpu_instance_profile(self, gi: int) -> tuple[int | None, Any, Placement | None]:
        """``(NVML_GPU_INSTANCE_PROFILE_*, its profile info, the instance's placement)`` of GPU
        instance ``gi``, each if known."""
        try:
            instance = self._call(pynvml.nvmlDeviceGetGpuInstanceById, self._handle, gi)
            info = self._call(pynvml.nvmlGpuInstanceGetInfo, instance)
        except pynvml.NVMLError as exc:
            if exc.value not in _LOOKUP_REFUSED:
                raise
            self._once("gpu instance", "gpu instance not readable; profile names lack +me", exc)
            return None, None, None
        placement = Placement(int(info.placement.start), int(info.placement.size))
        found = self._profile_table().get(int(info.profileId))
        if found is None:
            return None, None, placement
        return (*found, placement)

    def known_profiles(self, profiles: dict[int, tuple[int, Any]]) -> None:
        """The profile table as read before (not read again)."""
        self._profiles = dict(profiles)

    def profile_table(self) -> dict[int, tuple[int, Any]]:
        """The profile table, if it was read (empty if not)."""
        return dict(self._profiles or {})

    def _profile_table(self) -> dict[int, tuple[int, Any]]:
        """``{profile ID: (NVML_GPU_INSTANCE_PROFILE_*, profile info)}`` of the GPU, read once."""
        if self._profiles is None:
            self._profiles = {}
            for profile in range(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
                info = self._profile_info(profile)
                if info is not None:
                    self._profiles[int(info.id)] = (profile, info)
        return self._profiles

    def _profile_info(self, profile: int) -> Any:
        """One GPU-instance profile's info (versioned call first), None if the GPU lacks it."""
        while True:
            try:
                return self._call(
                    pynvml.nvmlDeviceGetGpuInstanceProfileInfo,
                    self._handle,
                    profile,
                    self._info_version,
                )
            except pynvml.NVMLError as exc:
                if exc.value == pynvml.NVML_ERROR_FUNCTION_NOT_FOUND and self._info_version > 1:
                    self._info_version = 1  # an older driver: the unversioned call
                    continue
                if exc.value in (*_LOOKUP_REFUSED, pynvml.NVML_ERROR_INVALID_ARGUMENT):
                    return None
                raise

    def _device_nodes(self, gi: int, ci: int) -> tuple[str, ...]:
        if not self._minors_loaded:
            self._minors = load_mig_minors(self._minors_path)
            self._minors_loaded = True
        if self._minors is None:
            return ()
        nodes = mig_device_nodes(self._minors, self._minor, gi, ci)
        if not nodes:
            log.warning(
                "mig device has no capability minors",
                gpu=self._index,
                gpu_instance=gi,
                compute_instance=ci,
                path=str(self._minors_path),
            )
        return nodes

    def _once(self, what: str, event: str, exc: pynvml.NVMLError) -> None:
        self._calls.note(
            ("mig", self._index, what), event, level="info", gpu=self._index, error=describe(exc)
        )
