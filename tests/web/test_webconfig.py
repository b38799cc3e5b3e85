"""--web-config-file: parsing, validation (every rejection names its key), bcrypt basic auth."""

from __future__ import annotations

import asyncio
import base64
import ssl
from pathlib import Path

import bcrypt
import pytest
from support.tls import Pki

from gpuagent.web.basicauth import AuthResult, BasicAuth
from gpuagent.web.webconfig import (
    WebConfigError,
    WebConfigFile,
    load_web_config,
    parse_web_config,
)

PASSWORD = b"s3cret"
HASH = bcrypt.hashpw(PASSWORD, bcrypt.gensalt(4)).decode()


def header(user: str, password: bytes) -> str:
    return "Basic " + base64.b64encode(user.encode() + b":" + password).decode()


def error(document: object) -> WebConfigError:
    with pytest.raises(WebConfigError) as info:
        parse_web_config(document, Path("/etc/gpuagent"))
    return info.value


def test_full_config(pki: Pki) -> None:
    config = parse_web_config(
        {
            "tls_server_config": {
                "cert_file": "server.crt",
                "key_file": "/abs/server.key",
                "client_ca_file": "ca.crt",
                "client_auth_type": "RequireAndVerifyClientCert",
                "min_version": "TLS13",
                "prefer_server_cipher_suites": True,
            },
            "http_server_config": {"http2": False, "headers": {"X-Frame-Options": "deny"}},
            "basic_auth_users": {"prometheus": HASH},
        },
        Path("/etc/gpuagent"),
    )
    assert config.tls is not None
    assert config.tls.cert_file == Path("/etc/gpuagent/server.crt")
    assert config.tls.key_file == Path("/abs/server.key")
    assert config.tls.client_ca_file == Path("/etc/gpuagent/ca.crt")
    assert (config.tls.min_version, config.tls.max_version) == ("TLS13", "TLS13")
    assert dict(config.headers) == {"X-Frame-Options": "deny"}
    assert dict(config.users) == {"prometheus": HASH.encode()}


def test_empty_mapping_is_plain_http() -> None:
    config = parse_web_config({}, Path("."))
    assert config.tls is None
    assert not config.users


@pytest.mark.parametrize("text", ["", "\n", "# auth comes later\n", "---\n"])
def test_a_file_without_a_document_is_refused(tmp_path: Path, text: str) -> None:
    """An empty file is what a writer leaves between truncating and writing: never "no
    authentication" (that is written `{}`)."""
    path = tmp_path / "web.yml"
    path.write_text(text)
    with pytest.raises(WebConfigError) as info:
        load_web_config(path)
    assert info.value.key == "file"
    assert info.value.reason == (
        f"{path} holds no YAML document (empty, or comments only: written halfway?); "
        "a web config without TLS or authentication is written `{}`"
    )


