"""MIG entry points of the simulated ``libnvidia-ml``.

A GPU configured with MIG profiles (``mig:`` in ``--sim-config``) is in MIG mode with one GPU
instance per profile and one compute instance spanning each (compute instance ID 0), placed as
:func:`gpuagent.gpu.sim.profiles.place_mig` places them; instances made and destroyed later are
``_api_migmake``'s. MIG devices are enumerated in GPU-instance
ID order by ``nvmlDeviceGetMigDeviceHandleByIndex`` (index 0 up; NOT_FOUND past the last one).

On a MIG device handle the per-device calls of ``_api_device`` answer with the MIG device's UUID,
name and memory; ``nvmlDeviceGetAttributes_v2`` answers only for MIG devices, as NVML's does.
Instance lookups, MIG device enumeration and the versioned profile-info call need MIG mode
(NOT_SUPPORTED without); the first profile-info call answers on any GPU that supports MIG.
GPU- and compute-instance handles of a lost GPU answer GPU_IS_LOST.
"""

from __future__ import annotations

from typing import Any

import pynvml

from gpuagent.gpu.sim._abi import Symbol, as_int, device, out
from gpuagent.gpu.sim.profiles import MIG_COMPUTE_SLICES, MigProfile
from gpuagent.gpu.sim.spec import mig_memory_mib
from gpuagent.gpu.sim.state import DriverState, GpuState, MigState

