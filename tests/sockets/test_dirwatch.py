"""Directory watches: inotify wakes a waiter on a change; where inotify cannot be had, polling.

Each inotify test waits with a poll interval of an hour, so only a kernel event can wake it.
"""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
import socket
from contextlib import closing
from pathlib import Path

import pytest
from structlog.testing import capture_logs
from support.tasks import awaiting
from support.waiting import eventually

from gpuagent.sockets import dirwatch
from gpuagent.sockets.dirwatch import DirectoryWatch

HOUR = 3600.0
T = 10.0  # a deadline for a broken build, not a timing


def live(watch: DirectoryWatch) -> bool:
    return watch.live  # (a call: mypy would keep a property's narrowing across awaits)


async def woken(watch: DirectoryWatch) -> None:
    await asyncio.wait_for(watch.wait(HOUR), T)


async def test_a_created_or_deleted_entry_wakes_the_waiter(tmp_path: Path) -> None:
    with closing(DirectoryWatch([tmp_path])) as watch:
        assert live(watch)
        waiter = asyncio.create_task(woken(watch))
        await asyncio.sleep(0)
        assert not waiter.done()
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(str(tmp_path / "kubelet.sock"))  # a socket, as the kubelet creates one
        await waiter
        listener.close()
        waiter = asyncio.create_task(woken(watch))
        (tmp_path / "kubelet.sock").unlink()
        await waiter


async def test_a_change_between_two_waits_is_not_lost(tmp_path: Path) -> None:
    with closing(DirectoryWatch([tmp_path])) as watch:
        (tmp_path / "a").touch()
        await asyncio.sleep(0)  # the loop reads the event while nobody waits
        await woken(watch)
        (tmp_path / "a").rename(tmp_path / "b")
        await woken(watch)


async def test_without_a_change_the_waiter_sleeps_until_its_timeout(tmp_path: Path) -> None:
    with closing(DirectoryWatch([tmp_path])) as watch:
        waiter = asyncio.create_task(watch.wait(HOUR, at_most=HOUR))
        await eventually(lambda: awaiting(waiter) == ["wait", "wait"], what="the waiter's wait")
        assert not waiter.done()
        waiter.cancel()
        await asyncio.wait({waiter})


async def test_every_directory_is_watched(tmp_path: Path) -> None:
    one, two = tmp_path / "plugins", tmp_path / "kubelet"
    one.mkdir()
    two.mkdir()
    with closing(DirectoryWatch([one, two, one])) as watch:
        assert live(watch)
        for directory in (one, two):
            waiter = asyncio.create_task(woken(watch))
            (directory / "x.sock").touch()
            await waiter


async def test_a_missing_directory_is_polled_until_it_appears(tmp_path: Path) -> None:
    missing = tmp_path / "device-plugins"
    with capture_logs() as logs, closing(DirectoryWatch([missing])) as watch:
        assert not live(watch)
        await asyncio.wait_for(watch.wait(0.001), T)  # polls
        missing.mkdir()
        await asyncio.wait_for(watch.wait(0.001), T)  # arms the watch again
        assert live(watch)
        waiter = asyncio.create_task(woken(watch))
        (missing / "kubelet.sock").touch()
        await waiter
    assert [e["event"] for e in logs] == [
        "polling directories", "watching directories with inotify",
    ]  # fmt: skip
    assert "does not exist" in logs[0]["reason"]


async def test_two_missing_directories_are_logged_once_together(tmp_path: Path) -> None:
    """The reasons for polling are logged once for all directories, not once per directory and
    wake-up (they would take turns)."""
    one, two = tmp_path / "plugins", tmp_path / "registry"
    with capture_logs() as logs, closing(DirectoryWatch([one, two])) as watch:
        for _ in range(5):
            await asyncio.wait_for(watch.wait(0.001), T)
    assert [(e["event"], e["reason"]) for e in logs if "directories" in e] == [
        ("polling directories", f"{one} does not exist yet; {two} does not exist yet")
    ]


@pytest.mark.parametrize("below", [False, True], ids=["the-directory", "a-directory-above"])
async def test_a_file_where_the_directory_should_be_is_named(tmp_path: Path, below: bool) -> None:
    """A file in the directory's place (or in place of one above it) is "not a directory", not a
    directory that does not exist yet; once a directory replaces it, it is watched."""
    blocker = tmp_path / "device-plugins"
    blocker.write_text("not a directory")
    directory = blocker / "sub" if below else blocker
    assert dirwatch.file_in_the_way(directory) == blocker
    assert dirwatch.file_in_the_way(tmp_path / "absent" / "sub") is None
    with capture_logs() as logs, closing(DirectoryWatch([directory])) as watch:
        await asyncio.wait_for(watch.wait(0.001), T)
        assert not live(watch)
        blocker.unlink()
        directory.mkdir(parents=True)
        await asyncio.wait_for(watch.wait(0.001), T)
        assert live(watch)
    assert [(e["event"], e.get("reason")) for e in logs if "directories" in e] == [
        ("polling directories", f"{blocker} is not a directory"),
        ("watching directories with inotify", None),
    ]


async def test_a_directory_removed_and_created_again_is_watched_again(tmp_path: Path) -> None:
    directory = tmp_path / "device-plugins"
    directory.mkdir()
    with closing(DirectoryWatch([directory])) as watch:
        waiter = asyncio.create_task(woken(watch))
        shutil.rmtree(directory)
        await waiter
        directory.mkdir()
        await asyncio.wait_for(watch.wait(0.001), T)
        assert live(watch)
        waiter = asyncio.create_task(woken(watch))
        (directory / "kubelet.sock").touch()
        await waiter


async def test_a_moved_directory_is_no_longer_watched_under_its_old_name(tmp_path: Path) -> None:
    directory = tmp_path / "device-plugins"
    directory.mkdir()
    with closing(DirectoryWatch([directory])) as watch:
        waiter = asyncio.create_task(woken(watch))
        directory.rename(tmp_path / "elsewhere")
        await waiter
        await asyncio.wait_for(watch.wait(0.001), T)
        assert not live(watch)  # polls: nothing is at the path
        directory.mkdir()
        await asyncio.wait_for(watch.wait(0.001), T)
        assert live(watch)


async def test_polling_only_when_asked(tmp_path: Path) -> None:
    with closing(DirectoryWatch([tmp_path], inotify=False)) as watch:
        assert not live(watch)
        await asyncio.wait_for(watch.wait(0.001), T)  # returns after the poll interval


async def test_no_inotify_instance_left_falls_back_to_polling(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fs.inotify.max_user_instances reached: inotify_init1 fails with EMFILE."""

    def exhausted(self: object) -> None:
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(dirwatch._Inotify, "__init__", exhausted)
    with capture_logs() as logs:
        watch = DirectoryWatch([tmp_path])
    try:
        assert not live(watch)
        await asyncio.wait_for(watch.wait(0.001), T)
    finally:
        watch.close()
    (entry,) = logs
    assert entry["event"] == "polling directories"
    assert "Too many open files" in entry["reason"]


async def test_close_releases_the_descriptor(tmp_path: Path) -> None:
    watch = DirectoryWatch([tmp_path])
    inotify = watch._inotify
    assert inotify is not None
    watch.close()
    with pytest.raises(OSError, match="Bad file descriptor"):
        os.fstat(inotify.fd)
