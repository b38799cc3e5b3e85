"""The DRA endpoint's sockets: served again when one disappears, seen by inotify (or by polling
where inotify cannot be had), and registered anew by the kubelet's plugin watcher (grpcio)."""

from __future__ import annotations

import asyncio
import shutil
import stat
from collections.abc import Callable, MutableMapping
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import structlog.testing
from support.fake_plugin_watcher import FakePluginWatcher
from support.grpcstubs import DraStubs
from support.waiting import eventually

from gpuagent.domain.devices import Registration
from gpuagent.dra.endpoint import DraEndpoint, EndpointTiming

DRIVER = "gpu.nvidia.com"
# Inotify: the poll interval is an hour, so only a directory event can wake the endpoint.
# Polling (where inotify cannot be had): a short interval, inotify off.
HOUR = 3600.0
ON_INOTIFY = EndpointTiming(watch_interval=HOUR, retry_initial=0.01, retry_max=0.05)
POLLING = replace(ON_INOTIFY, watch_interval=0.01, inotify=False)
SERVING_AGAIN = "a dra socket disappeared; serving again"


def socket_id(path: Path) -> tuple[int, int] | None:
    """Which socket file is at ``path`` (inode and change time), if one is."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return (st.st_ino, st.st_ctime_ns) if stat.S_ISSOCK(st.st_mode) else None


def served_again(logs: list[MutableMapping[str, Any]], times: int) -> bool:
    return len([e for e in logs if e["event"] == SERVING_AGAIN]) == times


def new_socket(path: Path, before: tuple[int, int] | None) -> bool:
    return socket_id(path) not in (None, before)


@pytest.mark.parametrize("timing", [ON_INOTIFY, POLLING], ids=["inotify", "polling"])
async def test_a_socket_or_directory_removed_is_served_and_registered_again(
    timing: EndpointTiming, short_tmp_path: Path, dra_stubs: DraStubs
) -> None:
    registry = short_tmp_path / "plugins_registry"
    endpoint = DraEndpoint(
        [],
        driver=DRIVER,
        supported=("v1.DRAPlugin",),
        plugins_dir=short_tmp_path / "plugins",
        registry_dir=registry,
        timing=timing,
    )
    watcher = FakePluginWatcher(registry, dra_stubs)
    steps: list[tuple[str, Callable[[], None]]] = [
        ("start", lambda: None),
        ("registration socket", endpoint.registration_socket.unlink),
        ("service socket", endpoint.dra_socket.unlink),
        ("registry directory", lambda: shutil.rmtree(registry)),
    ]
    with structlog.testing.capture_logs() as logs:
        task = asyncio.create_task(endpoint.run())
        try:
            for served, (what, remove) in enumerate(steps):
                before = socket_id(endpoint.registration_socket)
                remove()
                await eventually(
                    partial(served_again, logs, served),
                    what=f"served again after the {what} was removed",
                )
                # The service socket is served first, then a new registration socket.
                await eventually(
                    partial(new_socket, endpoint.registration_socket, before),
                    what="a new registration socket",
                )
                socket = await asyncio.to_thread(watcher.find)
                registration = await asyncio.to_thread(watcher.register, socket)
                assert registration.error == ""
                assert registration.endpoint == str(endpoint.dra_socket)
                await eventually(lambda: endpoint.registered, what=f"registered after {what}")
                assert endpoint.registrations == served + 1
        finally:
            task.cancel()
            await asyncio.wait({task})
    assert not endpoint.registration_socket.exists()
    assert not endpoint.dra_socket.exists()


async def test_cancel_as_a_server_finishes_closing_stops_the_endpoint(
    short_tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cancellation that arrives as a server finishes closing (a socket was removed) ends
    run(), and both servers are closed and their sockets removed; asyncio.wait_for before
    Python 3.12 swallowed it with the close, and the endpoint served again."""
    endpoint = DraEndpoint(
        [],
        driver=DRIVER,
        supported=("v1.DRAPlugin",),
        plugins_dir=short_tmp_path / "plugins",
        registry_dir=short_tmp_path / "plugins_registry",
        timing=ON_INOTIFY,
    )
    task = asyncio.create_task(endpoint.run())
    try:
        await eventually(endpoint.registration_socket.exists, what="the endpoint serving")
        closing = asyncio.Event()
        closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        for server in (s.server for s in endpoint._servers):

            async def finish_when_told(close: Callable[[], Any] = server.wait_closed) -> None:
                await close()
                closing.set()
                await closed

            monkeypatch.setattr(server, "wait_closed", finish_when_told)
        endpoint.registration_socket.unlink()
        await eventually(closing.is_set, what="a server closing")
        closed.set_result(None)  # the close finishes in the same turn of the loop as the cancel
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=10.0)
        assert task in done, "run() went on after it was cancelled"
        assert task.cancelled()
        assert not endpoint.dra_socket.exists()
        assert not endpoint.registration_socket.exists()
    finally:
        task.cancel()
        await asyncio.wait({task})


async def test_a_registry_directory_that_is_a_file_is_named_once(short_tmp_path: Path) -> None:
    """A file where the plugin registry directory should be: one error naming it "not a
    directory" (published for /readyz), retries without a line each, and once a directory is back
    in its place the sockets are served and the error is gone."""
    registry = short_tmp_path / "plugins_registry"
    registry.write_text("not a directory")
    told: list[Registration] = []  # what the DRA side would put in the store
    endpoint = DraEndpoint(
        [],
        driver=DRIVER,
        supported=("v1.DRAPlugin",),
        plugins_dir=short_tmp_path / "plugins",
        registry_dir=registry,
        timing=EndpointTiming(watch_interval=HOUR, retry_initial=0.001, retry_max=0.001),
        on_state=told.append,
    )
    with structlog.testing.capture_logs() as logs:
        task = asyncio.create_task(endpoint.run())
        try:
            await eventually(
                lambda: sum(e["event"] == "dra endpoint failed; retrying" for e in logs) >= 5,
                what="five retries",
            )
            assert (
                endpoint.last_error
                == f"cannot serve the DRA sockets: {registry} is not a directory"
            )
            registry.unlink()
            await eventually(
                lambda: any(e["event"] == "dra sockets served again" for e in logs),
                what="the sockets served",
            )
            assert endpoint.last_error == ""
        finally:
            task.cancel()
            await asyncio.wait({task})
    # Told once per change, not once per retry: the error, then its end.
    problem = f"cannot serve the DRA sockets: {registry} is not a directory"
    assert told == [Registration(error=problem), Registration()]
    lines = [(e["event"], e.get("error")) for e in logs if e["log_level"] not in ("debug",)]
    failed = [line for line in lines if line[0] == "dra endpoint failed; retrying"]
    assert failed == [
        ("dra endpoint failed; retrying",
         f"cannot serve the DRA sockets: {registry} is not a directory"),
    ]  # fmt: skip
    # The service socket's first serve (the registry failed after it); the retries' are debug.
    assert sum(event == "serving" for event, _ in lines) == 1
