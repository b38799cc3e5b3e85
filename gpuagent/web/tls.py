"""The web config's TLS: its settings, its files as read once, and the server's context.

A reload must never leave the running server with half a certificate. OpenSSL loads a chain and
its key in two steps, and a key that fails after its certificate loaded leaves the context with a
certificate and no key: every handshake fails from then on. So a reload reads the files once
(:meth:`TlsConfig.read`), checks those bytes by loading them into a context of their own, and
loads the same bytes (never the files again, which may have changed meanwhile) into the running
context. Python's ``ssl`` loads certificates only from paths: the bytes are handed to it through
an in-memory file (``memfd_create``), so the private key is never written anywhere.

A reload must also leave nothing of the old configuration behind, and OpenSSL cannot take a CA
back out of a context (``load_verify_locations`` only adds). The listening socket's context is
fixed when the server is made (asyncio and uvloop hold it), so :class:`ServedTls` gives it no
certificate and no CA of its own: its ``sni_callback`` (called on every ClientHello, with
``server_name`` ``None`` when the client sends no SNI) switches the handshake to a context built
whole from the configuration served now. What OpenSSL takes from the switched-to context and what
it keeps from the listening one (``SSL_set_SSL_CTX``, checked by handshakes in the tests):

- from the switched-to context: the certificate and key, and the CAs client certificates are
  verified against (OpenSSL verifies with the store of the context the connection has then);
- from the listening context, copied when the connection is accepted (``SSL_new``), before the
  ClientHello: the verify mode (``client_auth_type``), the TLS versions (chosen before the
  callback runs) and the options. A reload sets these on the listening context, so a
  connection accepted before the reload whose ClientHello comes after has the old verify mode
  and versions with the new certificate and CAs (the HTTP server closes such a connection when
  its handshake ends, as it does every connection open at a change of trust:
  :meth:`TlsConfig.trust`);
- a resumed session (a session ticket, or TLS 1.2's session-ID cache, which lives in the
  listening context and which Python cannot flush) is looked up before the callback and carries
  the client certificate verified when it was made. The callback refuses the resumption of a
  session made before the last change of what clients are verified against
  (:meth:`TlsConfig.trust`; a renewal of the server's own certificate is none) while client
  certificates are verified, so a removed CA's certificate, or no certificate where one is now
  required, cannot come back by resumption. OpenSSL stamps a session in whole seconds: one made
  in the second of the reload is refused too (the client makes a new one).
"""

from __future__ import annotations

import os
import ssl
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from gpuagent.domain.errors import SettingError

__all__ = ["CLIENT_AUTH", "TLS_VERSIONS", "Pem", "ServedTls", "TlsConfig", "WebConfigError"]

TLS_VERSIONS = {
    "TLS10": ssl.TLSVersion.TLSv1,
    "TLS11": ssl.TLSVersion.TLSv1_1,
    "TLS12": ssl.TLSVersion.TLSv1_2,
    "TLS13": ssl.TLSVersion.TLSv1_3,
}
#: exporter-toolkit's client-auth types this implementation honours, weakest first.
CLIENT_AUTH = {
    "NoClientCert": ssl.CERT_NONE,
    "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
    "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
}


class WebConfigError(SettingError):
    """The web config is invalid; ``key`` is the offending key path, e.g. ``tls_server_config``."""


