"""A plugin endpoint's failures: one line naming the path, published for /readyz, then retries."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs
from support.fake_kubelet import FakeKubelet
from support.grpcstubs import StubModules
from support.nodes import gpu, node
from support.waiting import eventually

from gpuagent.domain.devices import Registration
from gpuagent.domain.serving import ResourceView
from gpuagent.kubelet import registration
from gpuagent.kubelet.plugin import DevicePluginService
from gpuagent.kubelet.registration import MAX_REASON, PluginEndpoint
from gpuagent.kubelet.timing import Timing
from gpuagent.sockets.dirwatch import file_in_the_way
from gpuagent.state.store import DeviceStore

GPU = "nvidia.com/gpu"
FAST = Timing(backoff_initial=0.001, backoff_max=0.001, register_retry_max=0.001)
T = 15.0


def endpoint(
    store: DeviceStore, socket_path: Path, kubelet: Path, timing: Timing
) -> PluginEndpoint:
    service = DevicePluginService(store, ResourceView(), GPU, asyncio.Event())
    return PluginEndpoint(
        service, store, socket_path=socket_path, kubelet_socket=kubelet, resource_name=GPU,
        timing=timing,
    )  # fmt: skip


async def test_a_socket_dir_that_cannot_hold_sockets_is_named_once(short_tmp_path: Path) -> None:
    kubelet = short_tmp_path / "kubelet.sock"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(kubelet))  # the kubelet is there; our directory is not usable
    not_a_dir = short_tmp_path / "device-plugins"
    not_a_dir.write_text("a file where the socket directory should be")
    store = DeviceStore(node(gpu(0)))
    plugin = endpoint(store, not_a_dir / "nvidia-gpu.sock", kubelet, FAST)
    with capture_logs() as logs:
        task = asyncio.create_task(plugin.run())
        try:
            await eventually(lambda: sum(e["log_level"] == "debug" for e in logs) >= 3,
                             what="three retries")  # fmt: skip
        finally:
            task.cancel()
            await asyncio.wait({task})
            listener.close()
    errors = [e for e in logs if e["log_level"] == "error"]
    assert len(errors) == 1  # not once per retry, and without a traceback
    assert str(not_a_dir / "nvidia-gpu.sock") in errors[0]["event"]
    assert "--socket-dir" in errors[0]["event"]
    assert "exc_info" not in errors[0] or not errors[0]["exc_info"]
    assert state(store).error == "stopped"


async def test_an_absent_kubelet_socket_is_named_and_published(short_tmp_path: Path) -> None:
    kubelet = short_tmp_path / "nowhere" / "kubelet.sock"
    store = DeviceStore(node(gpu(0)))
    timing = Timing(backoff_initial=0.001, backoff_max=0.001, kubelet_grace=0.0)
    plugin = endpoint(store, short_tmp_path / "nvidia-gpu.sock", kubelet, timing)
    with capture_logs() as logs:
        task = asyncio.create_task(plugin.run())
        try:
            await eventually(lambda: GPU in store.snapshot.registrations, what="a published state")
            await eventually(
                lambda: any(e["log_level"] == "warning" for e in logs), what="a warning"
            )
            error = state(store).error
        finally:
            task.cancel()
            await asyncio.wait({task})
    assert str(kubelet) in error
    assert "--kubelet-socket" in error
    assert len(error) <= MAX_REASON


async def test_a_stale_kubelet_socket_is_logged_once_not_per_retry(short_tmp_path: Path) -> None:
    """A kubelet.sock nobody listens on (a kubelet that died without removing it): one line
    for serving, one for the refused connection, then retries with a backoff and no more lines
    until something changes."""
    kubelet = short_tmp_path / "kubelet.sock"
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(kubelet))
    stale.close()  # the file stays; nobody listens
    store = DeviceStore(node(gpu(0)))
    # Retries 1, 2, 4, … ms apart: the test, woken every 5 ms, sees the sixth serve before the
    # seventh can start (it is cancelled in the back-off, never half-way through serving).
    timing = Timing(backoff_initial=0.001, register_retry_max=HOUR)
    plugin = endpoint(store, short_tmp_path / "nvidia-gpu.sock", kubelet, timing)
    with capture_logs() as logs:
        task = asyncio.create_task(plugin.run())
        try:
            await eventually(
                lambda: sum(e["event"] == "serving device plugin" for e in logs) >= 6,
                what="six serves",
            )
        finally:
            task.cancel()
            await asyncio.wait({task})
    lines = [e["event"] for e in logs if e["log_level"] != "debug" and ours(e)]
    assert lines == ["serving device plugin", lines[1]], lines
    assert lines[1].startswith("kubelet unreachable: ConnectionRefusedError")


async def test_a_socket_dir_replaced_by_a_file_is_named_once(
    short_tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The socket directory (holding the kubelet socket) replaced by a file while the agent runs:
    logged once as "not a directory" and published; the endpoint keeps waiting, and a directory
    back in its place is seen."""
    directory = short_tmp_path / "device-plugins"
    directory.write_text("not a directory")
    looks: list[Path] = []

    def counted(path: Path) -> Path | None:
        looks.append(path)
        return file_in_the_way(path)

    monkeypatch.setattr(registration, "file_in_the_way", counted)
    store = DeviceStore(node(gpu(0)))
    timing = Timing(backoff_initial=0.001, backoff_max=0.001)
    kubelet = directory / "kubelet.sock"
    plugin = endpoint(store, directory / "nvidia-gpu.sock", kubelet, timing)
    with capture_logs() as logs:
        task = asyncio.create_task(plugin.run())
        try:
            await eventually(lambda: "not a directory" in state(store).error, what="published")
            await eventually(lambda: len(looks) >= 5, what="five looks at the directory")
            directory.unlink()
            directory.mkdir()
            await eventually(lambda: "not a directory" not in state(store).error, what="seen")
        finally:
            task.cancel()
            await asyncio.wait({task})
    lines = [(e["event"], e["log_level"]) for e in logs if e["log_level"] != "debug" and ours(e)]
    assert lines[:2] == [
        ("polling directories", "info"),
        (f"waiting for the kubelet socket {kubelet}: {directory} is not a directory", "warning"),
    ]
    polling = next(e for e in logs if e["event"] == "polling directories")
    assert polling["reason"] == f"{directory} is not a directory"
    assert (f"waiting for the kubelet socket {kubelet}", "info") in lines[2:]
    assert sum("not a directory" in event for event, _ in lines) == 1


