"""Waking up when entries of a few directories change: inotify where the kernel offers it, a
poll interval where it does not.

Linux's inotify, reached through libc with :mod:`ctypes` (already loaded with the NVML bindings,
so this costs no import): no library of ours wraps it in fewer lines, and those on PyPI look libc
up with ``ctypes.util.find_library``, which runs ``ldconfig`` in a subprocess. A watch degrades to
polling, and says so once, when inotify cannot be had: no ``inotify_init1`` in the C library, the
per-user instance or watch limit reached (``fs.inotify.max_user_instances`` is often exhausted on
busy nodes), a directory that does not exist yet, or a file where a directory should be (retried
on every wake-up; the reasons, all directories together, are logged again only when they change).

A wake-up says only that something *may* have changed: callers re-check what they wait for after
every :meth:`DirectoryWatch.wait`. A change seen between two waits is kept, so the pattern
"create the watch, check, wait, check, wait…" never misses one.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import os
import stat
import struct
from collections.abc import Iterable
from pathlib import Path

import structlog

__all__ = ["DirectoryWatch", "file_in_the_way"]

log = structlog.get_logger("gpuagent.dirwatch")

# <sys/inotify.h>
_IN_MOVED_FROM = 0x00000040
_IN_MOVED_TO = 0x00000080
_IN_CREATE = 0x00000100
_IN_DELETE = 0x00000200
_IN_DELETE_SELF = 0x00000400
_IN_MOVE_SELF = 0x00000800
_IN_Q_OVERFLOW = 0x00004000
_IN_IGNORED = 0x00008000
_IN_ONLYDIR = 0x01000000
_IN_NONBLOCK = os.O_NONBLOCK
_IN_CLOEXEC = os.O_CLOEXEC
# Entries created, deleted or renamed in the directory; the directory itself going away.
_MASK = (
    _IN_CREATE | _IN_DELETE | _IN_MOVED_FROM | _IN_MOVED_TO | _IN_DELETE_SELF | _IN_MOVE_SELF
    | _IN_ONLYDIR
)  # fmt: skip
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len; then len bytes of name
_READ_SIZE = 64 * 1024


class _Inotify:
    """One inotify instance (a non-blocking file descriptor) and its watches."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self._add = libc.inotify_add_watch
        self._add.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32)
        self._add.restype = ctypes.c_int
        self._rm = libc.inotify_rm_watch
        self._rm.argtypes = (ctypes.c_int, ctypes.c_int)
        self._rm.restype = ctypes.c_int
        init = libc.inotify_init1
        init.argtypes = (ctypes.c_int,)
        init.restype = ctypes.c_int
        fd = init(_IN_NONBLOCK | _IN_CLOEXEC)
        if fd < 0:
            raise _os_error()
        self.fd: int = fd

    def add(self, directory: Path) -> int:
        wd = int(self._add(self.fd, os.fsencode(directory), _MASK))
        if wd < 0:
            raise _os_error()
        return wd

    def remove(self, wd: int) -> None:
        self._rm(self.fd, wd)  # fails only for a watch the kernel already dropped

    def read(self) -> list[tuple[int, int]]:
        """The pending events as (watch, mask); empty when none is pending."""
        events: list[tuple[int, int]] = []
        while True:
            try:
                data = os.read(self.fd, _READ_SIZE)
            except BlockingIOError:
                return events
            offset = 0
            while offset + _EVENT.size <= len(data):
                wd, mask, _, length = _EVENT.unpack_from(data, offset)
                events.append((wd, mask))
                offset += _EVENT.size + length

    def close(self) -> None:
        os.close(self.fd)


def _os_error() -> OSError:
    code = ctypes.get_errno()
    return OSError(code, os.strerror(code))


def file_in_the_way(directory: Path) -> Path | None:
    """The path at or above ``directory`` that is not a directory (a file where the directory,
    or one above it, should be), if any: nothing can be made or watched there. ``None`` when the
    nearest path that exists is a directory (the rest may be made, or appear)."""
    for candidate in (directory, *directory.parents):
        try:
            mode = os.stat(candidate).st_mode
        except OSError:  # absent, or under a file (ENOTDIR): look higher up
            continue
        return None if stat.S_ISDIR(mode) else candidate
    return None