@dataclass(frozen=True, slots=True)
class Pem:
    """The TLS files' content, as read for one load (never in a repr: it holds the key)."""

    cert: bytes = field(repr=False)
    key: bytes = field(repr=False)
    client_ca: bytes | None = field(default=None, repr=False)


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

    def read(self) -> Pem:
        """The files' content (blocking); raises :class:`WebConfigError` naming the key of a
        file that cannot be read."""
        ca = None if self.client_ca_file is None else _read("client_ca_file", self.client_ca_file)
        return Pem(_read("cert_file", self.cert_file), _read("key_file", self.key_file), ca)

    def context(self, pem: Pem) -> ssl.SSLContext:
        """A server context serving ``pem`` with these settings, built whole (what a handshake is
        switched to); raises :class:`WebConfigError` if it does not load (a file written halfway,
        a key that is not the certificate's)."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.settle(ctx)
        try:
            with _in_memory(pem.cert) as cert, _in_memory(pem.key) as key:
                ctx.load_cert_chain(cert or self.cert_file, key or self.key_file)
        except (OSError, ssl.SSLError) as exc:
            raise WebConfigError(
                "tls_server_config.cert_file",
                f"cannot load {self.cert_file} with {self.key_file}: {exc}",
            ) from None
        if pem.client_ca is not None:
            try:
                ctx.load_verify_locations(cadata=pem.client_ca.decode("ascii"))
            except (UnicodeDecodeError, ssl.SSLError) as exc:
                raise WebConfigError(
                    "tls_server_config.client_ca_file",
                    f"cannot load {self.client_ca_file}: {exc}",
                ) from None
        return ctx

    def trust(self, pem: Pem) -> tuple[object, ...]:
        """What a client is verified against and held to: the client CAs (their content, not
        the file's name), ``client_auth_type`` and the TLS versions. A change of it is a change
        of who may be served (:meth:`WebConfigFile.use` closes the connections accepted before
        it); the server's own certificate and key are not part of it."""
        return (pem.client_ca, self.client_auth_type, self.min_version, self.max_version)

    def settle(self, ctx: ssl.SSLContext) -> None:
        """Set what OpenSSL takes from the listening context, not from a switched-to one: the
        versions, the verify mode and the options (each replaces the one before)."""
        ctx.options |= ssl.OP_CIPHER_SERVER_PREFERENCE
        ctx.minimum_version = TLS_VERSIONS[self.min_version]
        ctx.maximum_version = TLS_VERSIONS[self.max_version]
        ctx.verify_mode = CLIENT_AUTH[self.client_auth_type]


class ServedTls:
    """The listening socket's context (:attr:`listening`), which hands every handshake to the
    context of the configuration served now (see the module's docstring)."""

    def __init__(self, tls: TlsConfig, pem: Pem) -> None:
        self.listening = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.listening.sni_callback = self._switch
        self._sessions_after = 0  # the second of the last change: older sessions are not resumed
        self._take(tls, pem, tls.context(pem))

    def serve(self, tls: TlsConfig, pem: Pem) -> None:
        """Serve ``tls`` and ``pem`` to connections accepted from now on; raises
        :class:`WebConfigError` (and serves what it did) if they do not load. Sessions made
        before are no longer resumed only where what clients are verified against changed
        (:meth:`TlsConfig.trust`): a renewal of the server's own certificate keeps them."""
        current = tls.context(pem)
        if tls.trust(pem) != self._trust:
            self._sessions_after = int(time.time())
        self._take(tls, pem, current)

    def _take(self, tls: TlsConfig, pem: Pem, current: ssl.SSLContext) -> None:
        tls.settle(self.listening)
        self._current = current
        self._trust = tls.trust(pem)
        self._verifies = tls.client_auth_type != "NoClientCert"

    def _switch(
        self, connection: ssl.SSLObject | ssl.SSLSocket, server_name: str | None, _: object
    ) -> int | None:
        session = connection.session if connection.session_reused else None
        if self._verifies and session is not None and session.time <= self._sessions_after:
            return ssl.ALERT_DESCRIPTION_HANDSHAKE_FAILURE  # verified under what is gone
        connection.context = self._current
        return None


def _read(key: str, path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise WebConfigError(
            f"tls_server_config.{key}", f"cannot read {path}: {exc.strerror or exc}"
        ) from None


@contextmanager
def _in_memory(data: bytes) -> Iterator[str | None]:
    """A path OpenSSL can read ``data`` from, backed by memory; ``None`` where the kernel (or a
    seccomp filter) offers no in-memory file: the caller then loads from the files themselves."""
    try:
        fd = os.memfd_create("gpuagent-tls", os.MFD_CLOEXEC)
    except OSError:
        yield None
        return
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        path = f"/proc/self/fd/{fd}"
        yield path if os.path.exists(path) else None  # (no /proc mounted)
    finally:
        os.close(fd)
