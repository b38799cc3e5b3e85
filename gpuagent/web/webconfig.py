"""``--web-config-file``: TLS and basic auth in the Prometheus exporter-toolkit format.

The file is YAML (exporter-toolkit ``docs/web-configuration.md``)::

    tls_server_config:
      cert_file: server.crt            # relative paths are relative to the config file
      key_file: server.key
      client_ca_file: ca.crt           # optional: verify client certificates
      client_auth_type: RequireAndVerifyClientCert
      min_version: TLS12               # TLS10 … TLS13
      max_version: TLS13
    http_server_config:
      headers:                         # added to every response
        Strict-Transport-Security: max-age=31536000
    basic_auth_users:
      prometheus: $2b$10$…             # bcrypt hashes only

Unknown keys, and exporter-toolkit keys this implementation cannot honour (inline PEM,
``cipher_suites``, ``curve_preferences``, ``client_allowed_sans``, ``rate_limit``, the client-auth
types that skip verification), are rejected with a :class:`WebConfigError` naming the key, so a
security setting is never silently ignored.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import hmac
import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

import bcrypt
import structlog

from gpuagent.domain.errors import SettingError
from gpuagent.yamlfile import YamlFileError, read_yaml

__all__ = [
    "AuthResult",
    "BasicAuth",
    "TlsConfig",
    "WebConfig",
    "WebConfigError",
    "WebConfigFile",
    "load_web_config",
    "parse_web_config",
]

log = structlog.get_logger("gpuagent.http")

_TLS_VERSIONS = {
    "TLS10": ssl.TLSVersion.TLSv1,
    "TLS11": ssl.TLSVersion.TLSv1_1,
    "TLS12": ssl.TLSVersion.TLSv1_2,
    "TLS13": ssl.TLSVersion.TLSv1_3,
}
_CLIENT_AUTH = {
    "NoClientCert": ssl.CERT_NONE,
    "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
    "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
}
# exporter-toolkit accepts these; Python's ssl cannot ask for a certificate without verifying it.
_CLIENT_AUTH_UNSUPPORTED = ("RequestClientCert", "RequireAnyClientCert")
_HEADERS = (
    "Strict-Transport-Security",
    "X-Content-Type-Options",
    "X-Frame-Options",
    "X-XSS-Protection",
    "Content-Security-Policy",
)
_TOP_KEYS = ("tls_server_config", "http_server_config", "basic_auth_users")
_TLS_KEYS = (
    "cert_file",
    "key_file",
    "client_ca_file",
    "client_auth_type",
    "min_version",
    "max_version",
    "prefer_server_cipher_suites",
)
_TLS_UNSUPPORTED = ("cert", "key", "client_ca", "cipher_suites", "curve_preferences",
                    "client_allowed_sans")  # fmt: skip
_HTTP_KEYS = ("http2", "headers")
_UNSUPPORTED_TOP = ("rate_limit",)
_BCRYPT_PREFIXES = (b"$2a$", b"$2b$", b"$2y$")


class WebConfigError(SettingError):
    """The web config is invalid; ``key`` is the offending key path, e.g. ``tls_server_config``."""


@dataclass(frozen=True, slots=True)
class TlsConfig:
    cert_file: Path
    key_file: Path
    client_ca_file: Path | None = None
    client_auth_type: str = "NoClientCert"
    min_version: str = "TLS12"
    max_version: str = "TLS13"

    def files(self) -> tuple[Path, ...]:
        return tuple(p for p in (self.cert_file, self.key_file, self.client_ca_file) if p)

    def context(self) -> ssl.SSLContext:
        """A server context; raises :class:`WebConfigError` if a file is unusable."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = _TLS_VERSIONS[self.min_version]
        ctx.maximum_version = _TLS_VERSIONS[self.max_version]
        ctx.options |= ssl.OP_CIPHER_SERVER_PREFERENCE
        self.load_into(ctx)
        return ctx

    def load_into(self, ctx: ssl.SSLContext) -> None:
        """(Re)load certificate, key and client CA into ``ctx`` (new connections use them)."""
        try:
            ctx.load_cert_chain(self.cert_file, self.key_file)
        except (OSError, ssl.SSLError) as exc:
            raise WebConfigError(
                "tls_server_config.cert_file", f"cannot load {self.cert_file}: {exc}"
            ) from None
        ctx.verify_mode = _CLIENT_AUTH[self.client_auth_type]
        if self.client_ca_file is not None:
            try:
                ctx.load_verify_locations(cafile=self.client_ca_file)
            except (OSError, ssl.SSLError) as exc:
                raise WebConfigError(
                    "tls_server_config.client_ca_file",
                    f"cannot load {self.client_ca_file}: {exc}",
                ) from None


