"""A container runtime's CRI stand-in (``runtime.v1.RuntimeService``) on grpcio.

It serves ``Version`` and ``ListContainers`` on a Unix socket from a mutable table of containers
(each labelled as the kubelet labels the containers it creates), honours the request's filter
(ID, state, sandbox, label selector), counts the calls it answers and can fail, vanish and come
back as a restarted runtime does. Not gpuagent's gRPC stack: its own protoc-generated stubs.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .grpcserver import StandInServer
from .grpcstubs import CriStubs

__all__ = ["FakeCri", "RuntimeContainer"]

RUNNING = 1


@dataclass(frozen=True)
class RuntimeContainer:
    """A container the runtime knows; ``kubelet`` False: created outside Kubernetes (no labels)."""

    id: str
    namespace: str
    pod: str
    container: str
    pod_uid: str = ""
    state: int = RUNNING
    kubelet: bool = True
    sandbox: str = "sandbox"
    extra_labels: dict[str, str] = field(default_factory=dict)

    def labels(self) -> dict[str, str]:
        if not self.kubelet:
            return dict(self.extra_labels)
        return {
            "io.kubernetes.pod.namespace": self.namespace,
            "io.kubernetes.pod.name": self.pod,
            "io.kubernetes.pod.uid": self.pod_uid,
            "io.kubernetes.container.name": self.container,
            **self.extra_labels,
        }


class _Servicer:
    def __init__(self, fake: FakeCri) -> None:
        self._fake = fake

    def Version(self, request: Any, context: Any) -> Any:  # the gRPC method name
        return self._fake._stubs.pb2.VersionResponse(
            version="0.1.0",
            runtime_name="fake-cri",
            runtime_version="1.0.0",
            runtime_api_version="v1",
        )

    def ListContainers(self, request: Any, context: Any) -> Any:
        return self._fake._list(request, context)


class FakeCri(StandInServer):
    """The runtime's CRI server."""

    def __init__(self, socket_path: Path, stubs: CriStubs) -> None:
        super().__init__(
            socket_path,
            lambda server: stubs.grpc.add_RuntimeServiceServicer_to_server(_Servicer(self), server),
            name="fake-cri",
        )
        self._stubs = stubs
        self._containers: tuple[RuntimeContainer, ...] = ()

    def set(self, containers: Iterable[RuntimeContainer]) -> None:
        with self._lock:
            self._containers = tuple(containers)

    def add(self, *containers: RuntimeContainer) -> None:
        with self._lock:
            self._containers = (*self._containers, *containers)

    def _list(self, request: Any, context: Any) -> Any:
        pb = self._stubs.pb2
        self.answering(context)
        with self._lock:
            containers = self._containers
        wanted = request.filter if request.HasField("filter") else None
        out = []
        for c in containers:
            if wanted is not None:
                if wanted.id and wanted.id != c.id:
                    continue
                if wanted.HasField("state") and wanted.state.state != c.state:
                    continue
                if wanted.pod_sandbox_id and wanted.pod_sandbox_id != c.sandbox:
                    continue
                labels = c.labels()
                if any(labels.get(k) != v for k, v in wanted.label_selector.items()):
                    continue
            out.append(
                pb.Container(
                    id=c.id,
                    pod_sandbox_id=c.sandbox,
                    metadata=pb.ContainerMetadata(name=c.container, attempt=0),
                    image=pb.ImageSpec(image="registry.example/app:1"),
                    image_ref="sha256:" + "0" * 64,
                    state=c.state,
                    created_at=1_700_000_000_000_000_000,
                    labels=c.labels(),
                    annotations={"io.kubernetes.container.restartCount": "0"},
                )
            )
        return pb.ListContainersResponse(containers=out)
