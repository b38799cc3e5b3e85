"""The cached device part of /metrics: one snapshot version's bytes, and its gzip stream."""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterable

__all__ = ["DevicePart"]

_GZIP_HEADER = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff"  # deflate, no name, no mtime


class DevicePart:
    """The device part of one snapshot version, as byte chunks, and (once asked) its gzip stream.

    The (large) device part is compressed once per version, ending on a sync flush; each gzip
    scrape then compresses only its (small) agent part and appends it, with the trailer (CRC-32
    and size of the whole), to the cached prefix.
    """

    __slots__ = ("_crc", "_deflated", "chunks", "size", "version")

    def __init__(self, version: int, chunks: Iterable[bytes] = ()) -> None:
        self.version = version
        self.chunks = list(chunks)
        self.size = sum(map(len, self.chunks))
        self._deflated: bytes | None = None
        self._crc = 0

    @property
    def text(self) -> bytes:
        return b"".join(self.chunks)

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
