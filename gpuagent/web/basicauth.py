"""Basic auth for the web config's users: bcrypt hashes checked off the event loop, bounded."""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import hmac
import os
from collections.abc import Mapping

import bcrypt

__all__ = ["AuthResult", "BasicAuth"]


class AuthResult:
    OK = "ok"
    DENIED = "denied"
    BUSY = "busy"


# A bcrypt hash (cost 10) of a random password nobody knows: checked for unknown users so that
# a wrong user name takes as long as a wrong password.
_DUMMY_HASH = b"$2b$10$9VhRCzQ3S9Cr22PfC8wnCueaBD0PgA.hOrvmq35mSzuxJYVeFDzdS"


class BasicAuth:
    """Checks ``Authorization: Basic`` headers against bcrypt hashes, off the event loop.

    bcrypt is slow by design (cost 10 ≈ 70 ms), so checks run in worker threads, at most
    ``MAX_CONCURRENT`` at a time; when ``MAX_WAITING`` more are queued, further attempts are turned
    away at once (``BUSY`` → 429) instead of queueing without bound. Results — good and bad — are
    cached by a salted digest of the credentials (bounded), so a scraper pays for bcrypt once.
    """

    MAX_CONCURRENT = 2
    MAX_WAITING = 16
    CACHE_SIZE = 256
    MAX_HEADER = 1024

    def __init__(self, users: Mapping[str, bytes]) -> None:
        self.users = users
        self._salt = os.urandom(16)
        self._cache: dict[bytes, bool] = {}
        self._semaphore: asyncio.Semaphore | None = None
        self._waiting = 0

    @property
    def enabled(self) -> bool:
        return bool(self.users)

    async def check(self, authorization: str | None) -> str:
        if not self.users:
            return AuthResult.OK
        credentials = _parse_basic(authorization, self.MAX_HEADER)
        if credentials is None:
            return AuthResult.DENIED
        user, password = credentials
        key = hashlib.sha256(self._salt + user + b"\0" + password).digest()
        cached = self._cache.get(key)
        if cached is not None:
            return AuthResult.OK if cached else AuthResult.DENIED
        if self._waiting >= self.MAX_WAITING:
            return AuthResult.BUSY
        if self._semaphore is None:
            self._semaphore = asyncio.Semaphore(self.MAX_CONCURRENT)
        self._waiting += 1
        try:
            async with self._semaphore:
                ok = await asyncio.to_thread(self._verify, user, password)
        finally:
            self._waiting -= 1
        if len(self._cache) >= self.CACHE_SIZE:
            self._cache.clear()
        self._cache[key] = ok
        return AuthResult.OK if ok else AuthResult.DENIED

    def _verify(self, user: bytes, password: bytes) -> bool:
        try:
            name = user.decode()
        except UnicodeDecodeError:
            name = ""
        hashed = self.users.get(name)
        known = hashed is not None
        try:
            ok = bcrypt.checkpw(password, hashed if hashed is not None else _DUMMY_HASH)
        except ValueError:
            ok = False
        return known and ok and hmac.compare_digest(name.encode(), user)


def _parse_basic(header: str | None, limit: int) -> tuple[bytes, bytes] | None:
    if not header or len(header) > limit:
        return None
    scheme, _, encoded = header.partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        decoded = base64.b64decode(encoded.strip(), validate=True)
    except (binascii.Error, ValueError):
        return None
    user, sep, password = decoded.partition(b":")
    if not sep:
        return None
    return user, password
