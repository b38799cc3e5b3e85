"""Self-tests of the kubelet stand-in, against a tiny device plugin also written with grpcio."""

from __future__ import annotations

import asyncio
import os
import socket
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import uvloop

from support.fake_kubelet import (
    FakeKubelet,
    Registration,
    go_status_text,
    is_extended_resource_name,
)
from support.grpcserver import UnixGrpcServer
from support.grpcstubs import StubModules, kubelet_stubs

RESOURCE = "example.com/tiny"
TIMEOUT = 10.0


class TinyPlugin:
    """A minimal DevicePlugin: two healthy devices, then one update (dev-1 unhealthy)."""

    def __init__(
        self,
        directory: Path,
        stubs: StubModules,
        *,
        endpoint: str = "tiny.sock",
        finish_stream: bool = False,
    ) -> None:
        self.socket_path = directory / endpoint
        self.endpoint = endpoint
        self.stubs = stubs
        self.pb: Any = stubs.dp_pb2
        self.finish_stream = finish_stream
        self.options = self.pb.DevicePluginOptions(get_preferred_allocation_available=True)
        self.allocations: list[list[str]] = []
        self._stop = threading.Event()
        self._server = UnixGrpcServer(
            self.socket_path,
            lambda server: stubs.dp_grpc.add_DevicePluginServicer_to_server(self, server),
            name="tiny-plugin",
        )

    def start(self) -> None:
        self._stop.clear()
        self._server.start()

    def stop(self) -> None:
        """Stop serving at once: open streams are cut, not finished."""
        self._server.stop()
        self._stop.set()

    def register(
        self,
        kubelet_socket: Path,
        *,
        version: str = "v1beta1",
        resource: str = RESOURCE,
        endpoint: str | None = None,
    ) -> None:
        request = self.pb.RegisterRequest(
            version=version,
            endpoint=self.endpoint if endpoint is None else endpoint,
            resource_name=resource,
            options=self.options,
        )
        with grpc.insecure_channel(f"unix:{kubelet_socket}") as channel:
            self.stubs.dp_grpc.RegistrationStub(channel).Register(request, timeout=2 * TIMEOUT)

    def _devices(self, dev1_health: str) -> Any:
        return self.pb.ListAndWatchResponse(
            devices=[
                self.pb.Device(ID="dev-0", health="Healthy"),
                self.pb.Device(ID="dev-1", health=dev1_health),
            ]
        )

    # DevicePlugin service
    def GetDevicePluginOptions(self, request: Any, context: Any) -> Any:
        return self.options

    def ListAndWatch(self, request: Any, context: Any) -> Iterator[Any]:
        yield self._devices("Healthy")
        yield self._devices("Unhealthy")
        if self.finish_stream:
            return
        while context.is_active() and not self._stop.wait(0.05):
            pass

    def GetPreferredAllocation(self, request: Any, context: Any) -> Any:
        responses = []
        for container in request.container_requests:
            chosen = list(container.must_include_deviceIDs)
            for device in sorted(container.available_deviceIDs):
                if len(chosen) < container.allocation_size and device not in chosen:
                    chosen.append(device)
            responses.append(self.pb.ContainerPreferredAllocationResponse(deviceIDs=chosen))
        return self.pb.PreferredAllocationResponse(container_responses=responses)

    def Allocate(self, request: Any, context: Any) -> Any:
        responses = []
        for container in request.container_requests:
            ids = list(container.devices_ids)
            unknown = [i for i in ids if i not in ("dev-0", "dev-1")]
            if unknown:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown device {unknown[0]}")
            self.allocations.append(ids)
            responses.append(
                self.pb.ContainerAllocateResponse(envs={"TINY_DEVICES": ",".join(ids)})
            )
        return self.pb.AllocateResponse(container_responses=responses)

    def PreStartContainer(self, request: Any, context: Any) -> Any:
        return self.pb.PreStartContainerResponse()


@pytest.fixture
def plugin(fake_kubelet: FakeKubelet, grpc_stubs: StubModules) -> Iterator[TinyPlugin]:
    tiny = TinyPlugin(fake_kubelet.socket_dir, grpc_stubs)
    tiny.start()
    try:
        yield tiny
    finally:
        tiny.stop()


def _health(update: Any) -> dict[str, str]:
    return {device.ID: device.health for device in update.devices}


def _registered(kubelet: FakeKubelet, plugin: TinyPlugin) -> Registration:
    plugin.register(kubelet.kubelet_socket)
    return kubelet.wait_for_registrations(1, TIMEOUT)[0]