SUCCESS = int(pynvml.NVML_SUCCESS)
INVALID_ARGUMENT = int(pynvml.NVML_ERROR_INVALID_ARGUMENT)
NOT_SUPPORTED = int(pynvml.NVML_ERROR_NOT_SUPPORTED)
NOT_FOUND = int(pynvml.NVML_ERROR_NOT_FOUND)
GPU_IS_LOST = int(pynvml.NVML_ERROR_GPU_IS_LOST)
VERSION_MISMATCH = int(pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
#: Most MIG devices one GPU can hold (``nvmlDeviceGetMaxMigDeviceCount``).
MAX_MIG_DEVICES = MIG_COMPUTE_SLICES


def _max_count(st: DriverState, gpu: GpuState, ref: object) -> int:
    if gpu.mig is not None:
        return NOT_SUPPORTED
    # nvml.h: "Returns zero if MIG is not supported or enabled."
    out(ref).value = MAX_MIG_DEVICES if gpu.mig_enabled else 0
    return SUCCESS


def _handle_by_index(st: DriverState, gpu: GpuState, index: object, ref: object) -> int:
    if gpu.mig is not None:
        return NOT_SUPPORTED
    i = as_int(index)
    if not 0 <= i < MAX_MIG_DEVICES:
        return INVALID_ARGUMENT
    if i >= len(gpu.migs):
        return NOT_FOUND
    out(ref).contents = gpu.migs[i].device.handle
    return SUCCESS


def _is_mig_handle(st: DriverState, gpu: GpuState, ref: object) -> int:
    out(ref).value = 0 if gpu.mig is None else 1
    return SUCCESS


def _gpu_instance_id(st: DriverState, gpu: GpuState, ref: object) -> int:
    if gpu.mig is None:
        return NOT_SUPPORTED
    out(ref).value = gpu.mig.spec.gpu_instance_id
    return SUCCESS


def _compute_instance_id(st: DriverState, gpu: GpuState, ref: object) -> int:
    if gpu.mig is None:
        return NOT_SUPPORTED
    out(ref).value = gpu.mig.spec.compute_instance_id
    return SUCCESS


def _parent_handle(st: DriverState, gpu: GpuState, ref: object) -> int:
    if gpu.mig is None:
        return NOT_SUPPORTED
    out(ref).contents = gpu.mig.parent.handle
    return SUCCESS


def _attributes(st: DriverState, gpu: GpuState, ref: object) -> int:
    if gpu.mig is None:
        return NOT_SUPPORTED
    shape = gpu.mig.spec.profile
    engines = shape.engines
    attrs = out(ref)
    attrs.multiprocessorCount = shape.multiprocessors
    attrs.sharedCopyEngineCount = engines["copy"]
    attrs.sharedDecoderCount = engines["decoders"]
    attrs.sharedEncoderCount = engines["encoders"]
    attrs.sharedJpegCount = engines["jpeg"]
    attrs.sharedOfaCount = engines["ofa"]
    attrs.gpuInstanceSliceCount = shape.slices
    attrs.computeInstanceSliceCount = shape.slices
    attrs.memorySizeMB = gpu.mig.spec.memory_mib
    return SUCCESS


def _find_profile(gpu: GpuState, index: object, *, needs_mode: bool = True) -> MigProfile | int:
    """The GPU's MIG profile with NVML profile index ``index``, or the error code to return.

    nvml.h: the versioned call answers NOT_SUPPORTED while MIG mode is off, the first one only
    for a device without MIG support (``needs_mode`` False).
    """
    i = as_int(index)
    if not 0 <= i < pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT:
        return INVALID_ARGUMENT
    if gpu.mig is not None or (needs_mode and not gpu.mig_enabled):
        return NOT_SUPPORTED
    found = next((p for p in gpu.spec.profile.mig_profiles if p.gi_profile == i), None)
    return NOT_SUPPORTED if found is None else found


def _fill_profile_info(info: Any, gpu: GpuState, shape: MigProfile) -> None:
    engines = shape.engines
    info.id = shape.profile_id
    info.isP2pSupported = 0
    info.sliceCount = shape.slices
    info.instanceCount = shape.max_instances
    info.multiprocessorCount = shape.multiprocessors
    info.copyEngineCount = engines["copy"]
    info.decoderCount = engines["decoders"]
    info.encoderCount = engines["encoders"]
    info.jpegCount = engines["jpeg"]
    info.ofaCount = engines["ofa"]
    info.memorySizeMB = mig_memory_mib(shape, gpu.spec.profile, gpu.spec.memory_mib)


def _profile_info(st: DriverState, gpu: GpuState, index: object, ref: object) -> int:
    found = _find_profile(gpu, index, needs_mode=False)
    if isinstance(found, int):
        return found
    _fill_profile_info(out(ref), gpu, found)
    return SUCCESS


def _profile_info_v(st: DriverState, gpu: GpuState, index: object, ref: object) -> int:
    info = out(ref)
    if info.version != pynvml.nvmlGpuInstanceProfileInfo_v2:
        return VERSION_MISMATCH
    found = _find_profile(gpu, index)
    if isinstance(found, int):
        return found
    _fill_profile_info(info, gpu, found)
    info.name = f"MIG {found.name}".encode()
    return SUCCESS


def _gpu_instance_by_id(st: DriverState, gpu: GpuState, gi_id: object, ref: object) -> int:
    if not gpu.mig_enabled:
        return NOT_SUPPORTED
    wanted = as_int(gi_id)
    mig = next((m for m in gpu.gpu_instances if m.spec.gpu_instance_id == wanted), None)
    if mig is None:
        return NOT_FOUND
    out(ref).contents = mig.gpu_instance
    return SUCCESS


def _live(mig: MigState | None) -> MigState | int:
    if mig is None:
        return INVALID_ARGUMENT
    if mig.parent.lost:
        return GPU_IS_LOST
    return mig


def _gpu_instance_info(st: DriverState, handle: object, ref: object) -> int:
    mig = _live(st.gpu_instance_of(handle))
    if isinstance(mig, int):
        return mig
    info = out(ref)
    info.device = pynvml.c_nvmlDevice_t(mig.parent.handle)
    info.id = mig.spec.gpu_instance_id
    info.profileId = mig.spec.profile.profile_id
    info.placement.start = mig.spec.start
    info.placement.size = mig.spec.profile.memory_slices
    return SUCCESS


def _compute_instance_by_id(st: DriverState, handle: object, ci_id: object, ref: object) -> int:
    mig = _live(st.gpu_instance_of(handle))
    if isinstance(mig, int):
        return mig
    if mig not in mig.parent.migs or as_int(ci_id) != mig.spec.compute_instance_id:
        return NOT_FOUND
    out(ref).contents = mig.compute_instance
    return SUCCESS


def _compute_instance_info(st: DriverState, handle: object, ref: object) -> int:
    mig = _live(st.compute_instance_of(handle))
    if isinstance(mig, int):
        return mig
    info = out(ref)
    info.device = pynvml.c_nvmlDevice_t(mig.parent.handle)
    info.gpuInstance = pynvml.c_nvmlGpuInstance_t(mig.gpu_instance)
    info.id = mig.spec.compute_instance_id
    info.profileId = mig.spec.profile.ci_profile
    info.placement.start = 0
    info.placement.size = mig.spec.profile.slices
    return SUCCESS


SYMBOLS: dict[str, Symbol] = {
    "nvmlDeviceGetMaxMigDeviceCount": device(_max_count),
    "nvmlDeviceGetMigDeviceHandleByIndex": device(_handle_by_index),
    "nvmlDeviceIsMigDeviceHandle": device(_is_mig_handle),
    "nvmlDeviceGetGpuInstanceId": device(_gpu_instance_id),
    "nvmlDeviceGetComputeInstanceId": device(_compute_instance_id),
    "nvmlDeviceGetDeviceHandleFromMigDeviceHandle": device(_parent_handle),
    "nvmlDeviceGetAttributes_v2": device(_attributes),
    "nvmlDeviceGetGpuInstanceProfileInfo": device(_profile_info),
    "nvmlDeviceGetGpuInstanceProfileInfoV": device(_profile_info_v),
    "nvmlDeviceGetGpuInstanceById": device(_gpu_instance_by_id),
    "nvmlGpuInstanceGetInfo": Symbol(_gpu_instance_info),
    "nvmlGpuInstanceGetComputeInstanceById": Symbol(_compute_instance_by_id),
    "nvmlComputeInstanceGetInfo_v2": Symbol(_compute_instance_info),
}
