"""Pod and container names behind container IDs, from the runtime's CRI API (``runtime.v1``).

The kubelet labels every container it creates with ``io.kubernetes.pod.namespace``,
``io.kubernetes.pod.name``, ``io.kubernetes.pod.uid`` and ``io.kubernetes.container.name``;
``RuntimeService/ListContainers`` returns them with each container's ID. The answer is cached:

* :meth:`CriClient.resolve` refreshes the cache only when asked for an ID it has never seen
  (a container that started since the last refresh) — never on a timer, never for a scrape;
* an ID still unknown after a refresh (a container outside Kubernetes, or one already gone) does
  not cause another refresh;
* refreshes are at least ``min_interval`` apart, and after a failure (socket absent, runtime down)
  the next try waits ``retry_interval``; the last good answer is kept meanwhile.

The socket is ``--cri-socket``, or by default the first of containerd's and CRI-O's that exists
(looked for again at each refresh until one does). A recreated socket (the runtime restarted) gets
a new connection. Responses are bounded at :data:`MAX_RESPONSE_BYTES`.

The CRI is the second source of names, after the kubelet's container log links
(:mod:`gpuagent.runtime.loglinks`), and an optional one: the DaemonSet mounts no runtime socket.
So when no socket was configured and neither default exists, no call is made and nothing is
counted as an error; one info line says names come from the log links only. A configured socket
that is absent is an error (counted, and a warning once).
"""

from __future__ import annotations

import contextlib
import os
import stat
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

import structlog
from grpclib.client import Channel
from grpclib.encoding.proto import ProtoCodec

from gpuagent._proto.runtime import v1 as pb
from gpuagent.domain.devices import PodRef
from gpuagent.logs import ProblemLog

__all__ = [
    "DEFAULT_SOCKETS",
    "MAX_RESPONSE_BYTES",
    "CriClient",
    "ContainerNames",
    "names_from_labels",
]

log = structlog.get_logger("gpuagent.cri")

#: containerd's and CRI-O's default CRI sockets, in the order they are looked for.
DEFAULT_SOCKETS = (Path("/run/containerd/containerd.sock"), Path("/var/run/crio/crio.sock"))
MAX_RESPONSE_BYTES = 64 * 1024 * 1024
POD_NAMESPACE = "io.kubernetes.pod.namespace"
POD_NAME = "io.kubernetes.pod.name"
POD_UID = "io.kubernetes.pod.uid"
CONTAINER_NAME = "io.kubernetes.container.name"
_NO_SOCKET = "no CRI socket"


class _BoundedCodec(ProtoCodec):
    """grpclib's protobuf codec, refusing to decode a response above ``limit`` bytes."""

    def __init__(self, limit: int) -> None:
        self._limit = limit

    def decode(self, data: bytes, message_type: Any) -> Any:
        if len(data) > self._limit:
            raise ValueError(f"response of {len(data)} bytes exceeds {self._limit}")
        return super().decode(data, message_type)


ContainerNames = Mapping[str, PodRef]


def names_from_labels(containers: Sequence[pb.Container]) -> dict[str, PodRef]:
    """Container ID → names, for containers the kubelet created (carrying its labels)."""
    names: dict[str, PodRef] = {}
    for container in containers:
        labels = container.labels
        pod, namespace = labels.get(POD_NAME, ""), labels.get(POD_NAMESPACE, "")
        name = labels.get(CONTAINER_NAME) or (
            container.metadata.name if container.metadata is not None else ""
        )
        if container.id and pod and namespace and name:
            names[container.id] = PodRef(namespace=namespace, pod=pod, container=name)
    return names


