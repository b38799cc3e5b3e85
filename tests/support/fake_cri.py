"""A container runtime's CRI stand-in (``runtime.v1.RuntimeService``) on grpcio.

It serves ``Version`` and ``ListContainers`` on a Unix socket from a mutable table of containers
(each labelled as the kubelet labels the containers it creates), honours the request's filter
(ID, state, sandbox, label selector), counts the calls it answers and can fail, vanish and come
back as a restarted runtime does. Not gpuagent's gRPC stack: its own protoc-generated stubs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import grpc

from .grpcstubs import CriStubs

__all__ = ["FakeCri", "RuntimeContainer"]

RUNNING = 1
_STOP_GRACE_S = 2.0


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


class FakeCri:
    """The runtime's CRI server."""

    def __init__(self, socket_path: Path, stubs: CriStubs) -> None:
        self.socket_path = Path(socket_path)
        self._stubs = stubs
        self._lock = threading.Lock()
        self._containers: tuple[RuntimeContainer, ...] = ()
        self._calls: list[float] = []
        self._fail: grpc.StatusCode | None = None
        self._server: Any = None
        self._executor: ThreadPoolExecutor | None = None

    def set(self, containers: Iterable[RuntimeContainer]) -> None:
        with self._lock:
            self._containers = tuple(containers)

    def add(self, *containers: RuntimeContainer) -> None:
        with self._lock:
            self._containers = (*self._containers, *containers)

    def fail_with(self, code: grpc.StatusCode | None) -> None:
        """Answer with an error status from now on (None: answer normally again)."""
        with self._lock:
            self._fail = code

    @property
    def calls(self) -> int:
        with self._lock:
            return len(self._calls)

    def calls_since(self, t: float) -> int:
        with self._lock:
            return sum(1 for c in self._calls if c >= t)

    def _list(self, request: Any, context: Any) -> Any:
        pb = self._stubs.pb2
        with self._lock:
            self._calls.append(time.monotonic())
            containers, fail = self._containers, self._fail
        if fail is not None:
            context.abort(fail, "stand-in told to fail")
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

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        with self._lock:
            if self._server is not None:
                return
            self.socket_path.parent.mkdir(parents=True, exist_ok=True)
            self.socket_path.unlink(missing_ok=True)
            executor = ThreadPoolExecutor(max_workers=4, thread_name_prefix="fake-cri")
            server = grpc.server(executor)
            self._stubs.grpc.add_RuntimeServiceServicer_to_server(_Servicer(self), server)
            server.add_insecure_port(f"unix:{self.socket_path}")
            server.start()
            self._server, self._executor = server, executor

    def stop(self) -> None:
        with self._lock:
            server, executor = self._server, self._executor
            self._server = self._executor = None
        if server is not None:
            server.stop(None).wait(_STOP_GRACE_S)
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)
        self.socket_path.unlink(missing_ok=True)

    def restart(self) -> None:
        self.stop()
        self.start()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
