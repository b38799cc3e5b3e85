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

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType

import structlog

from gpuagent.web.basicauth import BasicAuth
from gpuagent.web.tls import CLIENT_AUTH, TLS_VERSIONS, Pem, ServedTls, TlsConfig, WebConfigError
from gpuagent.yamlfile import YamlFileError, read_yaml

__all__ = [
    "TlsConfig",
    "WebConfig",
    "WebConfigError",
    "WebConfigFile",
    "load_web_config",
    "parse_web_config",
    "weakened_by_omission",
]

log = structlog.get_logger("gpuagent.http")

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
# A whole bcrypt hash: prefix, two-digit cost, 22 characters of salt and 31 of hash.
_BCRYPT = re.compile(r"\$2[aby]\$[0-9]{2}\$[./A-Za-z0-9]{53}")
_CLIENT_AUTH_ORDER = tuple(CLIENT_AUTH)  # weakest first
_VERSION_ORDER = tuple(TLS_VERSIONS)


@dataclass(frozen=True, slots=True)
class WebConfig:
    """A web config as parsed; ``pem``: its TLS files as read (by :func:`load_web_config`);
    ``stated``: the keys the document wrote out (``basic_auth_users``,
    ``tls_server_config.min_version``), which a reload may not weaken by leaving out."""

    tls: TlsConfig | None = None
    users: Mapping[str, bytes] = field(default_factory=lambda: MappingProxyType({}))
    headers: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    pem: Pem | None = field(default=None, repr=False)
    stated: frozenset[str] = field(default=frozenset(), compare=False)


def load_web_config(path: Path) -> WebConfig:
    """Read and validate a web config file and read its TLS files (blocking; whether they load
    is checked by :meth:`TlsConfig.context`). An empty file is refused: it is what a writer
    caught between truncating and writing leaves, never a request for no authentication."""
    try:
        document = read_yaml(path)
    except YamlFileError as exc:
        raise WebConfigError("file", str(exc)) from None
    if document is None:
        raise WebConfigError(
            "file",
            f"{path} holds no YAML document (empty, or comments only: written halfway?); "
            "a web config without TLS or authentication is written `{}`",
        )
    config = parse_web_config(document, path.parent)
    return config if config.tls is None else replace(config, pem=config.tls.read())


def parse_web_config(document: object, base: Path) -> WebConfig:
    top = _mapping(document, "web config")
    _check_keys(top, "", _TOP_KEYS, _UNSUPPORTED_TOP)
    stated = {str(key) for key in top}
    tls = None
    if "tls_server_config" in top:
        section = _mapping(top["tls_server_config"], "tls_server_config")
        tls = _parse_tls(section, base)
        stated |= {f"tls_server_config.{key}" for key in section}
    headers = _parse_headers(top["http_server_config"]) if "http_server_config" in top else {}
    users: dict[str, bytes] = {}
    for user, hashed in _mapping(top.get("basic_auth_users", {}), "basic_auth_users").items():
        key = f"basic_auth_users.{user}"
        if not isinstance(user, str) or not user or ":" in user:
            raise WebConfigError(key, "a user name must be a non-empty string without ':'")
        if not isinstance(hashed, str) or not hashed.encode().startswith(_BCRYPT_PREFIXES):
            raise WebConfigError(key, "must be a bcrypt hash ($2a$, $2b$ or $2y$)")
        if not _BCRYPT.fullmatch(hashed):
            raise WebConfigError(key, "is not a whole bcrypt hash (60 characters; cut short?)")
        users[user] = hashed.encode()
    return WebConfig(
        tls=tls,
        users=MappingProxyType(users),
        headers=MappingProxyType(headers),
        stated=frozenset(stated),
    )


def _parse_headers(value: object) -> dict[str, str]:
    http = _mapping(value, "http_server_config")
    _check_keys(http, "http_server_config.", _HTTP_KEYS, ())
    if "http2" in http and not isinstance(http["http2"], bool):
        raise WebConfigError("http_server_config.http2", "must be true or false")
    headers: dict[str, str] = {}
    if http.get("headers") is not None:
        for name, text in _mapping(http["headers"], "http_server_config.headers").items():
            key = f"http_server_config.headers.{name}"
            if name not in _HEADERS:
                raise WebConfigError(key, f"unknown header (allowed: {', '.join(_HEADERS)})")
            if not isinstance(text, str) or "\n" in text or "\r" in text:
                raise WebConfigError(key, "must be a single-line string")
            headers[name] = text
    return headers


