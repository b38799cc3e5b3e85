"""The DRA plugin's two sockets and its registration with the kubelet's plugin watcher.

``<plugins-dir>/<driver>/dra.sock`` serves the DRA and health services; then
``<plugins-registry-dir>/<driver>-reg.sock`` serves ``pluginregistration.Registration``. The
kubelet's plugin watcher finds the registration socket by itself (at start-up and whenever one
appears), asks ``GetInfo`` and reports its verdict with ``NotifyRegistrationStatus``; there is
nothing for the plugin to dial. If either socket file disappears (a kubelet that cleans its
directories, a person), both are served again so the watcher sees a fresh registration socket.
The two directories are watched with inotify (:class:`~gpuagent.sockets.dirwatch.DirectoryWatch`),
and polled (``EndpointTiming.watch_interval``) only where inotify cannot be had. Each socket is
served and closed by :class:`~gpuagent.sockets.grpcserver.ServedSocket`.
"""

from __future__ import annotations

import asyncio
import errno
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import structlog

from gpuagent._proto import pluginregistration as reg
from gpuagent.domain.backoff import Backoff
from gpuagent.domain.devices import Registration
from gpuagent.overrides.grpc import IServable
from gpuagent.sockets.dirwatch import DirectoryWatch, file_in_the_way
from gpuagent.sockets.grpcserver import ServedSocket, socket_id

log = structlog.get_logger("gpuagent.dra.endpoint")

PLUGIN_TYPE = "DRAPlugin"


@dataclass(frozen=True, slots=True)
class EndpointTiming:
    """Intervals of the serve-and-watch cycle, injectable so tests never wait on wall time."""

    # Polling, where inotify is unavailable: how often both sockets are looked at.
    watch_interval: float = 0.2
    retry_initial: float = 0.1
    retry_max: float = 10.0
    close_timeout: float = 1.0
    # Watch the socket directories with inotify when the kernel allows it (False: poll only).
    inotify: bool = True

    @property
    def retry(self) -> Backoff:
        """Between tries to serve the sockets (failures in a row)."""
        return Backoff(self.retry_initial, self.retry_max)


class RegistrationService(reg.RegistrationBase):
    """``pluginregistration.Registration``: what we are, and the kubelet's verdict."""

    def __init__(
        self,
        driver: str,
        endpoint: Path,
        services: Sequence[str],
        on_status: Callable[[bool, str], None],
    ) -> None:
        self._info = reg.PluginInfo(
            type=PLUGIN_TYPE, name=driver, endpoint=str(endpoint), supported_versions=list(services)
        )
        self._on_status = on_status

    async def get_info(self, message: reg.InfoRequest) -> reg.PluginInfo:
        return self._info

    async def notify_registration_status(
        self, message: reg.RegistrationStatus
    ) -> reg.RegistrationStatusResponse:
        self._on_status(message.plugin_registered, message.error[:1024])
        return reg.RegistrationStatusResponse()


class DraEndpoint:
    """Serves ``dra.sock`` and ``<driver>-reg.sock`` until cancelled."""

    def __init__(
        self,
        services: Sequence[IServable],
        *,
        driver: str,
        supported: Sequence[str],
        plugins_dir: Path,
        registry_dir: Path,
        timing: EndpointTiming = EndpointTiming(),
        on_state: Callable[[Registration], None] | None = None,
    ) -> None:
        self._services = services
        self.driver = driver
        self.dra_socket = plugins_dir / driver / "dra.sock"
        self.registration_socket = registry_dir / f"{driver}-reg.sock"
        self._supported = tuple(supported)
        self._timing = timing
        self._on_state = on_state
        self._servers: list[ServedSocket] = []
        self.registered = False
        self.registrations = 0
        self.last_error = ""
        self._serve_problem = ""  # why the sockets could not be served, as last logged
        self._said = Registration()  # the registration as last told to on_state

    def _status(self, registered: bool, error: str) -> None:
        self.registered = registered
        if registered:
            self.registrations += 1
            self.last_error = ""
            log.info("registered with the kubelet as a DRA driver", driver=self.driver)
        else:
            self.last_error = f"kubelet refused the DRA plugin: {error}"
            log.error("dra registration refused", error=error)
        self._say()

    def _say(self) -> None:
        """Tell ``on_state`` the registration as it is now (the kubelet's verdict, or why the
        sockets are not served), when it changed."""
        now = Registration(registered=self.registered, error=self.last_error)
        if now != self._said and self._on_state is not None:
            self._said = now
            self._on_state(now)

    async def run(self) -> None:
        failures = 0  # tries in a row that could not serve the sockets
        # Created before the first serve: a socket removed right after it is bound is seen.
        changes = DirectoryWatch(
            (self.dra_socket.parent, self.registration_socket.parent),
            inotify=self._timing.inotify,
        )
        try:
            while True:
                try:
                    await self._serve()
                    if self._serve_problem:
                        log.info("dra sockets served again", driver=self.driver)
                        if self.last_error == self._serve_problem:
                            self.last_error = ""
                        self._serve_problem = ""
                        self._say()
                    failures = 0
                    await self._watch(changes)
                    log.info("a dra socket disappeared; serving again")
                except OSError as exc:
                    problem = f"cannot serve the DRA sockets: {_reason(exc)}"
                    failures += 1
                    retry = self._timing.retry.ceiling(failures)
                    # Once per problem, not on every retry (they back off up to retry_max).
                    (log.error if problem != self._serve_problem else log.debug)(
                        "dra endpoint failed; retrying", error=problem, retry_in_s=retry
                    )
                    self._serve_problem = self.last_error = problem
                    self._say()
                    await asyncio.sleep(retry)
                finally:
                    self.registered = False
                    self._say()
                    await self._close()
        finally:
            changes.close()
            await self._close()

    async def _serve(self) -> None:
        registration = RegistrationService(
            self.driver, self.dra_socket, self._supported, self._status
        )
        # The service socket first: the watcher may call GetInfo the moment the other appears.
        for handlers, path in (
            (self._services, self.dra_socket),
            ([registration], self.registration_socket),
        ):
            self._servers.append(await ServedSocket.serve(handlers, path))
            (log.debug if self._serve_problem else log.info)("serving", socket=str(path))

    async def _watch(self, changes: DirectoryWatch) -> None:
        """Return once either socket is gone or replaced."""
        while all(socket_id(s.path) == s.identity for s in self._servers):
            await changes.wait(self._timing.watch_interval)

    async def _close(self) -> None:
        # One server at a time off the list: a close cut short by a cancellation leaves the rest
        # to the next (run()'s last).
        while self._servers:
            served = self._servers.pop()
            if not await served.close(self._timing.close_timeout):
                log.warning("dra server did not close in time", socket=str(served.path))


def _reason(exc: OSError) -> str:
    """Why a socket could not be served: "<path> is not a directory" for a file in the place of
    its directory (or of one above it), else the error."""
    if exc.filename is not None and exc.errno in (errno.EEXIST, errno.ENOTDIR):
        path = Path(os.fsdecode(exc.filename))  # EEXIST: a directory to make; else under one
        blocker = file_in_the_way(path if exc.errno == errno.EEXIST else path.parent)
        if blocker is not None:
            return f"{blocker} is not a directory"
    return str(exc)
