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
"""

from __future__ import annotations

import os
import queue
import re
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
SUPPORTED_VERSIONS = ("v1beta1",)
PRE_START_CONTAINER_TIMEOUT_S = 30.0
"""``KubeletPreStartContainerRPCTimeoutInSecs``."""

_JOIN_TIMEOUT_S = 5.0
_MAX_MESSAGE_TEXT = 2000

# k8s.io/apimachinery/pkg/util/validation
_DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_DNS1123_SUBDOMAIN_MAX = 253
_QUALIFIED_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
_QUALIFIED_NAME_MAX = 63

# google.golang.org/grpc/codes: Code.String()
_GO_CODE_NAMES = {
    "OK": "OK",
    "CANCELLED": "Canceled",
    "UNKNOWN": "Unknown",
    "INVALID_ARGUMENT": "InvalidArgument",
    "DEADLINE_EXCEEDED": "DeadlineExceeded",
    "NOT_FOUND": "NotFound",
    "ALREADY_EXISTS": "AlreadyExists",
    "PERMISSION_DENIED": "PermissionDenied",
    "RESOURCE_EXHAUSTED": "ResourceExhausted",
    "FAILED_PRECONDITION": "FailedPrecondition",
    "ABORTED": "Aborted",
    "OUT_OF_RANGE": "OutOfRange",
    "UNIMPLEMENTED": "Unimplemented",
    "INTERNAL": "Internal",
    "UNAVAILABLE": "Unavailable",
    "DATA_LOSS": "DataLoss",
    "UNAUTHENTICATED": "Unauthenticated",
}


def go_status_text(code: Any, details: str) -> str:
    """How Go formats a gRPC status error: ``rpc error: code = Unavailable desc = ...``."""
    name = _GO_CODE_NAMES.get(code.name, code.name)
    return f"rpc error: code = {name} desc = {details}"


def _go_quote(value: str) -> str:
    """Go's ``%q`` for the strings that occur here (printable text)."""
    escaped = value.replace("\\", "\\\\").replace('"', '\\"')
    escaped = "".join(ch if ch.isprintable() else f"\\x{ord(ch):02x}" for ch in escaped)
    return f'"{escaped}"'


def _is_qualified_name(value: str) -> bool:
    parts = value.split("/")
    if len(parts) == 1:
        name = parts[0]
    elif len(parts) == 2:
        prefix, name = parts
        if (
            not prefix
            or len(prefix) > _DNS1123_SUBDOMAIN_MAX
            or not _DNS1123_SUBDOMAIN.fullmatch(prefix)
        ):
            return False
    else:
        return False
    return 0 < len(name) <= _QUALIFIED_NAME_MAX and bool(_QUALIFIED_NAME.fullmatch(name))


def is_extended_resource_name(name: str) -> bool:
    """``v1helper.IsExtendedResourceName``: the kubelet's check of a resource name.

    Not native (contains ``/`` and no ``kubernetes.io/``), no ``requests.`` prefix, and
    ``"requests." + name`` is a qualified name.
    """
    if "/" not in name or "kubernetes.io/" in name:
        return False
    if name.startswith("requests."):
        return False
    return _is_qualified_name("requests." + name)


def _short(message: object) -> str:
    text = str(message).strip().replace("\n", " ")
    return text if len(text) <= _MAX_MESSAGE_TEXT else text[:_MAX_MESSAGE_TEXT] + "..."


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
class StreamEnd:
    """How a ``ListAndWatch`` stream ended."""

    code: Any
    """``grpc.StatusCode``; ``OK`` when the plugin finished the stream normally."""
    details: str
    at: float
    """``time.monotonic()``."""
    closed_by_kubelet: bool
    """True when the kubelet (``restart``/``stop``) closed the connection, not the plugin."""

    @property
    def ok(self) -> bool:
        return bool(self.code == grpc.StatusCode.OK)


@dataclass(frozen=True)
class RegisterAttempt:
    """Every ``Register`` request, accepted or refused."""

    version: str
    endpoint: str
    resource_name: str
    received_at: float
    error: str | None
    """The error text returned with status ``UNKNOWN``, or None when accepted."""


_END = object()

Observer = Callable[[str, Any], None]
"""What a test gives :class:`FakeKubelet` to look at the node when the kubelet hears of it."""


