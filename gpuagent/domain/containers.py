"""``Allocate``: validating a container's device IDs and shaping what the container receives.

The response for each device-list strategy is NVIDIA's (``internal/plugin/server.go``
``getAllocateResponse``, read at NVIDIA/k8s-device-plugin 1b826acc, 2026-08-19): ``envvar`` sets
``NVIDIA_VISIBLE_DEVICES``; ``volume-mounts`` mounts ``/dev/null`` at
``/var/run/nvidia-container-devices/<id>``; ``cdi-annotations`` sets one
``cdi.k8s.io/nvidia-device-plugin_<id>`` annotation; ``cdi-cri`` fills ``cdi_devices``;
``--pass-device-specs`` adds the device nodes — unless every strategy is a CDI one: NVIDIA's
plugin then returns the CDI names alone (``AllCDIEnabled`` returns before the device specs), the
CDI spec bringing the nodes, and so does this. Replica IDs are de-annotated first.

A container asking for devices of two resources (two MIG profiles, NVIDIA #728) gets one response
per resource, which the kubelet merges: maps and device specs first value wins, ``cdi_devices``
concatenated. So ``cdi-cri``, ``cdi-annotations`` (one key per response) and ``volume-mounts``
(one mount per device, same variable value) carry every device, while with ``envvar`` alone the
second resource's ``NVIDIA_VISIBLE_DEVICES`` is dropped by the kubelet: use a CDI strategy or
``volume-mounts`` for containers that mix MIG profiles.

A device shared through MPS (``sharing.mps``) brings NVIDIA's additions whatever the strategy,
CDI alone included (``internal/plugin/mps.go`` ``updateReponse``, before ``AllCDIEnabled``
returns): ``CUDA_MPS_PIPE_DIRECTORY`` set to ``/mps/<resource>/pipe``, that directory mounted
from ``<mps-root>/<resource>/pipe`` and ``/dev/shm`` from ``<mps-root>/shm``, both writable.
"""

from __future__ import annotations

import posixpath
import re
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from gpuagent.domain.allocation import (
    VISIBLE_DEVICES,
    VOLUME_MOUNT_HOST_PATH,
    VOLUME_MOUNT_ROOT,
    ContainerAllocation,
    DeviceSpec,
    DuplicateDevicesError,
    EmptyRequestError,
    MountSpec,
    SharedRequestTooLargeError,
    UnhealthyDevicesError,
    UnknownDevicesError,
)
from gpuagent.domain.devices import Device, IdStrategy
from gpuagent.domain.errors import SettingError
from gpuagent.domain.mps import CONTAINER_SHM, PIPE_ENV, MpsDirs
from gpuagent.domain.resources import Resource

__all__ = [
    "CDI_ANNOTATION_PREFIX",
    "CDI_CLASS",
    "CDI_KIND",
    "CDI_SPEC_DIR",
    "CDI_VENDOR",
    "CONTROL_NODES",
    "TOOLKIT_CDI_KIND",
    "ContainerSettings",
    "DeviceListStrategy",
    "allocate",
    "annotation_key",
    "cdi_name",
    "container_allocation",
    "validate_request",
]

CDI_SPEC_DIR = "/var/run/cdi"  # where CDI registries read specs written at run time
CDI_VENDOR = "k8s.device-plugin.nvidia.com"
CDI_CLASS = "gpu"
CDI_KIND = f"{CDI_VENDOR}/{CDI_CLASS}"
TOOLKIT_CDI_KIND = "nvidia.com/gpu"  # the NVIDIA container toolkit's generated spec
CDI_ANNOTATION_PREFIX = "cdi.k8s.io/"  # NVIDIA's DefaultCDIAnnotationPrefix
CDI_PLUGIN_NAME = "nvidia-device-plugin"
MAX_ANNOTATION_NAME = 63  # CDI's AnnotationKey limit on "<plugin>_<id>"
# The driver's control nodes, in the order NVIDIA passes them; each only where it exists.
CONTROL_NODES = (
    "/dev/nvidiactl",
    "/dev/nvidia-uvm",
    "/dev/nvidia-uvm-tools",
    "/dev/nvidia-modeset",
)
_RESPONSE_NAMESPACE = uuid.UUID("6f1b8e0a-3c2d-5e4f-9a7b-8c6d5e4f3a2b")
_PREFIX = re.compile(r"([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*)?/")
_ALNUM = re.compile(r"[A-Za-z0-9]")