@pytest.mark.parametrize(
    ("document", "key"),
    [
        pytest.param({"tls_config": {}}, "tls_config", id="unknown-top"),
        pytest.param({"rate_limit": {"interval": "1s"}}, "rate_limit", id="rate-limit"),
        pytest.param(
            {"tls_server_config": {"cert_file": "a", "key_file": "b", "certfile": "c"}},
            "tls_server_config.certfile",
            id="unknown-tls",
        ),
        pytest.param(
            {"tls_server_config": {"cert": "PEM", "key_file": "b"}},
            "tls_server_config.cert",
            id="inline-pem",
        ),
        pytest.param(
            {"tls_server_config": {"cert_file": "a", "key_file": "b", "cipher_suites": []}},
            "tls_server_config.cipher_suites",
            id="cipher-suites",
        ),
        pytest.param(
            {"tls_server_config": {"key_file": "b"}}, "tls_server_config.cert_file", id="no-cert"
        ),
        pytest.param(
            {"tls_server_config": {"cert_file": "a"}}, "tls_server_config.key_file", id="no-key"
        ),
        pytest.param(
            {
                "tls_server_config": {
                    "cert_file": "a",
                    "key_file": "b",
                    "client_auth_type": "RequireAndVerifyClientCert",
                }
            },
            "tls_server_config.client_ca_file",
            id="verify-without-ca",
        ),
        pytest.param(
            {
                "tls_server_config": {
                    "cert_file": "a",
                    "key_file": "b",
                    "client_auth_type": "RequireAnyClientCert",
                }
            },
            "tls_server_config.client_auth_type",
            id="unverified-client-certs",
        ),
        pytest.param(
            {"tls_server_config": {"cert_file": "a", "key_file": "b", "min_version": "SSL3"}},
            "tls_server_config.min_version",
            id="bad-version",
        ),
        pytest.param(
            {
                "tls_server_config": {
                    "cert_file": "a",
                    "key_file": "b",
                    "min_version": "TLS13",
                    "max_version": "TLS12",
                }
            },
            "tls_server_config.min_version",
            id="min-above-max",
        ),
        pytest.param(
            {"http_server_config": {"http3": True}}, "http_server_config.http3", id="unknown-http"
        ),
        pytest.param(
            {"http_server_config": {"headers": {"Set-Cookie": "x"}}},
            "http_server_config.headers.Set-Cookie",
            id="header-not-allowed",
        ),
        pytest.param(
            {"http_server_config": {"headers": {"X-Frame-Options": "a\r\nX: y"}}},
            "http_server_config.headers.X-Frame-Options",
            id="header-injection",
        ),
        pytest.param(
            {"basic_auth_users": {"u": "plaintext"}}, "basic_auth_users.u", id="not-bcrypt"
        ),
        pytest.param({"basic_auth_users": {"a:b": HASH}}, "basic_auth_users.a:b", id="colon-user"),
        pytest.param(
            {"basic_auth_users": {"u": HASH[:40]}}, "basic_auth_users.u", id="hash-cut-short"
        ),
        pytest.param(
            {"basic_auth_users": {"u": HASH + "x"}}, "basic_auth_users.u", id="hash-too-long"
        ),
        pytest.param({"basic_auth_users": None}, "basic_auth_users", id="users-without-value"),
        pytest.param({"tls_server_config": None}, "tls_server_config", id="tls-without-value"),
        pytest.param({"http_server_config": None}, "http_server_config", id="http-without-value"),
        pytest.param({"basic_auth_users": ["u"]}, "basic_auth_users", id="users-not-mapping"),
        pytest.param(["x"], "web config", id="not-a-mapping"),
    ],
)
def test_rejections_name_the_key(document: object, key: str) -> None:
    assert error(document).key == key


def test_unreadable_and_invalid_files(tmp_path: Path) -> None:
    with pytest.raises(WebConfigError) as info:
        load_web_config(tmp_path / "missing.yml")
    assert info.value.key == "file"
    bad = tmp_path / "bad.yml"
    bad.write_text("basic_auth_users: [\n")
    with pytest.raises(WebConfigError) as info:
        load_web_config(bad)
    assert info.value.reason == (
        f"{bad}:2:1: expected the node content, but found '<stream end>' (while parsing a flow "
        "node)"
    )


def test_tls_context_from_files(tmp_path: Path, pki: Pki) -> None:
    path = tmp_path / "web.yml"
    path.write_text(
        f"tls_server_config:\n  cert_file: {pki.server_cert}\n  key_file: {pki.server_key}\n"
        f"  client_ca_file: {pki.ca_cert}\n  client_auth_type: VerifyClientCertIfGiven\n"
    )
    loaded = WebConfigFile(path)
    assert loaded.ssl_context is not None
    assert loaded.ssl_context.verify_mode == ssl.CERT_OPTIONAL
    assert loaded.ssl_context.minimum_version == ssl.TLSVersion.TLSv1_2


def test_tls_files_must_load(tmp_path: Path, pki: Pki) -> None:
    path = tmp_path / "web.yml"
    path.write_text(
        f"tls_server_config:\n  cert_file: {pki.ca_cert}\n  key_file: {pki.server_key}\n"
    )
    with pytest.raises(WebConfigError) as info:
        WebConfigFile(path)
    assert info.value.key == "tls_server_config.cert_file"


async def test_basic_auth_checks_bcrypt() -> None:
    auth = BasicAuth({"prometheus": HASH.encode()})
    assert await auth.check(header("prometheus", PASSWORD)) == AuthResult.OK
    assert await auth.check(header("prometheus", b"wrong")) == AuthResult.DENIED
    assert await auth.check(header("nobody", PASSWORD)) == AuthResult.DENIED
    for bad in (None, "", "Bearer x", "Basic !!!", "Basic " + base64.b64encode(b"nocolon").decode(),
                "Basic " + "A" * 5000):  # fmt: skip
        assert await auth.check(bad) == AuthResult.DENIED