class Registration:
    """An accepted ``Register``: the request, the plugin's options and its ListAndWatch stream."""

    def __init__(
        self,
        *,
        index: int,
        request: Any,
        received_at: float,
        socket_path: Path,
        channel: Any,
        stub: Any,
        plugin_options: Any,
        empty: Any,
        observe: Observer | None = None,
    ) -> None:
        self.index = index
        """Position in ``FakeKubelet.registrations``."""
        self.request = request
        self.version: str = request.version
        self.endpoint: str = request.endpoint
        self.resource_name: str = request.resource_name
        self.options = request.options
        """``RegisterRequest.options`` (the kubelet itself ignores them)."""
        self.received_at = received_at
        """``time.monotonic()`` when ``Register`` arrived."""
        self.socket_path = socket_path
        self.plugin_options = plugin_options
        """What ``GetDevicePluginOptions`` returned during ``Register``: what the kubelet uses."""
        self.connected_at = time.monotonic()
        self.stub = stub
        """``DevicePluginStub`` on this registration's connection."""
        self._channel = channel
        self._empty = empty
        self._queue: queue.Queue[object] = queue.Queue()
        self._lock = threading.Lock()
        self._history: list[tuple[float, Any]] = []
        self._end: StreamEnd | None = None
        self._ended = threading.Event()
        self._closing_by_kubelet = False
        self._closed = False
        self._call: Any = None
        self._observe = observe
        self._thread = threading.Thread(
            target=self._consume, name=f"fake-kubelet-law-{index}", daemon=True
        )

    def __repr__(self) -> str:
        return (
            f"Registration(#{self.index} {self.resource_name!r} endpoint={self.endpoint!r} "
            f"version={self.version!r} updates={len(self.history)} ended={self.ended})"
        )

    # -- the ListAndWatch consumer ------------------------------------------------------------

    def _start(self) -> None:
        self._thread.start()

    def _consume(self) -> None:
        code: Any = grpc.StatusCode.OK
        details = ""
        try:
            call = self.stub.ListAndWatch(self._empty)
            with self._lock:
                self._call = call
                cancel_now = self._closed
            if cancel_now:
                call.cancel()
            for response in call:
                if self._observe is not None:
                    self._observe("update", response)
                now = time.monotonic()
                with self._lock:
                    self._history.append((now, response))
                self._queue.put(response)
        except grpc.RpcError as error:
            code, details = error.code(), error.details() or ""
        except ValueError as error:  # "Cannot invoke RPC on closed channel!"
            code, details = grpc.StatusCode.CANCELLED, str(error)
        with self._lock:
            self._end = StreamEnd(code, details, time.monotonic(), self._closing_by_kubelet)
        self._ended.set()
        self._queue.put(_END)
        # The kubelet disconnects the client once Run (the Recv loop) returns.
        self._close(by_kubelet=False)

    def _close(self, *, by_kubelet: bool) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if by_kubelet and self._end is None:
                self._closing_by_kubelet = True
            call = self._call
        if call is not None:
            call.cancel()
        self._channel.close()

    def _join(self, timeout: float) -> None:
        if self._thread.is_alive():
            self._thread.join(timeout)

    # -- what tests look at -------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        """False once the stream ended or the kubelet closed the connection."""
        with self._lock:
            return not self._closed

    @property
    def ended(self) -> StreamEnd | None:
        with self._lock:
            return self._end

    @property
    def history(self) -> list[tuple[float, Any]]:
        """Every ListAndWatchResponse received so far, with its ``time.monotonic()``."""
        with self._lock:
            return list(self._history)

    @property
    def last_update(self) -> Any:
        """The latest ListAndWatchResponse received (consumed or not), or None."""
        with self._lock:
            return self._history[-1][1] if self._history else None

    def next_update(self, timeout: float) -> Any:
        """The next ListAndWatchResponse not yet returned by ``next_update``/``wait_until``."""
        try:
            item = self._queue.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(
                f"no ListAndWatch update within {timeout}s on {self!r}; "
                f"last update: {_short(self.last_update)}"
            ) from None
        if item is _END:
            self._queue.put(_END)  # stays visible to later calls
            raise AssertionError(f"ListAndWatch stream already ended: {self.ended} on {self!r}")
        return item

    def wait_until(self, predicate: Callable[[Any], bool], timeout: float) -> Any:
        """Consume updates until one satisfies ``predicate``; return it."""
        deadline = time.monotonic() + timeout
        seen = 0
        last: Any = None
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(
                    f"no ListAndWatch update satisfied the predicate within {timeout}s "
                    f"({seen} updates seen) on {self!r}; last seen: {_short(last)}"
                )
            try:
                update = self.next_update(remaining)
            except AssertionError as error:
                raise AssertionError(
                    f"no ListAndWatch update satisfied the predicate ({seen} updates seen; "
                    f"last seen: {_short(last)}): {error}"
                ) from None
            seen += 1
            last = update
            if predicate(update):
                return update

    def wait_ended(self, timeout: float) -> StreamEnd:
        """How the stream ended; AssertionError if it is still open after ``timeout``."""
        if not self._ended.wait(timeout):
            raise AssertionError(f"ListAndWatch stream still open after {timeout}s on {self!r}")
        end = self.ended
        assert end is not None
        return end


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
        error = self._validate(request)
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

    @staticmethod
    def _validate(request: Any) -> str | None:
        if request.version not in SUPPORTED_VERSIONS:
            supported = "[" + " ".join(_go_quote(v) for v in SUPPORTED_VERSIONS) + "]"
            return (
                f"requested API version {_go_quote(request.version)} is not supported by "
                f"kubelet. Supported version is {supported}"
            )
        if not is_extended_resource_name(request.resource_name):
            return f"the ResourceName {_go_quote(request.resource_name)} is invalid"
        return None

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
        raise AssertionError(f"expected {method} to fail, it returned: {_short(response)}")