class DeviceListStrategy(StrEnum):
    """How the container is told its devices (``--device-list-strategy``, a list)."""

    ENVVAR = "envvar"
    VOLUME_MOUNTS = "volume-mounts"
    CDI_ANNOTATIONS = "cdi-annotations"
    CDI_CRI = "cdi-cri"


_CDI_STRATEGIES = (DeviceListStrategy.CDI_ANNOTATIONS, DeviceListStrategy.CDI_CRI)


@dataclass(frozen=True, slots=True)
class ContainerSettings:
    """What shapes the container's view.

    ``dev_root`` is the host directory under which ``/dev`` lives (NVIDIA's ``--dev-root``,
    defaulting to the driver root); ``control_nodes`` are those of :data:`CONTROL_NODES` that
    exist there, found once by the caller (the domain does no I/O). ``cdi_kind`` is the kind of
    the CDI names handed out: the agent's own spec's, or the container toolkit's
    (:data:`TOOLKIT_CDI_KIND`) when the devices of its generated spec are used instead.
    ``mps``: the MPS root's layout, for the devices shared through MPS.
    """

    strategies: tuple[DeviceListStrategy, ...] = (DeviceListStrategy.ENVVAR,)
    id_strategy: IdStrategy = IdStrategy.UUID
    pass_device_specs: bool = False
    dev_root: str = "/"
    control_nodes: tuple[str, ...] = CONTROL_NODES
    cdi_annotation_prefix: str = CDI_ANNOTATION_PREFIX
    cdi_kind: str = CDI_KIND
    mps: MpsDirs = field(default_factory=MpsDirs)

    def __post_init__(self) -> None:
        if not self.strategies:
            raise SettingError("device-list-strategy", "at least one strategy is needed")
        if all(s in self.strategies for s in _CDI_STRATEGIES):
            raise SettingError(
                "device-list-strategy", "cdi-annotations and cdi-cri cannot be combined"
            )
        if not _PREFIX.fullmatch(self.cdi_annotation_prefix):
            raise SettingError(
                "cdi-annotation-prefix",
                f"expected an optional DNS subdomain followed by '/', got "
                f"{self.cdi_annotation_prefix!r}",
            )
        if not posixpath.isabs(self.dev_root):
            raise SettingError("dev-root", f"must be an absolute path, got {self.dev_root!r}")

    def uses(self, strategy: DeviceListStrategy) -> bool:
        return strategy in self.strategies

    @property
    def only_cdi(self) -> bool:
        """Whether every strategy is a CDI one: the container gets its devices from the spec."""
        return all(s in _CDI_STRATEGIES for s in self.strategies)

    @property
    def uses_cdi(self) -> bool:
        """Whether containers are given CDI names (so the node needs the CDI spec)."""
        return self.uses(DeviceListStrategy.CDI_ANNOTATIONS) or self.uses(
            DeviceListStrategy.CDI_CRI
        )


def cdi_name(device_name: str, kind: str = CDI_KIND) -> str:
    """A GPU or MIG device's fully-qualified CDI name: ``k8s.device-plugin.nvidia.com/gpu=…``."""
    return f"{kind}={device_name}"


def annotation_key(response_id: str, prefix: str = CDI_ANNOTATION_PREFIX) -> str:
    """CDI's annotation key for one response: ``<prefix>nvidia-device-plugin_<id>``.

    The part after the prefix is capped at 63 characters and ends in a letter or digit, as CDI's
    ``AnnotationKey`` requires (it rejects longer names; here they are cut).
    """
    name = f"{CDI_PLUGIN_NAME}_{response_id.replace('/', '_')}"[:MAX_ANNOTATION_NAME]
    while name and not _ALNUM.fullmatch(name[-1]):
        name = name[:-1]
    return f"{prefix}{name}"


