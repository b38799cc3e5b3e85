"""A kubelet stand-in for the device plugin API, built on grpcio (not on gpuagent's stack).

It behaves as the kubelet's device manager does (kubernetes ``pkg/kubelet/cm/devicemanager``):

* ``start()`` creates the directory, deletes every Unix socket in it (other files stay), creates
  ``DEPRECATION`` as the plugin watcher does, and serves ``v1beta1.Registration`` on
  ``kubelet.sock``.
* ``Register`` validates the version and the resource name with the kubelet's messages, then,
  before answering, dials the plugin socket (blocking, ``dial_timeout`` = 10 s), calls
  ``GetDevicePluginOptions`` and starts a ``ListAndWatch`` consumer. Errors are returned as the
  Go server returns a plain ``error``: status ``UNKNOWN`` with the error text as details.
* When a ``ListAndWatch`` stream ends the kubelet closes that connection and never re-dials;
  only a new ``Register`` brings the plugin back.
* ``restart()`` is a kubelet restart: the server and all plugin connections go away, every
  socket in the directory is deleted (the plugins' own sockets included) and a new
  ``kubelet.sock`` is created.

The kubelet calls ``GetDevicePluginOptions``, ``Allocate`` and ``GetPreferredAllocation`` with no
deadline; here every call and every wait is bounded (``call_timeout``) so a test cannot hang.

What ``Register`` accepts and how a refusal is worded are in :mod:`support.kubeletrules`; an
accepted registration, its connection and its ``ListAndWatch`` stream in
:mod:`support.kubeletregistration`.
"""

from __future__ import annotations

import os
import stat
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from .grpcserver import StartStop, UnixGrpcServer
from .grpcstubs import StubModules
from .kubeletregistration import Observer, Registration, StreamEnd, short
from .kubeletrules import SUPPORTED_VERSIONS, go_status_text, is_extended_resource_name, refusal

__all__ = [
    "KUBELET_SOCKET_NAME",
    "SUPPORTED_VERSIONS",
    "FakeKubelet",
    "Observer",
    "RegisterAttempt",
    "Registration",
    "StreamEnd",
    "go_status_text",
    "is_extended_resource_name",
]

KUBELET_SOCKET_NAME = "kubelet.sock"
PRE_START_CONTAINER_TIMEOUT_S = 30.0
"""``KubeletPreStartContainerRPCTimeoutInSecs``."""

_JOIN_TIMEOUT_S = 5.0


def _remove_sockets(directory: Path) -> None:
    """``CleanupPluginDirectory``: remove every socket, keep directories and other files."""
    for entry in directory.iterdir():
        try:
            mode = entry.stat().st_mode  # os.Stat follows symlinks
        except OSError:
            continue
        if stat.S_ISSOCK(mode):
            entry.unlink(missing_ok=True)


@dataclass(frozen=True)
class RegisterAttempt:
    """Every ``Register`` request, accepted or refused."""

    version: str
    endpoint: str
    resource_name: str
    received_at: float
    error: str | None
    """The error text returned with status ``UNKNOWN``, or None when accepted."""


class _RegistrationServicer:
    """``v1beta1.Registration``; handlers run on the server's thread pool."""

    def __init__(self, kubelet: FakeKubelet, generation: int) -> None:
        self._kubelet = kubelet
        self._generation = generation

    def Register(self, request: Any, context: Any) -> Any:  # the gRPC method name
        return self._kubelet._register(request, context, self._generation)