def test_register_then_options_then_first_list(
    fake_kubelet: FakeKubelet, plugin: TinyPlugin
) -> None:
    before = time.monotonic()
    registration = _registered(fake_kubelet, plugin)

    assert registration.version == "v1beta1"
    assert registration.endpoint == "tiny.sock"
    assert registration.resource_name == RESOURCE
    assert registration.socket_path == plugin.socket_path
    assert registration.options.get_preferred_allocation_available
    assert before <= registration.received_at <= registration.connected_at <= time.monotonic()
    # Options are fetched during Register, before it returns.
    assert registration.plugin_options == plugin.options
    assert fake_kubelet.options() == plugin.options

    first = registration.next_update(TIMEOUT)
    assert _health(first) == {"dev-0": "Healthy", "dev-1": "Healthy"}
    second = registration.wait_until(lambda u: _health(u).get("dev-1") == "Unhealthy", TIMEOUT)
    assert _health(second) == {"dev-0": "Healthy", "dev-1": "Unhealthy"}
    assert [update for _, update in registration.history] == [first, second]
    assert registration.last_update == second
    assert registration.ended is None
    assert registration.connected
    assert fake_kubelet.latest(RESOURCE) is registration
    assert [a.error for a in fake_kubelet.attempts] == [None]


def test_next_update_times_out_with_an_assertion(
    fake_kubelet: FakeKubelet, plugin: TinyPlugin
) -> None:
    registration = _registered(fake_kubelet, plugin)
    registration.next_update(TIMEOUT)
    registration.next_update(TIMEOUT)
    with pytest.raises(AssertionError, match="no ListAndWatch update within"):
        registration.next_update(0.1)
    with pytest.raises(AssertionError, match="still open"):
        registration.wait_ended(0.1)


def test_invalid_version_is_refused(fake_kubelet: FakeKubelet, plugin: TinyPlugin) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        plugin.register(fake_kubelet.kubelet_socket, version="v1alpha1")
    error: Any = caught.value
    assert error.code() == grpc.StatusCode.UNKNOWN
    assert error.details() == (
        'requested API version "v1alpha1" is not supported by kubelet. '
        'Supported version is ["v1beta1"]'
    )
    assert fake_kubelet.registrations == []
    [attempt] = fake_kubelet.attempts
    assert attempt.version == "v1alpha1"
    assert attempt.error == error.details()


@pytest.mark.parametrize(
    "name", ["gpu", "kubernetes.io/gpu", "requests.example.com/gpu", "example.com/a/b"]
)
def test_invalid_resource_name_is_refused(
    fake_kubelet: FakeKubelet, plugin: TinyPlugin, name: str
) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        plugin.register(fake_kubelet.kubelet_socket, resource=name)
    error: Any = caught.value
    assert error.code() == grpc.StatusCode.UNKNOWN
    assert error.details() == f'the ResourceName "{name}" is invalid'
    assert fake_kubelet.registrations == []


@pytest.mark.parametrize(
    ("name", "valid"),
    [
        ("nvidia.com/gpu", True),
        ("nvidia.com/mig-1g.5gb", True),
        ("nvidia.com/gpu.shared", True),
        ("example.com/A_b-c.D", True),
        ("example.com/" + "x" * 63, True),
        ("example.com/" + "x" * 64, False),
        ("gpu", False),
        ("kubernetes.io/gpu", False),
        ("sub.kubernetes.io/gpu", False),  # contains "kubernetes.io/": prefixed native
        ("requests.example.com/gpu", False),
        ("Example.com/gpu", False),  # the prefix is a lower-case DNS subdomain
        ("example.com/", False),
        ("/gpu", False),
        ("example.com/-gpu", False),
        ("example.com/gpu-", False),
        ("example.com/gpu\n", False),
        ("example.com/a/b", False),
        ("example_com/gpu", False),
        ("a" * 244 + "/gpu", True),  # "requests." + prefix is at most 253 characters
        ("a" * 245 + "/gpu", False),
    ],
)
def test_extended_resource_name_rules(name: str, valid: bool) -> None:
    assert is_extended_resource_name(name) is valid


