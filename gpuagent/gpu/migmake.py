"""MIG made and removed on the driver (``--dra-mig dynamic``): what shapes a GPU offers, MIG
mode switched, a GPU instance made at a placement with the compute instance spanning it, the GPU
instances listed and destroyed.

Every function blocks and is the caller's to run off the event loop. The driver's refusals come
back as :class:`MigRefused`, carrying NVML's error name (``INSUFFICIENT_RESOURCES``, ``IN_USE``,
``NO_PERMISSION``, …) for the claim's error; a lost GPU or any other failure is raised the same
way, never as a pynvml exception.

nvml.h: every call that changes MIG "requires privileged user" (CAP_SYS_ADMIN); the placements
(``nvmlDeviceGetGpuInstancePossiblePlacements_v2``) are offered whatever the MIG mode, and so is
the unversioned profile info (the versioned one needs MIG mode on).
"""

from __future__ import annotations

import contextlib
import ctypes
from typing import Any

import pynvml

from gpuagent.domain.migshapes import Instance, MigPartitions, MigRefused, MigShape, Placement
from gpuagent.gpu.calls import ABSENT, NvmlCalls, describe
from gpuagent.gpu.mig import mig_profile_name

__all__ = [
    "destroy_instance",
    "instances",
    "make_instance",
    "mig_mode",
    "read_shapes",
    "set_mig_mode",
]

#: ``NVML_DEVICE_ARCH_HOPPER``: MIG mode switches without a GPU reset from this one on.
ARCH_HOPPER = 9
#: ``NVML_COMPUTE_INSTANCE_PROFILE_*`` of the compute instance spanning N compute slices.
CI_PROFILE_FOR_SLICES = {1: 0x0, 2: 0x1, 3: 0x2, 4: 0x3, 7: 0x4, 8: 0x5, 6: 0x6}
#: More GPU instances than any GPU holds (seven on A100 to B200).
MAX_GPU_INSTANCES = 16
_NOT_OFFERED = (*ABSENT, pynvml.NVML_ERROR_INVALID_ARGUMENT, pynvml.NVML_ERROR_NOT_FOUND)


def _refused(what: str, exc: pynvml.NVMLError) -> MigRefused:
    reason = _name(int(exc.value))
    return MigRefused(f"{what}: {reason} ({describe(exc)})", reason)


def _name(code: int) -> str:
    """NVML's name of an error code without its prefix: ``INSUFFICIENT_RESOURCES``."""
    for name in dir(pynvml):
        if name.startswith("NVML_ERROR_") and getattr(pynvml, name) == code:
            return name.removeprefix("NVML_ERROR_")
    return str(code)