class FakeKubelet(StartStop):
    """The kubelet's device manager, as seen by a device plugin over its Unix sockets."""

    def __init__(
        self,
        socket_dir: Path,
        stubs: StubModules,
        *,
        dial_timeout: float = 10.0,
        call_timeout: float = 30.0,
        create_deprecation_file: bool = True,
        max_workers: int = 8,
        observe: Observer | None = None,
    ) -> None:
        self.socket_dir = Path(socket_dir)
        self.observe = observe
        """Called on the kubelet's own threads the moment something arrives, before anything
        else happens: ``("register", RegisterRequest)``, ``("update", ListAndWatchResponse)``
        — so a test can look at the node as it was when the kubelet learned of it."""
        self.stubs = stubs
        self.dial_timeout = dial_timeout
        """The kubelet dials a registering plugin for at most 10 s."""
        self.call_timeout = call_timeout
        """Bound on calls the kubelet makes without a deadline (options, allocate, preferred)."""
        self.create_deprecation_file = create_deprecation_file
        self._pb = stubs.dp_pb2
        self._cond = threading.Condition()
        self._registrations: list[Registration] = []
        self._attempts: list[RegisterAttempt] = []
        self._restarts: list[float] = []
        self._generation = 0
        # A killed kubelet leaves its socket; start() removes it with the others.
        self._server = UnixGrpcServer(
            self.kubelet_socket,
            self._add_servicers,
            name="fake-kubelet",
            max_workers=max_workers,
            leave_socket=True,
        )

    # -- lifecycle -------------------------------------------------------------------------

    @property
    def kubelet_socket(self) -> Path:
        return self.socket_dir / KUBELET_SOCKET_NAME

    @property
    def running(self) -> bool:
        return self._server.running

    def start(self) -> None:
        """Start the registration server as the kubelet does; a no-op when already running."""
        with self._cond:
            if self._server.running:
                return
            self.socket_dir.mkdir(mode=0o750, parents=True, exist_ok=True)
            _remove_sockets(self.socket_dir)
            if self.create_deprecation_file:
                (self.socket_dir / "DEPRECATION").touch()
            self._generation += 1
            self._server.start()

    def _add_servicers(self, server: grpc.Server) -> None:
        servicer = _RegistrationServicer(self, self._generation)
        self.stubs.dp_grpc.add_RegistrationServicer_to_server(servicer, server)

    def _shutdown(self) -> None:
        """What the kubelet's death does: the server and every plugin connection go away."""
        with self._cond:
            self._generation += 1  # a Register still in flight is dropped
            registrations = list(self._registrations)
        self._server.stop()
        for registration in registrations:
            registration._close(by_kubelet=True)
        deadline = time.monotonic() + _JOIN_TIMEOUT_S
        for registration in registrations:
            registration._join(max(0.0, deadline - time.monotonic()))

    def restart(self) -> None:
        """A kubelet restart: stop, delete every socket in the directory, start again."""
        self._shutdown()
        with self._cond:
            self._restarts.append(time.monotonic())
        if self.socket_dir.is_dir():
            _remove_sockets(self.socket_dir)
        self.start()

    def stop(self) -> None:
        """Stop serving and close every plugin connection. Idempotent."""
        self._shutdown()

    # -- Register ---------------------------------------------------------------------------

    def _register(self, request: Any, context: Any, generation: int) -> Any:
        if self.observe is not None:
            self.observe("register", request)
        received_at = time.monotonic()
        error = refusal(request.version, request.resource_name)
        if error is None:
            error = self._connect(request, received_at, generation)
        attempt = RegisterAttempt(
            version=request.version,
            endpoint=request.endpoint,
            resource_name=request.resource_name,
            received_at=received_at,
            error=error,
        )
        with self._cond:
            self._attempts.append(attempt)
            self._cond.notify_all()
        if error is not None:
            context.abort(grpc.StatusCode.UNKNOWN, error)
        return self._pb.Empty()

    def _connect(self, request: Any, received_at: float, generation: int) -> str | None:
        # filepath.Join(socketDir, endpoint): joined, then cleaned.
        socket_path = Path(os.path.normpath(f"{self.socket_dir}/{request.endpoint}"))
        channel = grpc.insecure_channel(
            f"unix:{socket_path}",
            options=[
                ("grpc.default_authority", "localhost"),
                # One connection per channel, like a Go ClientConn; grpcio would otherwise
                # share subchannels between channels to the same address.
                ("grpc.use_local_subchannel_pool", 1),
            ],
        )
        try:
            grpc.channel_ready_future(channel).result(timeout=self.dial_timeout)
        except grpc.FutureTimeoutError:
            channel.close()
            return "failed to dial device plugin: context deadline exceeded"
        stub = self.stubs.dp_grpc.DevicePluginStub(channel)
        try:
            plugin_options = stub.GetDevicePluginOptions(
                self._pb.Empty(), timeout=self.call_timeout
            )
        except grpc.RpcError as rpc_error:
            channel.close()
            status = go_status_text(rpc_error.code(), rpc_error.details() or "")
            return f"failed to get device plugin options: {status}"
        with self._cond:
            if generation != self._generation:
                channel.close()
                return "kubelet stopped while registering"
            registration = Registration(
                index=len(self._registrations),
                request=request,
                received_at=received_at,
                socket_path=socket_path,
                channel=channel,
                stub=stub,
                plugin_options=plugin_options,
                empty=self._pb.Empty(),
                observe=self.observe,
            )
            self._registrations.append(registration)
            registration._start()
        return None

    # -- records ----------------------------------------------------------------------------

    @property
    def registrations(self) -> list[Registration]:
        """Accepted registrations over the kubelet's lifetime (restarts included), oldest first."""
        with self._cond:
            return list(self._registrations)

    @property
    def attempts(self) -> list[RegisterAttempt]:
        """Every Register request, accepted or refused, oldest first."""
        with self._cond:
            return list(self._attempts)

    @property
    def restarts(self) -> list[float]:
        """``time.monotonic()`` of each ``restart()``."""
        with self._cond:
            return list(self._restarts)

    def wait_for_registrations(self, n: int, timeout: float) -> list[Registration]:
        """Block until at least ``n`` registrations were accepted in total; return them all."""
        with self._cond:
            if not self._cond.wait_for(lambda: len(self._registrations) >= n, timeout):
                refused = [a for a in self._attempts if a.error is not None]
                raise AssertionError(
                    f"expected at least {n} registration(s) within {timeout}s, got "
                    f"{len(self._registrations)}: {self._registrations}; "
                    f"refused attempts: {refused}"
                )
            return list(self._registrations)

    def wait_for_attempts(self, n: int, timeout: float) -> list[RegisterAttempt]:
        """Block until at least ``n`` Register requests (accepted or refused) were answered."""
        with self._cond:
            if not self._cond.wait_for(lambda: len(self._attempts) >= n, timeout):
                raise AssertionError(
                    f"expected at least {n} Register attempt(s) within {timeout}s, got "
                    f"{len(self._attempts)}: {self._attempts}"
                )
            return list(self._attempts)

    def latest(self, resource: str | None = None) -> Registration:
        """The newest connected registration (for ``resource`` if given): the kubelet's endpoint."""
        with self._cond:
            for registration in reversed(self._registrations):
                if resource is not None and registration.resource_name != resource:
                    continue
                if registration.connected:
                    return registration
            raise AssertionError(
                f"no connected registration for {resource or 'any resource'}; "
                f"registrations: {self._registrations}"
            )

    # -- calls the kubelet makes ------------------------------------------------------------

    def options(self, *, resource: str | None = None) -> Any:
        """``GetDevicePluginOptions(Empty)`` -> ``DevicePluginOptions``."""
        return self.latest(resource).stub.GetDevicePluginOptions(
            self._pb.Empty(), timeout=self.call_timeout
        )

    def _allocate_request(self, device_ids: Iterable[str]) -> Any:
        container = self._pb.ContainerAllocateRequest(devices_ids=list(device_ids))
        return self._pb.AllocateRequest(container_requests=[container])

    def allocate(self, device_ids: Iterable[str], *, resource: str | None = None) -> Any:
        """``Allocate`` with one ``ContainerAllocateRequest`` -> ``AllocateResponse``."""
        return self.latest(resource).stub.Allocate(
            self._allocate_request(device_ids), timeout=self.call_timeout
        )

    def allocate_error(
        self, device_ids: Iterable[str], *, resource: str | None = None
    ) -> tuple[Any, str]:
        """``Allocate`` that must fail: ``(grpc.StatusCode, details)``."""
        stub = self.latest(resource).stub
        return self._expect_error(
            "Allocate",
            lambda: stub.Allocate(self._allocate_request(device_ids), timeout=self.call_timeout),
        )

    def _preferred_request(
        self, available: Iterable[str], must_include: Iterable[str], size: int
    ) -> Any:
        container = self._pb.ContainerPreferredAllocationRequest(
            available_deviceIDs=list(available),
            must_include_deviceIDs=list(must_include),
            allocation_size=size,
        )
        return self._pb.PreferredAllocationRequest(container_requests=[container])

    def preferred_response(
        self,
        available: Iterable[str],
        must_include: Iterable[str],
        size: int,
        *,
        resource: str | None = None,
    ) -> Any:
        """``GetPreferredAllocation`` -> the whole ``PreferredAllocationResponse``."""
        return self.latest(resource).stub.GetPreferredAllocation(
            self._preferred_request(available, must_include, size), timeout=self.call_timeout
        )

    def preferred(
        self,
        available: Iterable[str],
        must_include: Iterable[str],
        size: int,
        *,
        resource: str | None = None,
    ) -> list[str]:
        """``GetPreferredAllocation``; like the kubelet, only ``container_responses[0]`` counts."""
        response = self.preferred_response(available, must_include, size, resource=resource)
        if len(response.container_responses) == 0:
            raise AssertionError(
                f"GetPreferredAllocation returned no container_responses: {response}"
            )
        return list(response.container_responses[0].deviceIDs)

    def preferred_error(
        self,
        available: Iterable[str],
        must_include: Iterable[str],
        size: int,
        *,
        resource: str | None = None,
    ) -> tuple[Any, str]:
        """``GetPreferredAllocation`` that must fail: ``(grpc.StatusCode, details)``."""
        stub = self.latest(resource).stub
        request = self._preferred_request(available, must_include, size)
        return self._expect_error(
            "GetPreferredAllocation",
            lambda: stub.GetPreferredAllocation(request, timeout=self.call_timeout),
        )

    def pre_start(self, device_ids: Sequence[str], *, resource: str | None = None) -> Any:
        """``PreStartContainer`` with the kubelet's 30 s deadline."""
        request = self._pb.PreStartContainerRequest(devices_ids=list(device_ids))
        return self.latest(resource).stub.PreStartContainer(
            request, timeout=PRE_START_CONTAINER_TIMEOUT_S
        )

    def pre_start_error(
        self, device_ids: Sequence[str], *, resource: str | None = None
    ) -> tuple[Any, str]:
        """``PreStartContainer`` that must fail: ``(grpc.StatusCode, details)``."""
        stub = self.latest(resource).stub
        request = self._pb.PreStartContainerRequest(devices_ids=list(device_ids))
        return self._expect_error(
            "PreStartContainer",
            lambda: stub.PreStartContainer(request, timeout=PRE_START_CONTAINER_TIMEOUT_S),
        )

    @staticmethod
    def _expect_error(method: str, call: Callable[[], Any]) -> tuple[Any, str]:
        try:
            response = call()
        except grpc.RpcError as error:
            return error.code(), error.details() or ""
        raise AssertionError(f"expected {method} to fail, it returned: {short(response)}")
