"""A kubelet pod-resources stand-in (``v1.PodResourcesLister``) on grpcio, not gpuagent's stack.

It serves ``List`` on a Unix socket from a mutable table of containers and their devices, counts
the calls it answers, and can vanish (``stop``), come back (``start``) or restart with a new
socket file (``restart``), as the kubelet does. grpcio's send limit is lifted so responses larger
than the 4 MiB gRPC default can be served (dcgm-exporter #509).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from .grpcserver import StandInServer
from .grpcstubs import StubModules

__all__ = ["Claimed", "FakePodResources", "Held"]


@dataclass(frozen=True)
class Held:
    """A container holding devices of one resource."""

    namespace: str
    pod: str
    container: str
    resource: str
    device_ids: tuple[str, ...]


@dataclass(frozen=True)
class Claimed:
    """A container holding one device of a ResourceClaim (``dynamic_resources``, 1.34+)."""

    namespace: str
    pod: str
    container: str
    claim: str
    driver: str
    pool: str
    device: str


class _Servicer:
    def __init__(self, fake: FakePodResources) -> None:
        self._fake = fake

    def List(self, request: Any, context: Any) -> Any:  # the gRPC method name
        return self._fake._list(context)

    def GetAllocatableResources(self, request: Any, context: Any) -> Any:
        context.abort(grpc.StatusCode.UNIMPLEMENTED, "not in this stand-in")

    def Get(self, request: Any, context: Any) -> Any:
        context.abort(grpc.StatusCode.UNIMPLEMENTED, "not in this stand-in")


class FakePodResources(StandInServer):
    """The kubelet's pod-resources server."""

    def __init__(self, socket_path: Path, stubs: StubModules) -> None:
        super().__init__(
            socket_path,
            lambda server: stubs.pr_grpc.add_PodResourcesListerServicer_to_server(
                _Servicer(self), server
            ),
            name="fake-podresources",
            options=[("grpc.max_send_message_length", -1)],
        )
        self._stubs = stubs
        self._held: tuple[Held | Claimed, ...] = ()
        self.padding = 0
        """Extra bytes of filler pods added to each response (to exceed 4 MiB)."""

    # -- table -------------------------------------------------------------------------------
    def set(self, held: Iterable[Held | Claimed]) -> None:
        with self._lock:
            self._held = tuple(held)

    def _list(self, context: Any) -> Any:
        pb = self._stubs.pr_pb2
        self.answering(context)
        with self._lock:
            held, padding = self._held, self.padding
        pods: dict[tuple[str, str], Any] = {}
        for item in held:
            pod = pods.get((item.namespace, item.pod))
            if pod is None:
                pod = pb.PodResources(name=item.pod, namespace=item.namespace)
                pods[(item.namespace, item.pod)] = pod
            container = next((c for c in pod.containers if c.name == item.container), None)
            if container is None:
                container = pod.containers.add(name=item.container)
            if isinstance(item, Claimed):
                dynamic = container.dynamic_resources.add(
                    claim_name=item.claim, claim_namespace=item.namespace
                )
                dynamic.claim_resources.add(
                    driver_name=item.driver, pool_name=item.pool, device_name=item.device,
                    cdi_devices=[{"name": f"k8s.{item.driver}/claim={item.claim}"}],
                )  # fmt: skip
                continue
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