def validate_request(resource: Resource, ids: Sequence[str]) -> tuple[Device, ...]:
    """The devices ``ids`` name in ``resource``, or an :class:`AllocationError`.

    Checked in order, each naming every offending ID: empty request, duplicates, unknown IDs,
    more than one replica when ``failRequestsGreaterThanOne`` is set, unhealthy devices (their
    own error type, so the adapter can answer ``FAILED_PRECONDITION``).
    """
    if not ids:
        raise EmptyRequestError(f"the request for {resource.name} names no device IDs")
    duplicates = sorted(i for i, n in Counter(ids).items() if n > 1)
    if duplicates:
        raise DuplicateDevicesError(duplicates)
    unknown = [i for i in ids if resource.device(i) is None]
    if unknown:
        raise UnknownDevicesError(unknown, resource.name)
    devices = tuple(d for i in ids if (d := resource.device(i)) is not None)
    if (
        resource.fail_requests_greater_than_one
        and len(devices) > 1
        and any(d.is_replica for d in devices)
    ):
        raise SharedRequestTooLargeError(ids, resource.name)
    sick = [d for d in devices if not d.healthy]
    if sick:
        raise UnhealthyDevicesError([d.id for d in sick], [d.reason or "unhealthy" for d in sick])
    return devices


def container_allocation(
    resource: Resource,
    devices: Sequence[Device],
    settings: ContainerSettings,
    *,
    response_id: str | None = None,
) -> ContainerAllocation:
    """What hands ``devices`` (validated, from ``resource``) to a container.

    ``response_id`` makes the ``cdi-annotations`` key unique; by default it is derived from the
    resource name and device IDs, so it differs between the resources of one container and is
    the same when the kubelet re-issues an ``Allocate``.
    """
    # Two replicas of one GPU name the same device: the container sees it once.
    names = list(dict.fromkeys(d.name(settings.id_strategy) for d in devices))
    envs: dict[str, str] = {}
    mounts: list[MountSpec] = []
    annotations: dict[str, str] = {}
    cdi_devices: tuple[str, ...] = ()
    if settings.uses(DeviceListStrategy.ENVVAR):
        envs[VISIBLE_DEVICES] = ",".join(names)
    if settings.uses(DeviceListStrategy.VOLUME_MOUNTS):
        # The runtime takes the device list from the mounts; the variable points at them.
        envs[VISIBLE_DEVICES] = VOLUME_MOUNT_ROOT
        mounts.extend(
            MountSpec(f"{VOLUME_MOUNT_ROOT}/{name}", VOLUME_MOUNT_HOST_PATH, read_only=False)
            for name in names
        )
    qualified = tuple(cdi_name(name, settings.cdi_kind) for name in names)
    if settings.uses(DeviceListStrategy.CDI_ANNOTATIONS):
        if response_id is None:
            seed = "\0".join((resource.name, *(d.id for d in devices)))
            response_id = str(uuid.uuid5(_RESPONSE_NAMESPACE, seed))
        key = annotation_key(response_id, settings.cdi_annotation_prefix)
        annotations[key] = ",".join(qualified)
    if settings.uses(DeviceListStrategy.CDI_CRI):
        cdi_devices = qualified
    if resource.mps:
        pipe = settings.mps.container_pipe(resource.name)
        envs[PIPE_ENV] = pipe
        mounts.append(MountSpec(pipe, settings.mps.pipe(resource.name), read_only=False))
        mounts.append(MountSpec(CONTAINER_SHM, settings.mps.shm, read_only=False))
    # CDI names alone when every strategy is CDI: the spec brings the device nodes (NVIDIA's).
    passed = settings.pass_device_specs and not settings.only_cdi
    specs = _device_specs(devices, settings) if passed else ()
    return ContainerAllocation(
        envs=envs,
        mounts=tuple(mounts),
        devices=specs,
        annotations=annotations,
        cdi_devices=cdi_devices,
    )


def allocate(
    resource: Resource,
    ids: Sequence[str],
    settings: ContainerSettings,
    *,
    response_id: str | None = None,
) -> ContainerAllocation:
    """:func:`validate_request` then :func:`container_allocation`."""
    devices = validate_request(resource, ids)
    return container_allocation(resource, devices, settings, response_id=response_id)


def _device_specs(devices: Sequence[Device], settings: ContainerSettings) -> tuple[DeviceSpec, ...]:
    """Control nodes that exist, then each device's nodes, once each, under the dev root."""
    paths = [p for p in CONTROL_NODES if p in settings.control_nodes]
    for device in devices:
        paths.extend(device.device_nodes)
    return tuple(
        DeviceSpec(container_path=p, host_path=posixpath.join(settings.dev_root, p.lstrip("/")))
        for p in dict.fromkeys(paths)
    )
