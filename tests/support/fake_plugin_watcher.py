"""A kubelet stand-in for DRA plugins, on grpcio with its own stubs (not on gpuagent's stack).

It behaves as the kubelet's plugin watcher and DRA manager do (kubernetes
``pkg/kubelet/pluginmanager`` and ``pkg/kubelet/cm/dra/plugin``): it finds ``*-reg.sock`` files in
the registry directory, calls ``GetInfo``, checks the plugin (type ``DRAPlugin``, an endpoint that
exists, at least one DRA service the kubelet speaks, chosen in the plugin's order of preference)
and answers with ``NotifyRegistrationStatus``. Then it calls ``NodePrepareResources`` /
``NodeUnprepareResources`` on the chosen service, and reads ``NodeWatchResources``.

grpcio's calls block: the async tests run them in threads, so the agent's loop keeps serving.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from .grpcstubs import DraStubs

__all__ = ["DRA_SERVICES", "FakePluginWatcher", "Registration"]

# What the kubelet speaks, most recent first (servicesSupportedByKubelet).
DRA_SERVICES = ("v1.DRAPlugin", "v1beta1.DRAPlugin")
HEALTH_SERVICES = ("v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth")
CALL_TIMEOUT = 10.0
Claims = Sequence[tuple[str, str, str]]
"""``(namespace, name, uid)`` of each claim."""


@dataclass
class Registration:
    """A plugin the watcher registered (or refused)."""

    socket: Path
    name: str
    endpoint: str
    versions: tuple[str, ...]
    service: str
    health_service: str
    error: str = ""


@dataclass
class FakePluginWatcher:
    registry_dir: Path
    stubs: DraStubs
    registrations: list[Registration] = field(default_factory=list)

    def find(self, timeout: float = CALL_TIMEOUT) -> Path:
        """The first ``*-reg.sock`` in the registry directory (waits for one to appear)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = sorted(p for p in self.registry_dir.glob("*-reg.sock") if p.is_socket())
            if found:
                return found[0]
            time.sleep(0.01)
        raise AssertionError(f"no registration socket in {self.registry_dir} after {timeout} s")

    def register(self, socket: Path, *, accept: bool = True) -> Registration:
        """``GetInfo``, validation, ``NotifyRegistrationStatus``: the watcher's whole handshake."""
        s = self.stubs
        with grpc.insecure_channel(f"unix://{socket}") as channel:
            stub = s.reg_grpc.RegistrationStub(channel)
            info = stub.GetInfo(s.reg.InfoRequest(), timeout=CALL_TIMEOUT)
            versions = tuple(info.supported_versions)
            error = ""
            if info.type != "DRAPlugin":
                error = f"unknown plugin type {info.type!r}"
            elif not Path(info.endpoint).is_socket():
                error = f"endpoint {info.endpoint} is not a socket"
            service = next((v for v in versions if v in DRA_SERVICES), "")
            if not error and not service:
                error = f"none of {versions} is supported by the kubelet ({DRA_SERVICES})"
            health = next((v for v in HEALTH_SERVICES if v in versions), "")
            ok = accept and not error
            stub.NotifyRegistrationStatus(
                s.reg.RegistrationStatus(
                    plugin_registered=ok, error=error or ("refused" if not accept else "")
                ),
                timeout=CALL_TIMEOUT,
            )
        registration = Registration(
            socket, info.name, info.endpoint, versions, service, health, error
        )
        self.registrations.append(registration)
        return registration

    def _claims_call(
        self, method: str, registration: Registration, claims: Claims, version: str
    ) -> Any:
        """``Node{method}Resources`` for ``(namespace, name, uid)`` claims, on the service the
        watcher chose (or ``version``)."""
        chosen = version or registration.service
        pb, pb_grpc = (
            (self.stubs.v1, self.stubs.v1_grpc)
            if chosen == "v1.DRAPlugin"
            else (self.stubs.v1beta1, self.stubs.v1beta1_grpc)
        )
        with grpc.insecure_channel(f"unix://{registration.endpoint}") as channel:
            request = getattr(pb, f"Node{method}ResourcesRequest")(
                claims=[pb.Claim(namespace=ns, name=name, uid=uid) for ns, name, uid in claims]
            )
            call = getattr(pb_grpc.DRAPluginStub(channel), f"Node{method}Resources")
            return call(request, timeout=CALL_TIMEOUT)

    def prepare(self, registration: Registration, claims: Claims, *, version: str = "") -> Any:
        """``NodePrepareResources`` for ``(namespace, name, uid)`` claims."""
        return self._claims_call("Prepare", registration, claims, version)

    def unprepare(self, registration: Registration, claims: Claims, *, version: str = "") -> Any:
        """``NodeUnprepareResources`` for ``(namespace, name, uid)`` claims."""
        return self._claims_call("Unprepare", registration, claims, version)

    def watch_health(
        self, registration: Registration, *, alpha: bool = False
    ) -> Generator[Any, None, None]:
        """The ``NodeWatchResources`` stream (close the generator to cancel it)."""
        pb = self.stubs.health_alpha if alpha else self.stubs.health
        pb_grpc = self.stubs.health_alpha_grpc if alpha else self.stubs.health_grpc
        with grpc.insecure_channel(f"unix://{registration.endpoint}") as channel:
            stream = pb_grpc.DRAResourceHealthStub(channel).NodeWatchResources(
                pb.NodeWatchResourcesRequest(), timeout=60
            )
            try:
                yield from stream
            finally:
                stream.cancel()

    # ----- async wrappers (the agent's loop must keep running during a call) -------------------
    async def afind(self) -> Path:
        return await asyncio.to_thread(self.find)

    async def aregister(self, socket: Path, *, accept: bool = True) -> Registration:
        return await asyncio.to_thread(self.register, socket, accept=accept)

    async def aprepare(self, registration: Registration, claims: Claims, **kw: Any) -> Any:
        return await asyncio.to_thread(lambda: self.prepare(registration, claims, **kw))

    async def aunprepare(self, registration: Registration, claims: Claims, **kw: Any) -> Any:
        return await asyncio.to_thread(lambda: self.unprepare(registration, claims, **kw))
