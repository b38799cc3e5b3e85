"""Container names from the kubelet's container log links (``/var/log/containers``), pure.

For every container it starts, the kubelet makes a symbolic link in ``/var/log/containers``
named ``<pod>_<namespace>_<container>-<container id>.log`` (for cluster logging agents; it
removes the link with the container). The name alone joins a container ID — which a process's
cgroup gives (:mod:`gpuagent.domain.cgroups`) — to the pod, namespace and container names,
whatever the runtime: nothing is read through the link.

The parts cannot be confused: pod names are DNS subdomains and namespaces and container names DNS
labels (lower-case letters, digits, ``-``, and ``.`` in pod names only), so ``_`` separates them
and the ID is the hex after the last ``-``. A name longer than 255 bytes is cut to 251 before
``.log`` by the kubelet: a long pod name leaves only a prefix of the ID. Such a prefix (at least
:data:`MIN_PREFIX` hex digits) names a container only when it is the prefix of exactly one of the
IDs asked for.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from gpuagent.domain.devices import PodRef

__all__ = ["MIN_PREFIX", "LogLink", "LogLinkIndex", "index_links", "parse_log_link"]

#: The fewest hex digits of a cut ID that may still name a container.
MIN_PREFIX = 12
_FULL_ID = 64
_CUT_LENGTH = 255  # the kubelet's limit for the whole file name, ".log" included
_SUFFIX = ".log"
_LABEL = r"[a-z0-9](?:[-a-z0-9]{0,61}[a-z0-9])?"
_POD = re.compile(rf"{_LABEL}(?:\.{_LABEL})*")
_LABEL_RE = re.compile(_LABEL)
_HEX = re.compile(r"[0-9a-f]+")


@dataclass(frozen=True, slots=True)
class LogLink:
    """One link's meaning: a container ID (or, for a cut name, its prefix) and its names."""

    container_id: str
    names: PodRef

    @property
    def complete(self) -> bool:
        """Whether the link carries the whole ID (not a prefix of a cut name)."""
        return len(self.container_id) == _FULL_ID


def parse_log_link(name: str) -> LogLink | None:
    """The container a link's file name names, or ``None`` when it is not such a name."""
    if not name.endswith(_SUFFIX) or len(name.encode()) > _CUT_LENGTH:
        return None
    parts = name[: -len(_SUFFIX)].split("_")
    if len(parts) != 3:
        return None
    pod, namespace, rest = parts
    container, sep, container_id = rest.rpartition("-")
    if not sep or _HEX.fullmatch(container_id) is None:
        return None
    # Only the kubelet's cut leaves a shorter ID, and only in a name of the full length.
    cut = len(name.encode()) == _CUT_LENGTH and MIN_PREFIX <= len(container_id) < _FULL_ID
    if len(container_id) != _FULL_ID and not cut:
        return None
    if _POD.fullmatch(pod) is None or len(pod) > 253:
        return None
    if _LABEL_RE.fullmatch(namespace) is None or _LABEL_RE.fullmatch(container) is None:
        return None
    return LogLink(container_id, PodRef(namespace=namespace, pod=pod, container=container))


@dataclass(frozen=True, slots=True)
class LogLinkIndex:
    """The links of one listing: complete ones by container ID, and the cut ones."""

    complete: Mapping[str, PodRef] = field(default_factory=lambda: MappingProxyType({}))
    cut: tuple[LogLink, ...] = ()

    def __len__(self) -> int:
        return len(self.complete) + len(self.cut)

    def names_for(self, ids: Collection[str]) -> dict[str, PodRef]:
        """Names for those of ``ids`` the links name: by the whole ID, else by a cut ID's prefix
        that matches exactly one of ``ids`` (and no other link names that ID otherwise)."""
        found = {i: self.complete[i] for i in ids if i in self.complete}
        claims: dict[str, set[PodRef]] = {}
        for link in self.cut:
            matches = [i for i in ids if i.startswith(link.container_id)]
            if len(matches) == 1 and matches[0] not in found:
                claims.setdefault(matches[0], set()).add(link.names)
        for container_id, refs in claims.items():
            if len(refs) == 1:
                found[container_id] = next(iter(refs))
        return found


def index_links(names: Iterable[str]) -> LogLinkIndex:
    """Every container link among the file names of a listing (other names are ignored)."""
    complete: dict[str, PodRef] = {}
    cut: list[LogLink] = []
    for name in names:
        link = parse_log_link(name)
        if link is None:
            continue
        if link.complete:
            complete[link.container_id] = link.names
        else:
            cut.append(link)
    return LogLinkIndex(MappingProxyType(complete), tuple(cut))
