"""A reload of --web-config-file never drops authentication or TLS because of a file's state.

A careless writer truncates a file and writes it in steps; whatever state a reload finds, it
either refuses it (the running configuration stays) or serves a configuration as strict as the
running one, unless the document says in so many words that it should be less strict. The tests
read every prefix of a file, byte by byte: every state such a writer can leave.
"""

from __future__ import annotations

import ssl
from pathlib import Path

import bcrypt
import pytest
from support.tls import Pki, served_certificate

from gpuagent.web.webconfig import (
    WebConfigError,
    WebConfigFile,
    parse_web_config,
    weakened_by_omission,
)

HASH = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(4)).decode()
OTHER = bcrypt.hashpw(b"other", bcrypt.gensalt(4)).decode()


def der(pem: Path) -> bytes:
    return ssl.PEM_cert_to_DER_cert(pem.read_text())


def test_no_prefix_of_a_file_with_users_turns_basic_auth_off(tmp_path: Path) -> None:
    """The headers come first, so a file cut after them parses as a complete document without
    users: it is refused, as is every other prefix that would leave nobody to check."""
    path = tmp_path / "web.yml"
    path.write_text(f"basic_auth_users:\n  alice: {HASH}\n")
    loaded = WebConfigFile(path)
    text = (
        "http_server_config:\n  headers:\n    X-Frame-Options: deny\n"
        f"basic_auth_users:\n  bob: {OTHER}\n  carol: {HASH}\n"
    )
    accepted = []
    for cut in range(len(text)):
        path.write_text(text[:cut])
        try:
            config = loaded.reread()
        except WebConfigError:
            continue
        assert config.users, f"a file cut at {cut} turns basic auth off:\n{text[:cut]}"
        accepted.append(cut)
    assert accepted  # some prefixes are complete documents with users (bob alone): served
    assert set(loaded.config.users) == {"alice"}  # nothing was served meanwhile
    path.write_text(text)
    assert loaded.use(loaded.reread()) is True
    assert set(loaded.auth.users) == {"bob", "carol"}


def test_basic_auth_is_turned_off_by_a_document_that_says_so(tmp_path: Path) -> None:
    path = tmp_path / "web.yml"
    path.write_text(f"basic_auth_users:\n  alice: {HASH}\n")
    loaded = WebConfigFile(path)
    path.write_text("http_server_config:\n  headers:\n    X-Frame-Options: deny\n")
    with pytest.raises(WebConfigError) as info:
        loaded.reread()
    assert str(info.value) == (
        "basic_auth_users: is missing while basic auth is on (a file written halfway?): "
        "to turn basic auth off, write `basic_auth_users: {}`"
    )
    path.write_text("basic_auth_users: {}\n")
    assert loaded.use(loaded.reread()) is True
    assert not loaded.auth.enabled


@pytest.mark.parametrize(
    ("running", "reloaded", "refused"),
    [
        pytest.param({"basic_auth_users": {"a": HASH}}, {}, "basic_auth_users",
                     id="users-left-out"),
        pytest.param({"basic_auth_users": {"a": HASH}}, {"basic_auth_users": {}}, None,
                     id="users-stated-empty"),
        pytest.param({"basic_auth_users": {"a": HASH, "b": HASH}},
                     {"basic_auth_users": {"a": HASH}}, None, id="fewer-users"),
        pytest.param({}, {}, None, id="no-users-before"),
        pytest.param({"client_auth_type": "RequireAndVerifyClientCert"}, {},
                     "tls_server_config.client_auth_type", id="client-auth-left-out"),
        pytest.param({"client_auth_type": "RequireAndVerifyClientCert"},
                     {"client_auth_type": "VerifyClientCertIfGiven"}, None,
                     id="client-auth-stated"),
        pytest.param({"client_auth_type": "VerifyClientCertIfGiven"},
                     {"client_auth_type": "RequireAndVerifyClientCert"}, None,
                     id="client-auth-raised"),
        pytest.param({"min_version": "TLS13"}, {}, "tls_server_config.min_version",
                     id="min-version-left-out"),
        pytest.param({"min_version": "TLS13"}, {"min_version": "TLS12"}, None,
                     id="min-version-stated"),
    ],
)  # fmt: skip
def test_weakened_by_omission(
    running: dict[str, object], reloaded: dict[str, object], refused: str | None
) -> None:
    def config(settings: dict[str, object]) -> object:
        document: dict[str, object] = {}
        tls = {k: v for k, v in settings.items() if k != "basic_auth_users"}
        if "basic_auth_users" in settings:
            document["basic_auth_users"] = settings["basic_auth_users"]
        if tls or "basic_auth_users" not in settings:
            document["tls_server_config"] = {"cert_file": "a", "key_file": "b",
                                             "client_ca_file": "ca", **tls}  # fmt: skip
        return parse_web_config(document, Path("/etc"))

    error = weakened_by_omission(config(running), config(reloaded))  # type: ignore[arg-type]
    assert (error.key if error else None) == refused


