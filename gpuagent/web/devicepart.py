"""The cached device part of /metrics: one snapshot version's bytes, and its gzip stream."""

from __future__ import annotations

import asyncio
import struct
import time
import zlib
from collections.abc import Iterable

__all__ = ["DevicePart", "hand_back"]

_GZIP_HEADER = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff"  # deflate, no name, no mtime
#: Bytes compressed in one go (about 0.2 ms at level 1) before the event loop is handed back.
_PIECE = 64 * 1024
#: The timer a slice ends on (see :func:`hand_back`): shorter than the loop's select can wait.
_HAND_BACK_S = 1e-6


async def hand_back() -> None:
    """Hand the event loop back between two slices of work, behind what fell due meanwhile.

    Not ``sleep(0)``: a task resumed that way runs in the loop's next turn *before* the timers
    that fell due during its slice, so two slices ran back to back between them; a timer due at
    once is queued behind those timers.
    """
    await asyncio.sleep(_HAND_BACK_S)


class DevicePart:
    """The device part of one snapshot version, as byte chunks, and (once asked) its gzip stream.

    The (large) device part is compressed once per version, ending on a sync flush; each gzip
    scrape then compresses only its (small) agent part and appends it, with the trailer (CRC-32
    and size of the whole), to the cached prefix. :meth:`deflate` compresses it in pieces, handing
    the event loop back between them; scrapes that ask meanwhile wait for the same compression.
    """

    __slots__ = ("_crc", "_deflated", "_deflating", "chunks", "size", "version")

    def __init__(self, version: int, chunks: Iterable[bytes] = ()) -> None:
        self.version = version
        self.chunks = list(chunks)
        self.size = sum(map(len, self.chunks))
        self._deflated: bytes | None = None
        self._deflating: asyncio.Task[None] | None = None
        self._crc = 0

    @property
    def text(self) -> bytes:
        return b"".join(self.chunks)

    async def deflate(self, slice_s: float) -> None:
        """Compress the device part (once), holding the loop at most about ``slice_s`` at a time
        (and one piece of :data:`_PIECE` bytes)."""
        if self._deflated is not None:
            return
        if self._deflating is None:
            self._deflating = asyncio.create_task(self._deflate(slice_s), name="metrics-gzip")
        await asyncio.shield(self._deflating)

    async def _deflate(self, slice_s: float) -> None:
        compressor = zlib.compressobj(1, zlib.DEFLATED, -15)
        out: list[bytes] = []
        crc = 0
        began = time.perf_counter()
        for chunk in self.chunks:
            view = memoryview(chunk)
            for i in range(0, len(view), _PIECE):
                piece = view[i : i + _PIECE]
                out.append(compressor.compress(piece))
                crc = zlib.crc32(piece, crc)
                if time.perf_counter() - began >= slice_s:
                    await hand_back()
                    began = time.perf_counter()
        out.append(compressor.flush(zlib.Z_SYNC_FLUSH))
        self._crc, self._deflated = crc, b"".join(out)

    def gzip(self, tail: bytes) -> list[bytes]:
        """Chunks that together are the gzip stream of the device part followed by ``tail``."""
        if self._deflated is None:
            text = self.text
            compressor = zlib.compressobj(1, zlib.DEFLATED, -15)
            self._deflated = compressor.compress(text) + compressor.flush(zlib.Z_SYNC_FLUSH)
            self._crc = zlib.crc32(text)
        compressor = zlib.compressobj(1, zlib.DEFLATED, -15)
        end = compressor.compress(tail) + compressor.flush()
        trailer = struct.pack(
            "<II", zlib.crc32(tail, self._crc), (self.size + len(tail)) & 0xFFFFFFFF
        )
        return [_GZIP_HEADER, self._deflated, end + trailer]