def read_shapes(
    index: int, handle: Any, calls: NvmlCalls, total_memory_bytes: int, architecture: int | None
) -> MigPartitions | None:
    """Every GPU-instance profile GPU ``index`` offers with its placements; ``None`` when it
    offers none or they cannot be read (no MIG, no privilege: logged once)."""
    shapes: list[MigShape] = []
    try:
        for profile in range(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
            shape = _shape(index, handle, calls, profile, total_memory_bytes)
            if shape is not None:
                shapes.append(shape)
    except pynvml.NVMLError as exc:
        calls.note(
            ("migshapes", index),
            "mig shapes unreadable; the gpu is not offered partitionable",
            gpu=index,
            error=describe(exc),
        )
        return None
    if not shapes:
        return None
    toggles = architecture is not None and architecture >= ARCH_HOPPER
    return MigPartitions(shapes=tuple(shapes), toggles=toggles)


def _shape(index: int, handle: Any, calls: NvmlCalls, profile: int, total: int) -> MigShape | None:
    try:
        info = calls.call(
            index, pynvml.nvmlDeviceGetGpuInstanceProfileInfo, handle, profile, 1,
            name="nvmlDeviceGetGpuInstanceProfileInfo",
        )  # fmt: skip
    except pynvml.NVMLError as exc:
        if exc.value in _NOT_OFFERED:
            return None
        raise
    profile_id, slices = int(info.id), int(info.sliceCount)
    memory_mib = int(info.memorySizeMB)
    return MigShape(
        name=mig_profile_name(slices, slices, memory_mib, total, profile),
        gi_profile=profile,
        profile_id=profile_id,
        slices=slices,
        memory_mib=memory_mib,
        multiprocessors=int(info.multiprocessorCount),
        copy_engines=int(info.copyEngineCount),
        decoders=int(info.decoderCount),
        encoders=int(info.encoderCount),
        jpeg_engines=int(info.jpegCount),
        ofa_engines=int(info.ofaCount),
        placements=_placements(index, handle, calls, profile_id),
    )


def _placements(
    index: int, handle: Any, calls: NvmlCalls, profile_id: int
) -> tuple[Placement, ...]:
    count = ctypes.c_uint(0)
    fn = pynvml.nvmlDeviceGetGpuInstancePossiblePlacements
    calls.call(index, fn, handle, profile_id, None, ctypes.byref(count))
    buffer = (pynvml.c_nvmlGpuInstancePlacement_t * max(count.value, 1))()
    calls.call(index, fn, handle, profile_id, buffer, ctypes.byref(count))
    return tuple(sorted(Placement(int(p.start), int(p.size)) for p in buffer[: count.value]))


def mig_mode(index: int, handle: Any, calls: NvmlCalls) -> bool:
    """Whether MIG mode is on now."""
    try:
        current, _pending = calls.call(index, pynvml.nvmlDeviceGetMigMode, handle)
    except pynvml.NVMLError as exc:
        raise _refused("reading the mig mode", exc) from None
    return bool(int(current) == pynvml.NVML_DEVICE_MIG_ENABLE)


def set_mig_mode(index: int, handle: Any, calls: NvmlCalls, *, on: bool) -> None:
    """Switch MIG mode; raises :class:`MigRefused` unless it is switched now (an Ampere GPU
    answers RESET_REQUIRED, a busy one IN_USE)."""
    mode = pynvml.NVML_DEVICE_MIG_ENABLE if on else pynvml.NVML_DEVICE_MIG_DISABLE
    what = f"switching mig mode {'on' if on else 'off'}"
    try:
        status = int(calls.call(index, pynvml.nvmlDeviceSetMigMode, handle, mode))
    except pynvml.NVMLError as exc:
        raise _refused(what, exc) from None
    if status != pynvml.NVML_SUCCESS:
        reason = _name(status)
        raise MigRefused(f"{what}: not activated: {reason}", reason)


def make_instance(
    index: int, handle: Any, calls: NvmlCalls, shape: MigShape, placement: Placement
) -> int:
    """Make a GPU instance of ``shape`` at ``placement`` and the compute instance spanning it;
    its GPU-instance ID. A GPU instance whose compute instance cannot be made is destroyed."""
    where = pynvml.c_nvmlGpuInstancePlacement_t()
    where.start, where.size = placement.start, placement.size
    what = f"making a {shape.name} gpu instance at memory slice {placement.start}"
    try:
        gi = calls.call(
            index, pynvml.nvmlDeviceCreateGpuInstanceWithPlacement, handle, shape.profile_id,
            ctypes.byref(where),
        )  # fmt: skip
    except pynvml.NVMLError as exc:
        raise _refused(what, exc) from None
    try:
        ci_profile = CI_PROFILE_FOR_SLICES[shape.slices]
        info = calls.call(
            index, pynvml.nvmlGpuInstanceGetComputeInstanceProfileInfo, gi, ci_profile,
            pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED, 1,
            name="nvmlGpuInstanceGetComputeInstanceProfileInfo",
        )  # fmt: skip
        calls.call(index, pynvml.nvmlGpuInstanceCreateComputeInstance, gi, int(info.id))
        return int(calls.call(index, pynvml.nvmlGpuInstanceGetInfo, gi).id)
    except (pynvml.NVMLError, KeyError) as exc:
        with contextlib.suppress(pynvml.NVMLError):  # else the orphan sweep finds it
            calls.call(index, pynvml.nvmlGpuInstanceDestroy, gi)
        if isinstance(exc, KeyError):
            raise MigRefused(f"{what}: no compute instance spans {shape.slices} slices") from None
        raise _refused(f"{what}: its compute instance", exc) from None


def instances(
    index: int, handle: Any, calls: NvmlCalls, shapes: tuple[MigShape, ...]
) -> list[Instance]:
    """Every GPU instance of the GPU, of the profiles ``shapes`` name (none while MIG is off)."""
    found: list[Instance] = []
    for shape in shapes:
        count = ctypes.c_uint(0)
        buffer = (pynvml.c_nvmlGpuInstance_t * MAX_GPU_INSTANCES)()
        try:
            calls.call(
                index, pynvml.nvmlDeviceGetGpuInstances, handle, shape.profile_id, buffer,
                ctypes.byref(count),
            )  # fmt: skip
        except pynvml.NVMLError as exc:
            if exc.value in ABSENT:
                return []  # MIG mode off
            raise _refused("listing gpu instances", exc) from None
        for gi in buffer[: count.value]:
            try:
                info = calls.call(index, pynvml.nvmlGpuInstanceGetInfo, gi)
                computed = _compute_instance(index, calls, gi) is not None
            except pynvml.NVMLError as exc:
                raise _refused("reading a gpu instance", exc) from None
            placement = Placement(int(info.placement.start), int(info.placement.size))
            found.append(Instance(int(info.id), int(info.profileId), placement, computed))
    return sorted(found, key=lambda i: i.gpu_instance_id)


def _compute_instance(index: int, calls: NvmlCalls, gi: Any) -> Any:
    try:
        return calls.call(index, pynvml.nvmlGpuInstanceGetComputeInstanceById, gi, 0)
    except pynvml.NVMLError as exc:
        if exc.value == pynvml.NVML_ERROR_NOT_FOUND:
            return None
        raise


def destroy_instance(index: int, handle: Any, calls: NvmlCalls, gpu_instance_id: int) -> bool:
    """Destroy GPU instance ``gpu_instance_id`` and its compute instance; ``False`` when it is
    not there. Raises :class:`MigRefused` (``IN_USE`` while processes run on it)."""
    try:
        gi = calls.call(index, pynvml.nvmlDeviceGetGpuInstanceById, handle, gpu_instance_id)
    except pynvml.NVMLError as exc:
        if exc.value in (pynvml.NVML_ERROR_NOT_FOUND, *ABSENT):
            return False
        raise _refused(f"finding gpu instance {gpu_instance_id}", exc) from None
    what = f"destroying gpu instance {gpu_instance_id}"
    try:
        ci = _compute_instance(index, calls, gi)
        if ci is not None:
            calls.call(index, pynvml.nvmlComputeInstanceDestroy, ci)
        calls.call(index, pynvml.nvmlGpuInstanceDestroy, gi)
    except pynvml.NVMLError as exc:
        raise _refused(what, exc) from None
    return True
