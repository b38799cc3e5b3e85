"""A kubelet pod-resources stand-in (``v1.PodResourcesLister``) on grpcio, not gpuagent's stack.

It serves ``List`` on a Unix socket from a mutable table of containers and their devices, counts
the calls it answers, and can vanish (``stop``), come back (``start``) or restart with a new
socket file (``restart``), as the kubelet does. grpcio's send limit is lifted so responses larger
than the 4 MiB gRPC default can be served (dcgm-exporter #509).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import grpc

from .grpcstubs import StubModules

__all__ = ["FakePodResources", "Held"]

_STOP_GRACE_S = 2.0


@dataclass(frozen=True)
class Held:
    """A container holding devices of one resource."""

    namespace: str
    pod: str
    container: str
    resource: str
    device_ids: tuple[str, ...]


class _Servicer:
    def __init__(self, fake: FakePodResources) -> None:
        self._fake = fake

    def List(self, request: Any, context: Any) -> Any:  # the gRPC method name
        return self._fake._list(context)

    def GetAllocatableResources(self, request: Any, context: Any) -> Any:
        context.abort(grpc.StatusCode.UNIMPLEMENTED, "not in this stand-in")

    def Get(self, request: Any, context: Any) -> Any:
        context.abort(grpc.StatusCode.UNIMPLEMENTED, "not in this stand-in")


class FakePodResources:
    """The kubelet's pod-resources server."""

    def __init__(self, socket_path: Path, stubs: StubModules) -> None:
        self.socket_path = Path(socket_path)
        self._stubs = stubs
        self._lock = threading.Lock()
        self._held: tuple[Held, ...] = ()
        self._calls: list[float] = []
        self._fail: grpc.StatusCode | None = None
        self._server: Any = None
        self._executor: ThreadPoolExecutor | None = None
        self.padding = 0
        """Extra bytes of filler pods added to each response (to exceed 4 MiB)."""

    # -- table -------------------------------------------------------------------------------
    def set(self, held: Iterable[Held]) -> None:
        with self._lock:
            self._held = tuple(held)

    def fail_with(self, code: grpc.StatusCode | None) -> None:
        """Answer List with an error status from now on (None: answer normally again)."""
        with self._lock:
            self._fail = code

    @property
    def calls(self) -> int:
        with self._lock:
            return len(self._calls)

    def calls_since(self, t: float) -> int:
        with self._lock:
            return sum(1 for c in self._calls if c >= t)

    def _list(self, context: Any) -> Any:
        pb = self._stubs.pr_pb2
        with self._lock:
            self._calls.append(time.monotonic())
            held, fail, padding = self._held, self._fail, self.padding
        if fail is not None:
            context.abort(fail, "stand-in told to fail")
        pods: dict[tuple[str, str], Any] = {}
        for item in held:
            pod = pods.get((item.namespace, item.pod))
            if pod is None:
                pod = pb.PodResources(name=item.pod, namespace=item.namespace)
                pods[(item.namespace, item.pod)] = pod
            container = next((c for c in pod.containers if c.name == item.container), None)
            if container is None:
                container = pod.containers.add(name=item.container)
            container.devices.add(resource_name=item.resource, device_ids=list(item.device_ids))
        response = pb.ListPodResourcesResponse(pod_resources=list(pods.values()))
        # Filler: pods holding devices of another vendor's resource, as on a busy node.
        n = 0
        while padding > 0:
            filler = response.pod_resources.add(name=f"filler-{n:06d}", namespace="busy")
            c = filler.containers.add(name="c")
            c.devices.add(
                resource_name="example.com/fpga", device_ids=[f"fpga-{n:06d}-" + "x" * 200]
            )
            padding -= 260
            n += 1
        return response

    # -- lifecycle ---------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        with self._lock:
            return self._server is not None

    def start(self) -> None:
        with self._lock:
            if self._server is not None:
                return
            self.socket_path.parent.mkdir(parents=True, exist_ok=True)
            self.socket_path.unlink(missing_ok=True)
            executor = ThreadPoolExecutor(max_workers=4, thread_name_prefix="fake-podresources")
            server = grpc.server(
                executor,
                options=[("grpc.max_send_message_length", -1)],
            )
            self._stubs.pr_grpc.add_PodResourcesListerServicer_to_server(_Servicer(self), server)
            server.add_insecure_port(f"unix:{self.socket_path}")
            server.start()
            self._server, self._executor = server, executor

    def stop(self) -> None:
        """The socket goes away (kubelet down, or the directory not mounted)."""
        with self._lock:
            server, executor = self._server, self._executor
            self._server = self._executor = None
        if server is not None:
            server.stop(None).wait(_STOP_GRACE_S)
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)
        self.socket_path.unlink(missing_ok=True)

    def restart(self) -> None:
        """A kubelet restart: the old socket is deleted and a new one created."""
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