async def test_basic_auth_without_users_allows_all() -> None:
    auth = BasicAuth({})
    assert not auth.enabled
    assert await auth.check(None) == AuthResult.OK


async def test_basic_auth_caches_results(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = 0
    real = bcrypt.checkpw

    def counting(password: bytes, hashed: bytes) -> bool:
        nonlocal calls
        calls += 1
        return bool(real(password, hashed))

    monkeypatch.setattr(bcrypt, "checkpw", counting)
    auth = BasicAuth({"prometheus": HASH.encode()})
    for _ in range(5):
        assert await auth.check(header("prometheus", PASSWORD)) == AuthResult.OK
        assert await auth.check(header("prometheus", b"nope")) == AuthResult.DENIED
    assert calls == 2


async def test_basic_auth_turns_away_a_flood(monkeypatch: pytest.MonkeyPatch) -> None:
    release = asyncio.Event()
    loop = asyncio.get_running_loop()

    def slow(password: bytes, hashed: bytes) -> bool:
        asyncio.run_coroutine_threadsafe(release.wait(), loop).result(timeout=10)
        return False

    monkeypatch.setattr(bcrypt, "checkpw", slow)
    auth = BasicAuth({"prometheus": HASH.encode()})
    attempts = [
        asyncio.create_task(auth.check(header("prometheus", str(i).encode())))
        for i in range(BasicAuth.MAX_WAITING + 5)
    ]
    await asyncio.sleep(0)
    done = [t for t in attempts if t.done()]
    assert len(done) == 5
    assert {t.result() for t in done} == {AuthResult.BUSY}
    release.set()
    results = await asyncio.wait_for(asyncio.gather(*attempts), 10)
    assert results.count(AuthResult.DENIED) == BasicAuth.MAX_WAITING


def test_reread_and_used_on_reload(tmp_path: Path) -> None:
    path = tmp_path / "web.yml"
    path.write_text(f"basic_auth_users:\n  a: {HASH}\n")
    loaded = WebConfigFile(path)
    assert set(loaded.config.users) == {"a"}
    path.write_text(f"basic_auth_users:\n  b: {HASH}\n")
    assert set(loaded.config.users) == {"a"}  # nothing is read until a reload
    assert loaded.use(loaded.reread()) is True
    assert set(loaded.config.users) == {"b"}
    assert set(loaded.auth.users) == {"b"}
    assert loaded.use(loaded.reread()) is False  # nothing changed since
    path.write_text("basic_auth_users:\n  c: plaintext\n")
    with pytest.raises(WebConfigError) as info:
        loaded.reread()
    assert info.value.key == "basic_auth_users.c"
    assert set(loaded.config.users) == {"b"}


def test_turning_tls_on_or_off_is_refused(tmp_path: Path, pki: Pki) -> None:
    path = tmp_path / "web.yml"
    tls = f"tls_server_config:\n  cert_file: {pki.server_cert}\n  key_file: {pki.server_key}\n"
    for before, after in [("{}", tls), (tls, "{}")]:
        path.write_text(before)
        loaded = WebConfigFile(path)
        path.write_text(after)
        with pytest.raises(WebConfigError) as info:
            loaded.reread()
        assert str(info.value) == "tls_server_config: turning TLS on or off needs a restart"


def test_new_certificates_are_loaded_into_the_running_context(tmp_path: Path, pki: Pki) -> None:
    """A reload that finds the certificate files changed serves them through the context the
    server listens with (the same object); one whose files are gone fails before any of it is
    used."""
    cert, key = tmp_path / "server.crt", tmp_path / "server.key"
    cert.write_bytes(pki.server_cert.read_bytes())
    key.write_bytes(pki.server_key.read_bytes())
    path = tmp_path / "web.yml"
    path.write_text("tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n")
    loaded = WebConfigFile(path)
    assert loaded.ssl_context is not None
    context = loaded.ssl_context
    cert.write_bytes(pki.client_cert.read_bytes())  # another certificate, the same paths
    key.write_bytes(pki.client_key.read_bytes())
    assert loaded.use(loaded.reread()) is True
    assert loaded.ssl_context is context
    key.unlink()
    with pytest.raises(WebConfigError) as info:
        loaded.reread()
    assert info.value.key == "tls_server_config.key_file"