def ours(entry: Mapping[str, Any]) -> bool:
    """A log entry of the endpoint or its directory watch (not of a thread an earlier test left
    behind, which may still log while this one runs)."""
    return entry.get("resource") == GPU or "socket" in entry or "directories" in entry


def state(store: DeviceStore) -> Registration:
    return store.snapshot.registrations.get(GPU, Registration(error="not published"))


# Inotify: the poll interval and the kubelet wait's backoff are an hour, so only a directory
# event can wake the endpoint; a refused Register (a kubelet socket bound but not listening yet)
# is retried soon. Polling (where inotify cannot be had): short intervals, inotify off.
HOUR = 3600.0
ON_INOTIFY = Timing(
    watch_interval=HOUR, backoff_initial=0.001, backoff_max=HOUR, register_retry_max=0.01
)
POLLING = Timing(watch_interval=0.01, backoff_initial=0.01, backoff_max=0.01, inotify=False)


@pytest.mark.parametrize("timing", [ON_INOTIFY, POLLING], ids=["inotify", "polling"])
async def test_kubelet_start_restart_and_a_takeover_are_followed(
    timing: Timing, device_plugin_dir: Path, grpc_stubs: StubModules
) -> None:
    await asyncio.to_thread(device_plugin_dir.mkdir)
    store = DeviceStore(node(gpu(0)))
    plugin = endpoint(
        store, device_plugin_dir / "nvidia-gpu.sock", device_plugin_dir / "kubelet.sock", timing
    )
    with capture_logs() as logs:
        await _start_restart_and_takeover(plugin, store, device_plugin_dir, grpc_stubs)
    # Each end of a registration said as what it was: the takeover's end is no kubelet restart
    # (the restart itself may be met by the first Register, still waiting for its answer).
    events = [e["event"] for e in logs]
    after = events[events.index("another plugin took over the socket; standing by") :]
    assert [e for e in after if "registering again" in e] == [
        "the plugin that took over our socket is gone; serving and registering again",
    ]


async def _start_restart_and_takeover(
    plugin: PluginEndpoint, store: DeviceStore, device_plugin_dir: Path, grpc_stubs: StubModules
) -> None:
    task = asyncio.create_task(plugin.run())
    try:
        await eventually(lambda: "waiting for the kubelet" in state(store).error,
                         what="waiting for the kubelet")  # fmt: skip
        with FakeKubelet(device_plugin_dir, grpc_stubs) as kubelet:
            await asyncio.to_thread(kubelet.wait_for_registrations, 1, T)  # the kubelet came
            await asyncio.to_thread(kubelet.restart)
            await asyncio.to_thread(kubelet.wait_for_registrations, 2, T)  # it restarted
            await eventually(lambda: state(store).registered,
                             what="registered")  # fmt: skip

            # A rolling update's new agent serves our socket path: stand by, never take it back.
            sock = device_plugin_dir / "nvidia-gpu.sock"
            sock.unlink()
            other = socket.socket(socket.AF_UNIX)
            other.bind(str(sock))
            await eventually(
                lambda: state(store).error == "another plugin serves this socket",
                what="standing by",
            )
            assert len(kubelet.attempts) == 2
            # It goes away (its socket with it): serve and register again.
            other.close()
            sock.unlink()
            await asyncio.to_thread(kubelet.wait_for_registrations, 3, T)
            await eventually(lambda: state(store).registered,
                             what="registered again")  # fmt: skip
    finally:
        task.cancel()
        await asyncio.wait({task})


@pytest.mark.parametrize("timing", [ON_INOTIFY, POLLING], ids=["inotify", "polling"])
async def test_a_socket_deleted_by_hand_is_served_again_after_the_settle_time(
    timing: Timing, device_plugin_dir: Path, grpc_stubs: StubModules
) -> None:
    """Not another plugin (nothing binds the path), not a kubelet restart (its socket stays)."""
    store = DeviceStore(node(gpu(0)))
    with FakeKubelet(device_plugin_dir, grpc_stubs) as kubelet:
        sock = device_plugin_dir / "nvidia-gpu.sock"
        plugin = endpoint(store, sock, kubelet.kubelet_socket, replace(timing, settle=0.05))
        with capture_logs() as logs:
            task = asyncio.create_task(plugin.run())
            try:
                await asyncio.to_thread(kubelet.wait_for_registrations, 1, T)
                await eventually(lambda: state(store).registered, what="registered")
                await asyncio.to_thread(sock.unlink)
                await asyncio.to_thread(kubelet.wait_for_registrations, 2, T)
                await eventually(sock.exists, what="our socket again")
            finally:
                task.cancel()
                await asyncio.wait({task})
    assert [e["event"] for e in logs if "registering again" in e["event"]] == [
        "our plugin socket was removed; serving and registering again"
    ]