def _tls_files(directory: Path, pki: Pki) -> tuple[Path, Path]:
    cert, key = directory / "server.crt", directory / "server.key"
    cert.write_bytes(pki.server_cert.read_bytes())
    key.write_bytes(pki.server_key.read_bytes())
    return cert, key


def test_a_half_written_certificate_or_key_keeps_the_running_ones(
    tmp_path: Path, pki: Pki, other: Pki
) -> None:
    cert, key = _tls_files(tmp_path, pki)
    path = tmp_path / "web.yml"
    path.write_text("tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n")
    loaded = WebConfigFile(path)
    assert loaded.ssl_context is not None
    # A key, then its certificate, each written in steps: every state short of the whole PEM
    # block (its final newline aside) is refused.
    for target, content in ((key, other.server_key), (cert, other.server_cert)):
        data = content.read_bytes()
        for cut in range(len(data.rstrip())):
            target.write_bytes(data[:cut])
            with pytest.raises(WebConfigError):
                loaded.reread()
        target.write_bytes(data)
        if target == key:  # the new key beside the old certificate: refused too
            with pytest.raises(WebConfigError):
                loaded.reread()
    assert served_certificate(loaded.ssl_context, pki.ca_cert) == der(pki.server_cert)
    assert loaded.use(loaded.reread()) is True
    assert served_certificate(loaded.ssl_context, other.ca_cert) == der(other.server_cert)


def test_the_certificates_served_are_those_the_reload_checked(
    tmp_path: Path, pki: Pki, other: Pki
) -> None:
    """The files change again between the reload's check and its use (a writer caught between
    its steps): what is served is what was checked, and the server
    goes on serving (loading the files again would leave it with a certificate and no key)."""
    cert, key = _tls_files(tmp_path, pki)
    path = tmp_path / "web.yml"
    path.write_text("tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n")
    loaded = WebConfigFile(path)
    assert loaded.ssl_context is not None
    cert.write_bytes(other.server_cert.read_bytes())
    key.write_bytes(other.server_key.read_bytes())
    checked = loaded.reread()
    key.write_bytes(pki.server_key.read_bytes()[:40])  # the next rotation, halfway
    assert loaded.use(checked) is True
    assert served_certificate(loaded.ssl_context, other.ca_cert) == der(other.server_cert)


def test_no_prefix_of_a_tls_file_lowers_its_demands(tmp_path: Path, pki: Pki) -> None:
    _tls_files(tmp_path, pki)
    (tmp_path / "ca.crt").write_bytes(pki.ca_cert.read_bytes())
    text = (
        "tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n"
        "  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: ca.crt\n"
        "  min_version: TLS13\n"
    )
    path = tmp_path / "web.yml"
    path.write_text(text)
    loaded = WebConfigFile(path)
    for cut in range(len(text)):
        path.write_text(text[:cut])
        try:
            config = loaded.reread()
        except WebConfigError:
            continue
        assert config.tls is not None
        assert (config.tls.client_auth_type, config.tls.min_version) == (
            "RequireAndVerifyClientCert",
            "TLS13",
        ), f"a file cut at {cut} lowers TLS's demands:\n{text[:cut]}"


def test_a_reload_applies_the_tls_versions(tmp_path: Path, pki: Pki) -> None:
    _tls_files(tmp_path, pki)
    path = tmp_path / "web.yml"
    path.write_text("tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n")
    loaded = WebConfigFile(path)
    context = loaded.ssl_context
    assert context is not None
    versions = [context.minimum_version]
    path.write_text(path.read_text() + "  min_version: TLS13\n")
    assert loaded.use(loaded.reread()) is True
    versions.append(context.minimum_version)
    assert versions == [ssl.TLSVersion.TLSv1_2, ssl.TLSVersion.TLSv1_3]