@pytest.mark.parametrize("socket_state", ["missing", "stale"])
def test_register_fails_when_the_plugin_is_not_serving(
    device_plugin_dir: Path, grpc_stubs: StubModules, socket_state: str
) -> None:
    with FakeKubelet(device_plugin_dir, grpc_stubs, dial_timeout=0.5) as kubelet:
        plugin = TinyPlugin(device_plugin_dir, grpc_stubs)  # never started
        if socket_state == "stale":  # a socket file nobody listens on: ECONNREFUSED
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.bind(str(plugin.socket_path))
        with pytest.raises(grpc.RpcError) as caught:
            plugin.register(kubelet.kubelet_socket)
        error: Any = caught.value
        assert error.code() == grpc.StatusCode.UNKNOWN
        # The kubelet's error for a dial that blocked until its deadline (not a refused connect).
        assert error.details() == "failed to dial device plugin: context deadline exceeded"
        assert kubelet.registrations == []
        assert kubelet.wait_for_attempts(1, TIMEOUT)[0].error == error.details()


def test_options_failure_fails_register(device_plugin_dir: Path, grpc_stubs: StubModules) -> None:
    with FakeKubelet(device_plugin_dir, grpc_stubs) as kubelet:
        # A server that serves nothing: the dial succeeds, GetDevicePluginOptions does not.
        with UnixGrpcServer(device_plugin_dir / "empty.sock", lambda _: None, name="empty"):
            plugin = TinyPlugin(device_plugin_dir, grpc_stubs, endpoint="empty.sock")
            with pytest.raises(grpc.RpcError) as caught:
                plugin.register(kubelet.kubelet_socket)
        error: Any = caught.value
        assert error.code() == grpc.StatusCode.UNKNOWN
        assert error.details().startswith(
            "failed to get device plugin options: rpc error: code = Unimplemented desc = "
        )


def test_wait_for_registrations_times_out_with_an_assertion(fake_kubelet: FakeKubelet) -> None:
    with pytest.raises(AssertionError, match="expected at least 1 registration"):
        fake_kubelet.wait_for_registrations(1, 0.2)
    with pytest.raises(AssertionError, match="no connected registration"):
        fake_kubelet.allocate(["dev-0"])


def test_restart_deletes_sockets_and_recreates_kubelet_sock(
    fake_kubelet: FakeKubelet, plugin: TinyPlugin, short_tmp_path: Path
) -> None:
    registration = _registered(fake_kubelet, plugin)
    registration.next_update(TIMEOUT)
    directory = fake_kubelet.socket_dir
    (directory / "kubelet_internal_checkpoint").write_text("{}")
    (directory / "subdir").mkdir()
    # A hard link keeps the old inode alive, so the new kubelet.sock cannot reuse its number.
    old_link = short_tmp_path / "old-kubelet.sock"
    os.link(fake_kubelet.kubelet_socket, old_link)
    old_inode = old_link.stat().st_ino
    assert stat.S_ISSOCK(plugin.socket_path.stat().st_mode)

    fake_kubelet.restart()

    assert not plugin.socket_path.exists()
    assert (directory / "kubelet_internal_checkpoint").read_text() == "{}"
    assert (directory / "subdir").is_dir()
    assert (directory / "DEPRECATION").is_file()
    new_kubelet_sock = fake_kubelet.kubelet_socket.stat()
    assert stat.S_ISSOCK(new_kubelet_sock.st_mode)
    assert new_kubelet_sock.st_ino != old_inode
    assert len(fake_kubelet.restarts) == 1

    end = registration.wait_ended(TIMEOUT)
    assert end.closed_by_kubelet
    assert not end.ok
    assert not registration.connected

    # The plugin notices, serves a new socket and registers with the new kubelet.
    plugin.stop()
    plugin.start()
    plugin.register(fake_kubelet.kubelet_socket)
    again = fake_kubelet.wait_for_registrations(2, TIMEOUT)[1]
    assert again.received_at > fake_kubelet.restarts[0]
    assert _health(again.next_update(TIMEOUT)) == {"dev-0": "Healthy", "dev-1": "Healthy"}
    assert fake_kubelet.latest() is again


def test_allocate_preferred_and_pre_start_round_trip(
    fake_kubelet: FakeKubelet, plugin: TinyPlugin
) -> None:
    _registered(fake_kubelet, plugin)

    response = fake_kubelet.allocate(["dev-1", "dev-0"])
    assert len(response.container_responses) == 1
    assert dict(response.container_responses[0].envs) == {"TINY_DEVICES": "dev-1,dev-0"}
    assert plugin.allocations == [["dev-1", "dev-0"]]

    code, details = fake_kubelet.allocate_error(["dev-9"], resource=RESOURCE)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details == "unknown device dev-9"
    with pytest.raises(AssertionError, match="expected Allocate to fail"):
        fake_kubelet.allocate_error(["dev-0"])

    assert fake_kubelet.preferred(["dev-1", "dev-0"], [], 1) == ["dev-0"]
    assert fake_kubelet.preferred(["dev-0", "dev-1"], ["dev-1"], 2) == ["dev-1", "dev-0"]
    assert fake_kubelet.pre_start(["dev-0"]) == plugin.pb.PreStartContainerResponse()