@dataclass(frozen=True, slots=True)
class WebConfig:
    tls: TlsConfig | None = None
    users: Mapping[str, bytes] = field(default_factory=lambda: MappingProxyType({}))
    headers: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))


def load_web_config(path: Path) -> WebConfig:
    """Read and validate a web config file (TLS files are checked by :meth:`TlsConfig.context`)."""
    try:
        document = read_yaml(path)
    except YamlFileError as exc:
        raise WebConfigError("file", str(exc)) from None
    return parse_web_config(document, path.parent)


def parse_web_config(document: object, base: Path) -> WebConfig:
    if document is None:
        return WebConfig()
    top = _mapping(document, "web config")
    _check_keys(top, "", _TOP_KEYS, _UNSUPPORTED_TOP)
    tls = None
    if top.get("tls_server_config") is not None:
        tls = _parse_tls(_mapping(top["tls_server_config"], "tls_server_config"), base)
    headers: dict[str, str] = {}
    if top.get("http_server_config") is not None:
        http = _mapping(top["http_server_config"], "http_server_config")
        _check_keys(http, "http_server_config.", _HTTP_KEYS, ())
        if "http2" in http and not isinstance(http["http2"], bool):
            raise WebConfigError("http_server_config.http2", "must be true or false")
        if http.get("headers") is not None:
            for name, value in _mapping(http["headers"], "http_server_config.headers").items():
                key = f"http_server_config.headers.{name}"
                if name not in _HEADERS:
                    raise WebConfigError(key, f"unknown header (allowed: {', '.join(_HEADERS)})")
                if not isinstance(value, str) or "\n" in value or "\r" in value:
                    raise WebConfigError(key, "must be a single-line string")
                headers[name] = value
    users: dict[str, bytes] = {}
    if top.get("basic_auth_users") is not None:
        for user, hashed in _mapping(top["basic_auth_users"], "basic_auth_users").items():
            key = f"basic_auth_users.{user}"
            if not isinstance(user, str) or not user or ":" in user:
                raise WebConfigError(key, "a user name must be a non-empty string without ':'")
            if not isinstance(hashed, str) or not hashed.encode().startswith(_BCRYPT_PREFIXES):
                raise WebConfigError(key, "must be a bcrypt hash ($2a$, $2b$ or $2y$)")
            users[user] = hashed.encode()
    return WebConfig(tls=tls, users=MappingProxyType(users), headers=MappingProxyType(headers))


