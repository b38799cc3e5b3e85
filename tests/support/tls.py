"""A throw-away PKI for TLS tests, made with the openssl command line tool.

A CA, a server certificate for ``127.0.0.1``/``localhost`` and a client certificate, all signed by
the CA, with EC keys (fast to make). Valid for a day.
"""

from __future__ import annotations

import shutil
import ssl
import subprocess
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Pki", "make_pki", "served_certificate", "write_web_config"]


@dataclass(frozen=True)
class Pki:
    ca_cert: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _openssl(*args: str, cwd: Path) -> None:
    openssl = shutil.which("openssl")
    if openssl is None:
        raise RuntimeError("the openssl command is needed for TLS tests")
    subprocess.run([openssl, *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_pki(directory: Path) -> Pki:
    directory.mkdir(parents=True, exist_ok=True)
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    # Extensions as strict verifiers want them (Python >= 3.13 sets VERIFY_X509_STRICT by default):
    # a CA with key usage, leaves with key usage and the authority's key identifier.
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "1",
             "-subj", "/CN=gpuagent test CA",
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign",
             "-addext", "subjectKeyIdentifier=hash", cwd=directory)  # fmt: skip
    leaf = (
        "keyUsage=critical,digitalSignature\nsubjectKeyIdentifier=hash\n"
        "authorityKeyIdentifier=keyid:always\n"
    )
    (directory / "server.ext").write_text(
        leaf + "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n"
    )
    (directory / "client.ext").write_text(leaf + "extendedKeyUsage=clientAuth\n")
    for name in ("server", "client"):
        _openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN={name}", cwd=directory)  # fmt: skip
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                 "-CAcreateserial", "-out", f"{name}.crt", "-days", "1",
                 "-extfile", f"{name}.ext", cwd=directory)  # fmt: skip
    return Pki(
        ca_cert=directory / "ca.crt",
        server_cert=directory / "server.crt",
        server_key=directory / "server.key",
        client_cert=directory / "client.crt",
        client_key=directory / "client.key",
    )


def served_certificate(server: ssl.SSLContext, ca: Path) -> bytes:
    """The certificate (DER) a new connection to a server with context ``server`` is served,
    verified against ``ca``: a handshake in memory, no socket. Raises ``ssl.SSLError`` when the
    handshake fails (a context with a certificate and no key)."""
    client_context = ssl.create_default_context(cafile=ca)
    pipes = [ssl.MemoryBIO(), ssl.MemoryBIO()]
    client = client_context.wrap_bio(pipes[0], pipes[1], server_hostname="localhost")
    peer = server.wrap_bio(pipes[1], pipes[0], server_side=True)
    for _ in range(10):
        finished = 0
        for end in (client, peer):
            try:
                end.do_handshake()
                finished += 1
            except ssl.SSLWantReadError:
                pass
        if finished == 2:
            der = client.getpeercert(binary_form=True)
            assert der is not None
            return der
    raise AssertionError("the handshake did not finish")


def write_web_config(
    directory: Path, pki: Pki, ca: Pki | None = None, *extra: str, **tls: str
) -> Path:
    """A web config (``directory/web.yml``) serving ``pki``'s server certificate, verifying
    client certificates against ``ca``'s CA (copied to ``client-ca.crt``: a reload sees the
    file change); ``tls``: more ``tls_server_config`` keys, ``extra``: more lines after it."""
    (directory / "server.crt").write_bytes(pki.server_cert.read_bytes())
    (directory / "server.key").write_bytes(pki.server_key.read_bytes())
    lines = ["tls_server_config:", "  cert_file: server.crt", "  key_file: server.key"]
    if ca is not None:
        (directory / "client-ca.crt").write_bytes(ca.ca_cert.read_bytes())
        lines.append("  client_ca_file: client-ca.crt")
    lines += [f"  {key}: {value}" for key, value in tls.items()]
    path = directory / "web.yml"
    path.write_text("\n".join([*lines, *extra]) + "\n")
    return path