def test_stream_end_is_recorded_when_the_plugin_stops(
    fake_kubelet: FakeKubelet, plugin: TinyPlugin
) -> None:
    registration = _registered(fake_kubelet, plugin)
    registration.next_update(TIMEOUT)
    registration.next_update(TIMEOUT)

    before = time.monotonic()
    plugin.stop()
    end = registration.wait_ended(TIMEOUT)

    assert not end.ok
    assert not end.closed_by_kubelet
    assert end.code in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)
    assert end.at >= before
    # Like the kubelet, the connection is dropped and never re-dialled.
    assert not registration.connected
    with pytest.raises(AssertionError, match="no connected registration"):
        fake_kubelet.allocate(["dev-0"])
    with pytest.raises(AssertionError, match="stream already ended"):
        registration.next_update(TIMEOUT)


def test_stream_finished_by_the_plugin_ends_ok(
    fake_kubelet: FakeKubelet, grpc_stubs: StubModules
) -> None:
    plugin = TinyPlugin(fake_kubelet.socket_dir, grpc_stubs, finish_stream=True)
    plugin.start()
    try:
        registration = _registered(fake_kubelet, plugin)
        end = registration.wait_ended(TIMEOUT)
        assert end.ok
        assert end.details == ""
        assert len(registration.history) == 2
        # Updates that arrived before the end stay readable, then the end is reported.
        assert _health(registration.next_update(TIMEOUT))["dev-1"] == "Healthy"
        assert _health(registration.next_update(TIMEOUT))["dev-1"] == "Unhealthy"
        with pytest.raises(AssertionError, match="stream already ended"):
            registration.next_update(TIMEOUT)
        with pytest.raises(AssertionError, match="stream already ended"):
            registration.wait_until(lambda _: True, TIMEOUT)
    finally:
        plugin.stop()


def test_stop_is_idempotent_and_ends_streams(
    device_plugin_dir: Path, grpc_stubs: StubModules
) -> None:
    kubelet = FakeKubelet(device_plugin_dir, grpc_stubs)
    kubelet.start()
    kubelet.start()  # no-op
    plugin = TinyPlugin(device_plugin_dir, grpc_stubs)
    plugin.start()
    try:
        registration = _registered(kubelet, plugin)
        kubelet.stop()
        kubelet.stop()
        assert registration.wait_ended(TIMEOUT).closed_by_kubelet
        assert not kubelet.running
    finally:
        plugin.stop()
        kubelet.stop()


def test_go_status_text() -> None:
    assert go_status_text(grpc.StatusCode.CANCELLED, "x") == "rpc error: code = Canceled desc = x"
    assert (
        go_status_text(grpc.StatusCode.DEADLINE_EXCEEDED, "y")
        == "rpc error: code = DeadlineExceeded desc = y"
    )


def test_generate_again_reuses_the_imported_modules(grpc_stubs: StubModules) -> None:
    assert kubelet_stubs() is grpc_stubs
    generated = Path(grpc_stubs.dp_grpc.__file__ or "").parents[2]
    assert (generated / "deviceplugin" / "v1beta1" / "api_pb2_grpc.py").is_file()
    assert (generated / "podresources" / "v1" / "api_pb2.pyi").is_file()
    # Same-named messages of the two packages stay distinct.
    assert grpc_stubs.dp_pb2.NUMANode.DESCRIPTOR.full_name == "v1beta1.NUMANode"
    assert grpc_stubs.pr_pb2.NUMANode.DESCRIPTOR.full_name == "v1.NUMANode"
    assert hasattr(grpc_stubs.pr_grpc, "PodResourcesListerStub")


async def test_async_tests_run_on_both_event_loops(request: pytest.FixtureRequest) -> None:
    loop_name = request.node.callspec.id
    assert loop_name in ("asyncio", "uvloop")
    assert isinstance(asyncio.get_running_loop(), uvloop.Loop) == (loop_name == "uvloop")