def _parse_tls(section: Mapping[object, object], base: Path) -> TlsConfig:
    _check_keys(section, "tls_server_config.", _TLS_KEYS, _TLS_UNSUPPORTED)

    def path(key: str, *, required: bool) -> Path | None:
        raw = section.get(key)
        if raw is None or raw == "":
            if required:
                raise WebConfigError(f"tls_server_config.{key}", "is required")
            return None
        if not isinstance(raw, str) or "\0" in raw:
            raise WebConfigError(f"tls_server_config.{key}", "must be a file path")
        return base / raw

    def choice(key: str, allowed: Mapping[str, object], default: str) -> str:
        raw = section.get(key)
        if raw is None or raw == "":
            return default
        if raw in _CLIENT_AUTH_UNSUPPORTED:
            raise WebConfigError(
                f"tls_server_config.{key}", f"{raw} is not supported (client certificates are "
                "always verified: use VerifyClientCertIfGiven or RequireAndVerifyClientCert)"
            )  # fmt: skip
        if not isinstance(raw, str) or raw not in allowed:
            raise WebConfigError(
                f"tls_server_config.{key}", f"must be one of {', '.join(allowed)}, got {raw!r}"
            )
        return raw

    if "prefer_server_cipher_suites" in section and not isinstance(
        section["prefer_server_cipher_suites"], bool
    ):
        raise WebConfigError("tls_server_config.prefer_server_cipher_suites", "must be a boolean")
    cert, key = path("cert_file", required=True), path("key_file", required=True)
    assert cert is not None
    assert key is not None
    client_ca = path("client_ca_file", required=False)
    auth = choice("client_auth_type", _CLIENT_AUTH, "NoClientCert")
    if auth == "RequireAndVerifyClientCert" and client_ca is None:
        raise WebConfigError(
            "tls_server_config.client_ca_file", f"is required with client_auth_type {auth}"
        )
    tls = TlsConfig(
        cert_file=cert,
        key_file=key,
        client_ca_file=client_ca,
        client_auth_type=auth,
        min_version=choice("min_version", _TLS_VERSIONS, "TLS12"),
        max_version=choice("max_version", _TLS_VERSIONS, "TLS13"),
    )
    if _TLS_VERSIONS[tls.min_version] > _TLS_VERSIONS[tls.max_version]:
        raise WebConfigError("tls_server_config.min_version", "is above max_version")
    return tls


def _mapping(value: object, key: str) -> Mapping[object, object]:
    if not isinstance(value, dict):
        raise WebConfigError(key, f"must be a mapping, got {type(value).__name__}")
    return value


def _check_keys(
    section: Mapping[object, object],
    prefix: str,
    known: tuple[str, ...],
    unsupported: tuple[str, ...],
) -> None:
    for key in section:
        if key in unsupported:
            raise WebConfigError(f"{prefix}{key}", "is not supported by gpuagent")
        if key not in known:
            raise WebConfigError(f"{prefix}{key}", f"unknown key (known: {', '.join(known)})")


class WebConfigFile:
    """The web config as loaded at start, and as reloaded since.

    The agent's reload (SIGHUP, or a change of the config file, of this file or of a TLS file it
    names) reads it again with the rest of the configuration (:meth:`reread`, off the loop) and
    serves it (:meth:`use`): new certificates are loaded into the running server's context, for
    new connections. A file that no longer parses refuses the whole reload. TLS itself can be
    turned on or off only by a restart.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.config = load_web_config(path)
        self.ssl_context = self.config.tls.context() if self.config.tls else None
        self.auth = BasicAuth(self.config.users)
        self._stamp = _stamps(self.files())

    def files(self) -> tuple[Path, ...]:
        """The files a change of the web config is a change of: itself and its TLS files."""
        return _files(self.path, self.config)

    def reread(self) -> WebConfig:
        """The file read again and checked, TLS files included (blocking: call it off the loop);
        raises :class:`WebConfigError`."""
        config = load_web_config(self.path)
        if (config.tls is None) != (self.config.tls is None):
            raise WebConfigError("tls_server_config", "turning TLS on or off needs a restart")
        if config.tls is not None:
            config.tls.context()  # its files load (into a context of their own)
        return config

    def use(self, config: WebConfig) -> bool:
        """Serve ``config`` (as :meth:`reread` returned it) from now on, its certificates loaded
        again; returns whether it changed (the file, or a file it names). Raises
        :class:`WebConfigError` when the certificates no longer load (replaced since)."""
        stamp = _stamps(_files(self.path, config))
        changed = config != self.config or stamp != self._stamp
        if changed and config.tls is not None and self.ssl_context is not None:
            config.tls.load_into(self.ssl_context)
        if config.users != self.config.users:
            self.auth = BasicAuth(config.users)
        self.config = config
        self._stamp = stamp
        if changed:
            log.info("web config reloaded", path=str(self.path))
        return changed


def _files(path: Path, config: WebConfig) -> tuple[Path, ...]:
    return (path, *(config.tls.files() if config.tls else ()))


def _stamps(files: tuple[Path, ...]) -> tuple[tuple[int, int, int], ...]:
    out = []
    for f in files:
        try:
            st = os.stat(f)
            out.append((st.st_mtime_ns, st.st_size, st.st_ino))
        except OSError:
            out.append((0, 0, 0))
    return tuple(out)


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
