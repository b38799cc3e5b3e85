"""MIG management entry points of the simulated ``libnvidia-ml``: MIG mode, placements, and
making and destroying GPU and compute instances, as strict as nvml.h describes them.

* Every call here "requires privileged user" (nvml.h): NO_PERMISSION unless the node grants
  CAP_SYS_ADMIN (``cap_sys_admin`` in ``--sim-config``).
* ``nvmlDeviceSetMigMode``: the mode becomes pending; Hopper and later activate it at once, Ampere
  only on a GPU reset (the ``recover`` fault), ``activationStatus`` RESET_REQUIRED meanwhile. A GPU
  with processes, or with GPU instances, is not switched: ``activationStatus`` IN_USE.
* ``nvmlDeviceGetGpuInstancePossiblePlacements_v2``: the profile's placements whatever the MIG
  mode (nvml.h), ``placements`` NULL for the count only.
* ``nvmlDeviceCreateGpuInstanceWithPlacement``: NOT_SUPPORTED without MIG mode, INVALID_ARGUMENT
  for an unknown profile ID or a placement the profile does not offer, INSUFFICIENT_RESOURCES for
  memory slices another instance occupies (the driver answers an overlap so, not ALREADY_EXISTS),
  the profile's instance limit, or compute slices exhausted.
* ``nvmlGpuInstanceCreateComputeInstance``: the compute instance spanning the GPU instance (the
  one profile the simulator offers); INSUFFICIENT_RESOURCES when it exists. Its MIG device then
  answers (a new ``MIG-`` UUID each time).
* ``nvmlComputeInstanceDestroy``/``nvmlGpuInstanceDestroy``: IN_USE while processes run on the
  instance, or (GPU instance) while it holds a compute instance.

Each takes as long as the node's latency for its symbol (hundreds of milliseconds by default for
the makers, see :data:`gpuagent.gpu.sim.spec.DEFAULT_CALL_LATENCY_S`).
"""

from __future__ import annotations

import ctypes
from dataclasses import replace
from typing import Any

import pynvml

from gpuagent.gpu.sim._abi import BadArgument, Symbol, as_int, device, out
from gpuagent.gpu.sim.profiles import (
    MIG_COMPUTE_SLICES,
    NVML_DEVICE_ARCH_HOPPER,
    MigProfile,
    gpu_instance_id,
)
from gpuagent.gpu.sim.spec import SimMigSpec, mig_memory_mib, mig_uuid
from gpuagent.gpu.sim.state import DriverState, GpuState, MigState