def weakened_by_omission(running: WebConfig, config: WebConfig) -> WebConfigError | None:
    """Why ``config`` may not replace ``running``, if it turns authentication off or lowers
    TLS's demands only by leaving a key out (a file written halfway reads that way); ``None``
    when it may. Turning basic auth off takes ``basic_auth_users: {}``; lowering the client
    certificate check or the lowest TLS version takes the key written out."""
    if running.users and not config.users and "basic_auth_users" not in config.stated:
        return WebConfigError(
            "basic_auth_users",
            "is missing while basic auth is on (a file written halfway?): "
            "to turn basic auth off, write `basic_auth_users: {}`",
        )
    old, new = running.tls, config.tls
    if old is None or new is None:
        return None
    lowered = (
        ("client_auth_type", _CLIENT_AUTH_ORDER.index, old.client_auth_type, new.client_auth_type),
        ("min_version", _VERSION_ORDER.index, old.min_version, new.min_version),
    )
    for key, rank, before, after in lowered:
        if rank(after) < rank(before) and f"tls_server_config.{key}" not in config.stated:
            return WebConfigError(
                f"tls_server_config.{key}",
                f"is missing, which would lower it from {before} to {after} (a file written "
                "halfway?): to lower it, write it out",
            )
    return None


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
    auth = choice("client_auth_type", CLIENT_AUTH, "NoClientCert")
    if auth == "RequireAndVerifyClientCert" and client_ca is None:
        raise WebConfigError(
            "tls_server_config.client_ca_file", f"is required with client_auth_type {auth}"
        )
    tls = TlsConfig(
        cert_file=cert,
        key_file=key,
        client_ca_file=client_ca,
        client_auth_type=auth,
        min_version=choice("min_version", TLS_VERSIONS, "TLS12"),
        max_version=choice("max_version", TLS_VERSIONS, "TLS13"),
    )
    if TLS_VERSIONS[tls.min_version] > TLS_VERSIONS[tls.max_version]:
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
    """Every key known and supported, and given a value: a key without one is what a writer
    caught halfway leaves (``min_version:``), never a request for the default."""
    for key, value in section.items():
        if key in unsupported:
            raise WebConfigError(f"{prefix}{key}", "is not supported by gpuagent")
        if key not in known:
            raise WebConfigError(f"{prefix}{key}", f"unknown key (known: {', '.join(known)})")
        if value is None:
            raise WebConfigError(
                f"{prefix}{key}", "has no value (written halfway?): complete it, or leave it out"
            )


class WebConfigFile:
    """The web config as loaded at start, and as reloaded since.

    The agent's reload (SIGHUP, or a change of the config file, of this file or of a TLS file it
    names) reads it again with the rest of the configuration (:meth:`reread`, off the loop) and
    serves it (:meth:`use`): connections accepted from then on are served a context built whole
    from the very bytes :meth:`reread` checked (:class:`~gpuagent.web.tls.ServedTls`), so
    nothing of the old certificate, CAs or settings applies to them. A file that no longer parses,
    a TLS file that does not load, and a file that would weaken authentication or TLS only by
    leaving a key out (:func:`weakened_by_omission`) refuse the whole reload. TLS itself can be
    turned on or off only by a restart.

    A reload that changes who may be served (:meth:`~gpuagent.web.tls.TlsConfig.trust`: the
    client CAs, ``client_auth_type``, the TLS versions) also calls every :attr:`trust_changed`
    callback, at once: the HTTP server retires the connections accepted before it.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.config = load_web_config(path)
        tls, pem = self.config.tls, self.config.pem
        self._tls = ServedTls(tls, pem) if tls is not None and pem is not None else None
        #: the listening socket's context (``None`` without TLS)
        self.ssl_context = self._tls.listening if self._tls is not None else None
        self.auth = BasicAuth(self.config.users)
        #: called (on the loop) by :meth:`use` when it changes who may be served
        self.trust_changed: list[Callable[[], None]] = []

    def files(self) -> tuple[Path, ...]:
        """The files a change of the web config is a change of: itself and its TLS files."""
        return (self.path, *(self.config.tls.files() if self.config.tls else ()))

    def reread(self) -> WebConfig:
        """The file and its TLS files read again and checked (blocking: call it off the loop);
        raises :class:`WebConfigError`."""
        config = load_web_config(self.path)
        if (config.tls is None) != (self.config.tls is None):
            raise WebConfigError("tls_server_config", "turning TLS on or off needs a restart")
        weakened = weakened_by_omission(self.config, config)
        if weakened is not None:
            raise weakened
        if config.tls is not None and config.pem is not None:
            config.tls.context(config.pem)  # the bytes load (into a context of their own)
        return config

    def use(self, config: WebConfig) -> bool:
        """Serve ``config`` (as :meth:`reread` returned it) from now on; returns whether it
        changed (the file, or the content of a file it names)."""
        changed = config != self.config
        tls_changed = (config.tls, config.pem) != (self.config.tls, self.config.pem)
        trust_changed = _trust(config) != _trust(self.config)
        if tls_changed and config.tls is not None and config.pem is not None and self._tls:
            self._tls.serve(config.tls, config.pem)
        if config.users != self.config.users:
            self.auth = BasicAuth(config.users)
            if not config.users:
                log.warning("basic auth turned off by the web config", path=str(self.path))
        self.config = config
        if changed:
            log.info("web config reloaded", path=str(self.path))
        if trust_changed:
            for callback in self.trust_changed:
                callback()
        return changed


def _trust(config: WebConfig) -> tuple[object, ...]:
    tls, pem = config.tls, config.pem
    return () if tls is None or pem is None else tls.trust(pem)
