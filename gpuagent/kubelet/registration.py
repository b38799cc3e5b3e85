"""Serving the plugin socket and staying registered with the kubelet, across kubelet restarts.

The cycle, forever: wait for ``kubelet.sock`` → serve on our own socket → ``Register`` → watch
both sockets. A restarting kubelet deletes every socket in the directory and recreates its own;
either change ends the watch, and the cycle serves and registers again. The directories are
watched with inotify (:class:`~gpuagent.sockets.dirwatch.DirectoryWatch`), so a restart is seen
when it happens; where inotify cannot be had they are polled (``Timing.watch_interval``, and a
backoff while the kubelet socket is absent). The socket is served and closed by
:class:`~gpuagent.sockets.grpcserver.ServedSocket`.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import structlog
from grpclib import GRPCError
from grpclib.client import Channel
from grpclib.exceptions import StreamTerminatedError

from gpuagent._proto import v1beta1 as pb
from gpuagent.domain.devices import Registration
from gpuagent.kubelet.answers import ResponseCodec
from gpuagent.kubelet.plugin import DevicePluginService
from gpuagent.kubelet.timing import Timing
from gpuagent.sockets.dirwatch import DirectoryWatch, file_in_the_way
from gpuagent.sockets.grpcserver import ServedSocket, SocketId, socket_id
from gpuagent.state.store import DeviceStore

log = structlog.get_logger("gpuagent.registration")

API_VERSION = "v1beta1"
MAX_REASON = 300  # characters of a registration error kept for /readyz

# Why a registered cycle ended, as the log and /readyz say it: only the kubelet's socket replaced
# (or gone) is a kubelet restart; ours gone, or the plugin that took our path gone, is not.
KUBELET_RESTARTED = "kubelet restart detected; serving and registering again"
SOCKET_REMOVED = "our plugin socket was removed; serving and registering again"
TAKEN_OVER_GONE = "the plugin that took over our socket is gone; serving and registering again"


class PluginEndpoint:
    """Owns one resource's plugin socket and its registration with the kubelet.

    Its state — registered, or what it is waiting for or failed at — is published into the store
    (``Snapshot.registrations``), where /readyz and /metrics read it; successful registrations are
    counted in the store's counters. A failure is logged once (at error level, without a
    traceback when the cause is known, e.g. an unwritable socket directory), then again only
    when it changes.
    """

    def __init__(
        self,
        service: DevicePluginService,
        store: DeviceStore,
        *,
        socket_path: Path,
        kubelet_socket: Path,
        resource_name: str,
        timing: Timing = Timing(),
    ) -> None:
        self._service = service
        self._store = store
        self._socket_path = socket_path
        self._kubelet_socket = kubelet_socket
        self._resource_name = resource_name
        self._timing = timing
        self._served: ServedSocket | None = None
        self._kubelet_id: SocketId | None = None  # the kubelet socket of the current cycle
        self._logged = ""  # the failure last logged at error level
        self._changes: DirectoryWatch | None = None
        self.registrations = 0

    async def run(self) -> None:
        """Serve and stay registered until cancelled."""
        failures = 0  # cycles in a row that did not register
        self._changes = DirectoryWatch(
            (self._socket_path.parent, self._kubelet_socket.parent), inotify=self._timing.inotify
        )
        try:
            while True:
                try:
                    registered = await self._cycle()
                except OSError as exc:
                    # The socket directory is missing, not writable, a file, or the path too
                    # long: the node must not lose its GPUs for good, so report it and try again.
                    blocker = file_in_the_way(self._socket_path.parent)
                    reason = (
                        f"{blocker} is not a directory" if blocker else exc.strerror or str(exc)
                    )
                    self._failed(
                        f"cannot serve the plugin socket {self._socket_path}: {reason} "
                        "(check --socket-dir and the agent's permissions there)"
                    )
                    registered = False
                except Exception as exc:  # a bug: the traceback matters, once
                    self._failed(f"plugin endpoint failed: {exc!r}", exc_info=True)
                    registered = False
                await self._close_server()
                failures = 0 if registered else failures + 1
                if failures:
                    await self._back_off(self._timing.register_retry.ceiling(failures))
        finally:
            self._publish(False, "stopped")
            await self._close_server()
            self._changes.close()
            self._changes = None

    def _publish(self, registered: bool, error: str = "") -> None:
        self._store.set_registration(self._resource_name, Registration(registered, _short(error)))

    def _failed(self, problem: str, *, exc_info: bool = False) -> None:
        """Publish ``problem``; log it at error level unless it was the last one logged."""
        self._publish(False, problem)
        if problem != self._logged:
            log.error(problem, resource=self._resource_name, exc_info=exc_info)
            self._logged = problem
        else:
            log.debug(problem, resource=self._resource_name)

    async def _cycle(self) -> bool:
        """Serve, register and watch once; ``True`` if registered until the watch ended (the
        kubelet restarted, or our socket went), said as what it was."""
        self._kubelet_id = kubelet_id = await self._wait_for_kubelet()
        own_id = await self._serve()
        if not await self._register():
            return False
        self._publish(True)
        self._logged = ""
        why = await self._watch(kubelet_id, own_id)
        self._publish(False, why)
        log.info(why, resource=self._resource_name)
        return True

    async def _back_off(self, seconds: float) -> None:
        """Wait ``seconds`` before trying again, unless the kubelet socket is replaced first: a
        kubelet that restarted while we registered is tried again at once."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        while (left := deadline - loop.time()) > 0:
            if socket_id(self._kubelet_socket) not in (self._kubelet_id, None):
                return
            await self._changed(left, left)

    async def _wait_for_kubelet(self) -> SocketId:
        """Until the kubelet socket is there; what it waits for is logged when it changes."""
        looks = 0
        loop = asyncio.get_running_loop()
        warn_at = loop.time() + self._timing.kubelet_grace
        logged = ""
        while (identity := socket_id(self._kubelet_socket)) is None:
            waiting, emit = f"waiting for the kubelet socket {self._kubelet_socket}", log.info
            blocker = file_in_the_way(self._kubelet_socket.parent)
            if blocker is not None:  # replaced by a file while running (at start: exit 2)
                waiting += f": {blocker} is not a directory"
                emit = log.warning
            elif loop.time() >= warn_at:
                # Still absent: the kubelet is down, or the path is wrong.
                waiting = (
                    f"the kubelet socket {self._kubelet_socket} has not appeared in "
                    f"{self._timing.kubelet_grace:g} s (is the kubelet running? check "
                    "--kubelet-socket / --socket-dir)"
                )
                emit = log.warning
            if waiting != logged:
                emit(waiting, resource=self._resource_name)
                logged = waiting
            self._publish(False, waiting)
            warned = loop.time() >= warn_at
            looks += 1
            poll = self._timing.kubelet_wait.ceiling(looks)
            await self._changed(poll, None if warned else max(0.0, warn_at - loop.time()))
        return identity

    async def _serve(self) -> SocketId | None:
        codec = ResponseCodec(self._service.encoded)
        self._served = await ServedSocket.serve([self._service], self._socket_path, codec=codec)
        # Once, not on every retry while registration keeps failing the same way (a stale
        # kubelet.sock that nobody listens on is retried for ever, with a backoff).
        (log.debug if self._logged else log.info)(
            "serving device plugin", socket=str(self._socket_path)
        )
        return self._served.identity

    async def _register(self) -> bool:
        request = pb.RegisterRequest(
            version=API_VERSION,
            endpoint=self._socket_path.name,
            resource_name=self._resource_name,
            options=pb.DevicePluginOptions(get_preferred_allocation_available=True),
        )
        channel = Channel(path=str(self._kubelet_socket))
        try:
            await pb.RegistrationStub(channel).register(
                request, timeout=self._timing.register_timeout
            )
        except GRPCError as exc:
            self._failed(f"kubelet refused registration: {exc.status.name}: {exc.message}")
        except (OSError, TimeoutError, StreamTerminatedError) as exc:
            # The kubelet went away mid-call (it restarts, or is not serving yet).
            self._failed(f"kubelet unreachable: {exc!r}")
        else:
            self.registrations += 1
            self._store.counters.registered()
            log.info(
                "registered with kubelet", resource=self._resource_name, endpoint=request.endpoint
            )
            return True
        finally:
            channel.close()
        return False

    async def _watch(self, kubelet_id: SocketId, own_id: SocketId | None) -> str:
        """Return why, once the kubelet socket is gone or replaced, or ours is (identities taken
        before ``Register``).

        Our socket gone while the kubelet's stays is not yet a restart: a restarting kubelet
        deletes every socket in the directory in no set order, and a rolling update's new agent
        removes ours just before it binds its own there. Either shows within
        ``Timing.settle``; after that, with the path still empty, we serve again.
        """
        loop = asyncio.get_running_loop()
        gone_at: float | None = None
        while True:
            if socket_id(self._kubelet_socket) != kubelet_id:
                return KUBELET_RESTARTED
            current = socket_id(self._socket_path)
            if own_id is None:
                return SOCKET_REMOVED
            if current is not None and current != own_id:
                return await self._stand_by(kubelet_id)
            if current is None:
                gone_at = loop.time() if gone_at is None else gone_at
                left = gone_at + self._timing.settle - loop.time()
                if left <= 0:
                    return SOCKET_REMOVED
                await self._changed(min(left, self._timing.watch_interval), left)
                continue
            await self._changed(self._timing.watch_interval)

    async def _stand_by(self, kubelet_id: SocketId) -> str:
        """Another plugin (a rolling update's new agent) now serves our socket path and has
        registered in our place: never take it back. Wait until its socket is gone or the kubelet
        restarts, then (returning which) serve and register again."""
        log.warning(
            "another plugin took over the socket; standing by", socket=str(self._socket_path)
        )
        self._publish(False, "another plugin serves this socket")
        await self._close_server()
        while socket_id(self._socket_path) is not None:
            if socket_id(self._kubelet_socket) != kubelet_id:
                return KUBELET_RESTARTED
            await self._changed(self._timing.watch_interval)
        return (
            KUBELET_RESTARTED if socket_id(self._kubelet_socket) != kubelet_id else TAKEN_OVER_GONE
        )

    async def _changed(self, poll: float, at_most: float | None = None) -> None:
        """Until an entry of the socket directories changes (or ``poll`` s pass, where they are
        polled), or ``at_most`` s."""
        assert self._changes is not None
        await self._changes.wait(poll, at_most)

    async def _close_server(self) -> None:
        served, self._served = self._served, None
        if served is not None and not await served.close(self._timing.close_timeout):
            log.warning("plugin server did not close in time")

    @property
    def resource_name(self) -> str:
        return self._resource_name


def _short(text: str, limit: int = MAX_REASON) -> str:
    """A reason short enough for /readyz, however long the kubelet's error text was."""
    return text if len(text) <= limit else f"{text[: limit - 1]}…"