SUCCESS = int(pynvml.NVML_SUCCESS)
INVALID_ARGUMENT = int(pynvml.NVML_ERROR_INVALID_ARGUMENT)
NOT_SUPPORTED = int(pynvml.NVML_ERROR_NOT_SUPPORTED)
NO_PERMISSION = int(pynvml.NVML_ERROR_NO_PERMISSION)
GPU_IS_LOST = int(pynvml.NVML_ERROR_GPU_IS_LOST)
IN_USE = int(pynvml.NVML_ERROR_IN_USE)
RESET_REQUIRED = int(pynvml.NVML_ERROR_RESET_REQUIRED)
INSUFFICIENT_RESOURCES = int(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
VERSION_MISMATCH = int(pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
MODES = (int(pynvml.NVML_DEVICE_MIG_DISABLE), int(pynvml.NVML_DEVICE_MIG_ENABLE))


def _shape(gpu: GpuState, profile_id: object) -> MigProfile | None:
    """The GPU's GPU-instance profile with ID ``profile_id`` (nvidia-smi's "ID"), if any."""
    wanted = as_int(profile_id)
    return next((p for p in gpu.spec.profile.mig_profiles if p.profile_id == wanted), None)


def _whole(gpu: GpuState) -> bool:
    """A full GPU of a model with MIG support (not a MIG device handle)."""
    return gpu.mig is None and bool(gpu.spec.profile.mig_profiles)


def _set_mig_mode(st: DriverState, gpu: GpuState, mode: object, status_ref: object) -> int:
    status = out(status_ref)
    wanted = as_int(mode)
    if wanted not in MODES:
        return INVALID_ARGUMENT
    if not _whole(gpu):
        return NOT_SUPPORTED
    if not st.node.cap_sys_admin:
        return NO_PERMISSION
    gpu.mig_pending = wanted
    if wanted == gpu.mig_mode:
        status.value = SUCCESS
    elif gpu.gpu_instances or st.processes.on(gpu):
        status.value = IN_USE  # stays pending; nvml.h: idle the device and retry
    elif gpu.spec.architecture < NVML_DEVICE_ARCH_HOPPER:
        status.value = RESET_REQUIRED  # Ampere: the mode takes a GPU reset
    else:
        gpu.mig_mode = wanted
        status.value = SUCCESS
    return SUCCESS


def _placements(
    st: DriverState, gpu: GpuState, profile_id: object, buffer: object, count_ref: object
) -> int:
    count = out(count_ref)
    if not _whole(gpu):
        return NOT_SUPPORTED
    shape = _shape(gpu, profile_id)
    if shape is None:
        return NOT_SUPPORTED
    if not st.node.cap_sys_admin:
        return NO_PERMISSION
    starts = shape.placements
    if buffer is not None:
        if not isinstance(buffer, ctypes.Array) or len(buffer) < len(starts):
            raise BadArgument("placements must hold every placement of the profile")
        for slot, start in zip(buffer, starts, strict=False):
            slot.start, slot.size = start, shape.memory_slices
    count.value = len(starts)
    return SUCCESS


def _occupied(gpu: GpuState) -> set[int]:
    return {
        s
        for m in gpu.gpu_instances
        for s in range(m.spec.start, m.spec.start + m.spec.profile.memory_slices)
    }


def _in_mig_mode(st: DriverState, gpu: GpuState, profile_id: object) -> MigProfile | int:
    """The profile ``profile_id`` of a full GPU in MIG mode, or the error the driver answers."""
    if gpu.mig is not None:
        return NOT_SUPPORTED
    shape = _shape(gpu, profile_id)
    if shape is None:
        return INVALID_ARGUMENT
    if not st.node.cap_sys_admin:
        return NO_PERMISSION
    return shape if gpu.mig_enabled else NOT_SUPPORTED


def _create_gpu_instance(
    st: DriverState, gpu: GpuState, profile_id: object, placement_ref: object, ref: object
) -> int:
    placement = out(placement_ref)
    handle = out(ref)
    shape = _in_mig_mode(st, gpu, profile_id)
    if isinstance(shape, int):
        return shape
    start, size = int(placement.start), int(placement.size)
    if start not in shape.placements or size != shape.memory_slices:
        return INVALID_ARGUMENT
    same = sum(1 for m in gpu.gpu_instances if m.spec.profile is shape)
    slices = sum(m.spec.profile.slices for m in gpu.gpu_instances)
    if (
        _occupied(gpu) & set(range(start, start + size))
        or same >= shape.max_instances
        or slices + shape.slices > MIG_COMPUTE_SLICES
    ):
        return INSUFFICIENT_RESOURCES
    spec = SimMigSpec(
        profile=shape,
        gpu_instance_id=gpu_instance_id(start, size),
        compute_instance_id=0,
        start=start,
        memory_mib=mig_memory_mib(shape, gpu.spec.profile, gpu.spec.memory_mib),
        uuid="",
    )
    mig = st.new_gpu_instance(gpu, spec)
    gpu.bare = (*gpu.bare, mig)
    handle.contents = mig.gpu_instance
    return SUCCESS


def _gpu_instances(
    st: DriverState, gpu: GpuState, profile_id: object, buffer: object, count_ref: object
) -> int:
    count = out(count_ref)
    shape = _in_mig_mode(st, gpu, profile_id)
    if isinstance(shape, int):
        return shape
    found = sorted(
        (m for m in gpu.gpu_instances if m.spec.profile is shape),
        key=lambda m: m.spec.gpu_instance_id,
    )
    if not isinstance(buffer, ctypes.Array) or len(buffer) < len(found):
        raise BadArgument("gpuInstances must hold the profile's instance count")
    for i, mig in enumerate(found):
        buffer[i] = ctypes.pointer(mig.gpu_instance)
    count.value = len(found)
    return SUCCESS


def _instance(mig: MigState | None) -> MigState | int:
    if mig is None:
        return INVALID_ARGUMENT
    if mig.parent.lost:
        return GPU_IS_LOST
    return mig


def _destroy_gpu_instance(st: DriverState, handle: object) -> int:
    mig = _instance(st.gpu_instance_of(handle))
    if isinstance(mig, int):
        return mig
    if not st.node.cap_sys_admin:
        return NO_PERMISSION
    parent = mig.parent
    if mig in parent.migs:
        return IN_USE  # compute instances are active on it
    st.drop_gpu_instance(mig)
    parent.bare = tuple(m for m in parent.bare if m is not mig)
    return SUCCESS


def _ci_profile_info(
    st: DriverState, handle: object, profile: object, engines: object, ref: object
) -> int:
    mig = _instance(st.gpu_instance_of(handle))
    if isinstance(mig, int):
        return mig
    index, engine = as_int(profile), as_int(engines)
    info = out(ref)
    if not 0 <= index < pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT:
        return INVALID_ARGUMENT
    if not 0 <= engine < pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_COUNT:
        return INVALID_ARGUMENT
    shape = mig.spec.profile
    if index != shape.ci_profile:
        return NOT_SUPPORTED  # the simulator offers the compute instance spanning its GPU instance
    info.id = shape.ci_profile
    info.sliceCount = shape.slices
    info.instanceCount = 1
    info.multiprocessorCount = shape.multiprocessors
    engines = shape.engines
    info.sharedCopyEngineCount = engines["copy"]
    info.sharedDecoderCount = engines["decoders"]
    info.sharedEncoderCount = engines["encoders"]
    info.sharedJpegCount = engines["jpeg"]
    info.sharedOfaCount = engines["ofa"]
    return SUCCESS


def _ci_profile_info_v(
    st: DriverState, handle: object, profile: object, engines: object, ref: object
) -> int:
    info: Any = out(ref)
    if info.version != pynvml.nvmlComputeInstanceProfileInfo_v2:
        return VERSION_MISMATCH
    code = _ci_profile_info(st, handle, profile, engines, ref)
    mig = st.gpu_instance_of(handle)
    if code == SUCCESS and mig is not None:
        info.name = f"MIG {mig.spec.name}".encode()
    return code


def _create_compute_instance(
    st: DriverState, handle: object, profile_id: object, ref: object
) -> int:
    mig = _instance(st.gpu_instance_of(handle))
    if isinstance(mig, int):
        return mig
    target = out(ref)
    if not st.node.cap_sys_admin:
        return NO_PERMISSION
    if as_int(profile_id) != mig.spec.profile.ci_profile:
        return NOT_SUPPORTED
    parent = mig.parent
    if mig in parent.migs:
        return INSUFFICIENT_RESOURCES
    st.made += 1
    made = mig_uuid(parent.spec.uuid, mig.spec.gpu_instance_id, 0, st.made)
    st.add_compute_instance(mig, replace(mig.spec, uuid=made, compute_instance_id=0))
    parent.bare = tuple(m for m in parent.bare if m is not mig)
    parent.migs = tuple(sorted((*parent.migs, mig), key=lambda m: m.spec.gpu_instance_id))
    target.contents = mig.compute_instance
    return SUCCESS


def _destroy_compute_instance(st: DriverState, handle: object) -> int:
    mig = _instance(st.compute_instance_of(handle))
    if isinstance(mig, int):
        return mig
    if not st.node.cap_sys_admin:
        return NO_PERMISSION
    if st.processes.on(mig.device):
        return IN_USE
    parent = mig.parent
    st.drop_compute_instance(mig)
    parent.migs = tuple(m for m in parent.migs if m is not mig)
    parent.bare = (*parent.bare, mig)
    return SUCCESS


SYMBOLS: dict[str, Symbol] = {
    "nvmlDeviceSetMigMode": device(_set_mig_mode),
    "nvmlDeviceGetGpuInstancePossiblePlacements_v2": device(_placements),
    "nvmlDeviceCreateGpuInstanceWithPlacement": device(_create_gpu_instance),
    "nvmlDeviceGetGpuInstances": device(_gpu_instances),
    "nvmlGpuInstanceDestroy": Symbol(_destroy_gpu_instance),
    "nvmlGpuInstanceGetComputeInstanceProfileInfo": Symbol(_ci_profile_info),
    "nvmlGpuInstanceGetComputeInstanceProfileInfoV": Symbol(_ci_profile_info_v),
    "nvmlGpuInstanceCreateComputeInstance": Symbol(_create_compute_instance),
    "nvmlComputeInstanceDestroy": Symbol(_destroy_compute_instance),
}