class CriClient:
    """Caches the names of the node's containers, refreshed on demand (see the module doc)."""

    def __init__(
        self,
        socket_path: Path | None = None,
        *,
        candidates: Sequence[Path] = DEFAULT_SOCKETS,
        timeout: float = 5.0,
        min_interval: float = 2.0,
        retry_interval: float = 30.0,
        max_response_bytes: int = MAX_RESPONSE_BYTES,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._configured = socket_path
        self._candidates = tuple(candidates)
        self._timeout = timeout
        self._min_interval = min_interval
        self._retry_interval = retry_interval
        self._max_response = max_response_bytes
        self._monotonic = monotonic
        self._names: Mapping[str, PodRef] = MappingProxyType({})
        self._missing: set[str] = set()  # IDs the last good refresh did not list
        self._channel: Channel | None = None
        self._identity: tuple[str, int, int] | None = None
        self._next_allowed = float("-inf")
        self._problems = ProblemLog(log)
        self.requests = 0
        self.errors = 0
        self.socket: Path | None = None  # the socket in use (or last tried)

    @property
    def names(self) -> Mapping[str, PodRef]:
        """The cached names by container ID."""
        return self._names

    async def resolve(self, ids: Collection[str]) -> Mapping[str, PodRef]:
        """Names for ``ids`` from the cache, refreshed first if one of them was never seen."""
        unseen = [i for i in ids if i not in self._names and i not in self._missing]
        if unseen and self._monotonic() >= self._next_allowed and await self.refresh():
            self._missing = {i for i in ids if i not in self._names}
        return self._names

    async def refresh(self) -> bool:
        """One ``ListContainers``; ``False`` (logged once per problem) when it failed."""
        self._next_allowed = self._monotonic() + self._min_interval
        path = self._socket_path()
        identity = _socket_identity(path) if path is not None else None
        if path is None or identity is None:
            self.close()
            self._identity = None
            if path is None:
                return self._no_socket()
            return self._failed(f"CRI socket absent ({path}); containers have no names")
        if identity != self._identity:
            self.close()
            self._identity = identity
        if self._channel is None:
            self._channel = Channel(path=str(path), codec=_BoundedCodec(self._max_response))
        self.requests += 1
        try:
            response = await pb.RuntimeServiceStub(self._channel).list_containers(
                pb.ListContainersRequest(), timeout=self._timeout
            )
        except Exception as exc:  # any transport, status or decode error: keep the old names
            self.close()
            return self._failed(f"CRI ListContainers failed: {type(exc).__name__}: {exc}")
        self._names = MappingProxyType(names_from_labels(response.containers))
        again = "found" if (self._problems.problem or "").startswith(_NO_SOCKET) else "works again"
        self._problems.recovered(f"CRI ListContainers {again}", socket=str(path))
        return True

    async def version(self) -> tuple[str, str]:
        """The runtime's name and version (``Version``); raises on any failure."""
        path = self._socket_path()
        if path is None:
            raise FileNotFoundError("no CRI socket")
        channel = Channel(path=str(path), codec=_BoundedCodec(self._max_response))
        try:
            response = await pb.RuntimeServiceStub(channel).version(
                pb.VersionRequest(version="v1"), timeout=self._timeout
            )
        finally:
            channel.close()
        return response.runtime_name, response.runtime_version

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    def _socket_path(self) -> Path | None:
        if self._configured is not None:
            self.socket = self._configured
            return self._configured
        for candidate in self._candidates:
            if _socket_identity(candidate) is not None:
                self.socket = candidate
                return candidate
        self.socket = None
        return None

    def _no_socket(self) -> bool:
        """No socket configured and no default one: the CRI is simply not there (no error)."""
        self._next_allowed = self._monotonic() + self._retry_interval
        where = " or ".join(map(str, self._candidates))
        self._problems.failed(
            f"{_NO_SOCKET} ({where}): container names from the kubelet's log links only",
            level="info",
        )
        return False

    def _failed(self, problem: str) -> bool:
        self.errors += 1
        self._next_allowed = self._monotonic() + self._retry_interval
        self._problems.failed(problem, retry_in_s=self._retry_interval)
        return False


def _socket_identity(path: Path) -> tuple[str, int, int] | None:
    with contextlib.suppress(OSError):
        st = os.stat(path)
        if stat.S_ISSOCK(st.st_mode):
            return str(path), st.st_ino, st.st_ctime_ns
    return None
