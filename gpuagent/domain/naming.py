"""Names the kubelet sees: extended resources, device IDs of replicas and MIG devices, sockets.

Resource names follow NVIDIA's ``NewResourceName`` (``internal/rm``): at most 63 characters in
all, a lower-case DNS subdomain outside ``kubernetes.io`` before the ``/``, a DNS subdomain after
it. One validator for every place a resource name is accepted (flags, config file, time-slicing
rules, MIG profiles), so they all agree.
"""

from __future__ import annotations

import re

__all__ = [
    "DEFAULT_DOMAIN",
    "DEFAULT_RESOURCE",
    "MAX_RESOURCE_NAME",
    "REPLICA_SEPARATOR",
    "SHARED_SUFFIX",
    "annotated_id",
    "mig_index",
    "mig_resource_name",
    "resource_name",
    "socket_name",
    "strip_replica",
]

DEFAULT_DOMAIN = "nvidia.com"
DEFAULT_RESOURCE = "nvidia.com/gpu"
SHARED_SUFFIX = ".shared"  # NVIDIA's DefaultSharedResourceNameSuffix
MAX_RESOURCE_NAME = 63  # NVIDIA's MaxResourceNameLength, for the whole name
REPLICA_SEPARATOR = "::"

_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS_SUBDOMAIN = re.compile(rf"{_DNS_LABEL}(\.{_DNS_LABEL})*")


def resource_name(name: str) -> str:
    """``name`` as NVIDIA's ``NewResourceName`` accepts it, ``nvidia.com/`` added if missing.

    The whole name is at most 63 characters; the domain is a DNS subdomain outside
    ``kubernetes.io`` and not ``requests.…`` (Kubernetes reserves it for quotas); the part after
    ``/`` is a DNS subdomain too. Raises :class:`ValueError`.
    """
    full = name if "/" in name else f"{DEFAULT_DOMAIN}/{name}"
    domain, _, suffix = full.partition("/")
    if len(full) > MAX_RESOURCE_NAME:
        raise ValueError(f"{full!r} is longer than {MAX_RESOURCE_NAME} characters")
    if not _DNS_SUBDOMAIN.fullmatch(domain):
        raise ValueError(f"domain {domain!r} of {full!r} is not a lower-case DNS subdomain")
    if domain == "kubernetes.io" or domain.endswith(".kubernetes.io"):
        raise ValueError(f"{full!r} is in the kubernetes.io namespace")
    if full.startswith("requests."):
        raise ValueError(f"{full!r} begins with 'requests.' (reserved for quotas)")
    if not _DNS_SUBDOMAIN.fullmatch(suffix):
        raise ValueError(
            f"name {suffix!r} of {full!r} must be a DNS subdomain: lower-case letters, digits, "
            "'-' and '.', starting and ending with a letter or digit"
        )
    return full


def mig_resource_name(profile: str, domain: str = DEFAULT_DOMAIN) -> str:
    """NVIDIA's mixed-strategy name: ``nvidia.com/mig-1g.10gb``, ``+`` spelled ``.``."""
    return resource_name(f"{domain}/mig-{profile}".replace("+", "."))


def mig_index(gpu_index: int, position: int) -> str:
    """NVIDIA's index form of a MIG device: ``"<gpu>:<n>"``, n its place on the GPU."""
    return f"{gpu_index}:{position}"


def annotated_id(device_id: str, replica: int) -> str:
    """A replica's kubelet ID (NVIDIA's ``NewAnnotatedID``): ``<id>::<n>``."""
    return f"{device_id}{REPLICA_SEPARATOR}{replica}"


def strip_replica(device_id: str) -> str:
    """The device ID without its ``::<n>`` replica annotation."""
    return device_id.split(REPLICA_SEPARATOR, 1)[0]


def socket_name(resource: str) -> str:
    """The plugin socket's file name for a resource, as NVIDIA's plugin names it.

    ``nvidia.com/gpu`` → ``nvidia-gpu.sock``; other vendors' domains are spelled out so two agents
    serving different resources never collide.
    """
    domain, _, name = resource.partition("/")
    prefix = "nvidia" if domain == "nvidia.com" else domain.replace(".", "_")
    return f"{prefix}-{name}.sock"