class DirectoryWatch:
    """Wakes :meth:`wait` when an entry of one of ``directories`` is created, deleted or renamed,
    or one of the directories goes away.

    ``inotify=False`` polls only (tests of the fallback). Create and use it on the event loop
    that waits; :meth:`close` it there.
    """

    def __init__(self, directories: Iterable[Path], *, inotify: bool = True) -> None:
        self._directories = tuple(dict.fromkeys(directories))
        self._changed = asyncio.Event()
        self._watches: dict[int, Path] = {}  # watch descriptor -> directory
        self._inotify: _Inotify | None = None
        self._reading = False
        self._degraded = ""  # why the watch polls, as last logged
        if inotify:
            try:
                self._inotify = _Inotify()
            except (OSError, AttributeError) as exc:  # AttributeError: no such libc symbol
                self._polling(f"inotify unavailable: {exc}")
        else:
            self._degraded = "inotify not used"
        self._arm()
        self._changed.clear()  # what was there before the watch is the caller's first check

    @property
    def live(self) -> bool:
        """Whether the kernel watches every directory now (otherwise :meth:`wait` polls)."""
        return self._inotify is not None and len(self._watches) == len(self._directories)

    async def wait(self, poll: float, at_most: float | None = None) -> None:
        """Return after a change in a watched directory (also one seen since the last return),
        after ``poll`` seconds while the kernel does not watch them all, or after ``at_most``."""
        self._arm()
        if not self.live:
            at_most = poll if at_most is None else min(poll, at_most)
        if not self._changed.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(at_most):
                    await self._changed.wait()
        self._changed.clear()

    def close(self) -> None:
        """Stop watching; the instance is not usable afterwards."""
        inotify, self._inotify = self._inotify, None
        if inotify is not None:
            if self._reading:
                asyncio.get_running_loop().remove_reader(inotify.fd)
            inotify.close()
        self._watches.clear()

    def _arm(self) -> None:
        """Watch each directory not watched yet (it may have appeared since): a directory watched
        anew counts as a change, since its entries may have changed unseen."""
        inotify = self._inotify
        if inotify is None:
            return
        watched = set(self._watches.values())
        unwatched: list[str] = []
        for directory in self._directories:
            if directory in watched:
                continue
            try:
                self._watches[inotify.add(directory)] = directory
                self._changed.set()
            except OSError as exc:
                unwatched.append(_unwatchable(directory, exc))
        if unwatched:
            self._polling("; ".join(unwatched))
        if not self._reading:
            asyncio.get_running_loop().add_reader(inotify.fd, self._on_readable)
            self._reading = True
        if self.live and self._degraded:
            log.info("watching directories with inotify", directories=self._names())
            self._degraded = ""

    def _on_readable(self) -> None:
        inotify = self._inotify
        if inotify is None:
            return
        for wd, mask in inotify.read():
            if mask & _IN_MOVE_SELF:  # the watch would follow the directory: watch the path
                inotify.remove(wd)
            if mask & (_IN_IGNORED | _IN_MOVE_SELF):  # gone: watch the path again when it is back
                self._watches.pop(wd, None)
            elif mask & _IN_Q_OVERFLOW:
                log.debug("inotify queue overflowed")
        self._changed.set()

    def _polling(self, reason: str) -> None:
        if reason != self._degraded:
            log.info("polling directories", reason=reason, directories=self._names())
            self._degraded = reason

    def _names(self) -> list[str]:
        return [str(d) for d in self._directories]


def _unwatchable(directory: Path, exc: OSError) -> str:
    """Why ``directory`` cannot be watched, for the log."""
    if exc.errno in (errno.ENOENT, errno.ENOTDIR):
        blocker = file_in_the_way(directory)
        if blocker is not None:
            return f"{blocker} is not a directory"
        return f"{directory} does not exist yet"
    return f"cannot watch {directory}: {exc.strerror or exc}"
