"""--web-config-file is reloaded by the agent's one reload path: SIGHUP, or a change of the config
file, of the web config file or of a TLS file it names (the reload loop's file stamps).

Files are written as their writers write them: atomically (an editor's or a tool's rename, a
ConfigMap's ``..data`` symlink swapped), or carelessly (truncated, then written in two steps).
Where a test writes in steps it reloads at each one itself (the loop's polling is turned off):
every state is looked at, exactly once.
"""

from __future__ import annotations

import asyncio
import base64
import os
import socket
import ssl
from collections.abc import Iterable
from pathlib import Path

import bcrypt
import pytest
from structlog.testing import capture_logs
from support.files import replace_atomically
from support.tls import Pki, make_pki
from support.tlsclient import KeptConnection
from support.waiting import eventually

from e2e.agentrun import RunningAgent, running_agent
from gpuagent.app import reload as reload_module
from gpuagent.state.counters import ReloadStats

PASSWORD = b"correct horse"
HASH = bcrypt.hashpw(PASSWORD, bcrypt.gensalt(4)).decode()


def basic(user: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:".encode() + PASSWORD).decode()}


def reloads(run: RunningAgent) -> ReloadStats:
    return run.agent.store.counters.read().reloads


async def status(run: RunningAgent, user: str | None) -> int:
    headers = basic(user) if user is not None else {}
    async with run.http.get(run.base_url + "/metrics", headers=headers) as response:
        return response.status


async def served_over_tls(tmp_path: Path) -> tuple[Pki, Pki, Path, Path, tuple[str, ...]]:
    """Two PKIs, a web config serving TLS with the first's server certificate and key (copied
    beside it, for the test to replace), and the agent's arguments: ``(pki, other, cert, key,
    args)``."""
    pki = await asyncio.to_thread(make_pki, tmp_path / "pki")
    other = await asyncio.to_thread(make_pki, tmp_path / "other")
    cert, key = tmp_path / "server.crt", tmp_path / "server.key"
    cert.write_bytes(pki.server_cert.read_bytes())
    key.write_bytes(pki.server_key.read_bytes())
    web = tmp_path / "web.yml"
    web.write_text("tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n")
    return pki, other, cert, key, ("--simulate", "1", "--web-config-file", str(web))


async def test_a_changed_web_config_is_served_without_a_signal(
    device_plugin_dir: Path, tmp_path: Path
) -> None:
    web = tmp_path / "web.yml"
    web.write_text(f"basic_auth_users:\n  alice: {HASH}\n")
    args = ("--simulate", "1", "--web-config-file", str(web))
    async with running_agent(device_plugin_dir, args) as run:
        assert (await status(run, "alice"), await status(run, "bob")) == (200, 401)
        with capture_logs() as logs:
            # Renamed into place: the reload loop sees the old file or the new one, never one
            # in between. (Written in place, the loop could see it truncated, then whole: two
            # reloads, and the second unchanged. CI saw that once in 2,882 runs.)
            replace_atomically(web, f"basic_auth_users:\n  bob: {HASH}\n")
            await eventually(lambda: reloads(run).changed == 1, what="the reload")
        assert (await status(run, "alice"), await status(run, "bob")) == (401, 200)
        assert reloads(run).unchanged == 0  # the web config changed: the reload did
        events = [e["event"] for e in logs if e["log_level"] == "info"]
        assert events == [
            "config file changed; reloading",
            "web config reloaded",
            "configuration reloaded",
        ]
        assert logs[0]["path"] == str(web)


async def test_an_invalid_web_config_refuses_the_reload(
    device_plugin_dir: Path, short_tmp_path: Path
) -> None:
    """A web config that no longer parses refuses the whole reload: the config file's change
    beside it waits, the running users stay, and the refusal is counted."""
    web = short_tmp_path / "web.yml"
    web.write_text(f"basic_auth_users:\n  alice: {HASH}\n")
    config = short_tmp_path / "gpuagent.yaml"
    config.write_text("version: v1\n")
    args = ("--simulate", "1", "--web-config-file", str(web), "--config", str(config))
    async with running_agent(device_plugin_dir, args, config_check_interval=3600) as run:
        web.write_text("basic_auth_users:\n  bob: plaintext\n")
        config.write_text("version: v1\nmig-strategy: mixed\n")
        with capture_logs() as logs:
            assert await run.agent.reload() is None
        (entry,) = [e for e in logs if e["log_level"] == "error"]
        assert entry["error"] == (
            "--web-config-file basic_auth_users.bob: must be a bcrypt hash ($2a$, $2b$ or $2y$) "
            f"(in {web})"
        )
        assert reloads(run) == ReloadStats(invalid=1, last_successful=False)
        assert run.agent.store.plan.generation == 0
        assert await status(run, "alice") == 200


async def test_new_certificates_are_served_to_new_connections(
    device_plugin_dir: Path, tmp_path: Path
) -> None:
    pki, other, cert, key, args = await served_over_tls(tmp_path)
    async with running_agent(device_plugin_dir, args) as run:
        port = run.port
        first = await asyncio.to_thread(_served_certificate, port, pki.ca_cert)
        assert first == ssl.PEM_cert_to_DER_cert(pki.server_cert.read_text())
        key.write_bytes(other.server_key.read_bytes())  # a key, then its certificate
        cert.write_bytes(other.server_cert.read_bytes())
        await eventually(lambda: reloads(run).changed >= 1, what="the reload")
        rotated = await asyncio.to_thread(_served_certificate, port, other.ca_cert)
        assert rotated == ssl.PEM_cert_to_DER_cert(other.server_cert.read_text())


USERS = f"basic_auth_users:\n  bob: {HASH}\n"
HEADERS = "http_server_config:\n  headers:\n    X-Frame-Options: deny\n"


@pytest.mark.parametrize(
    ("first", "second", "why"),
    [
        pytest.param(
            USERS[:40], USERS[40:], "is not a whole bcrypt hash (60 characters; cut short?)",
            id="cut-in-a-hash",
        ),
        pytest.param(
            HEADERS, USERS, "is missing while basic auth is on (a file written halfway?): "
            "to turn basic auth off, write `basic_auth_users: {}`",
            id="cut-after-the-headers",
        ),
    ],
)  # fmt: skip
async def test_a_web_config_written_in_steps_never_lets_anyone_in(
    device_plugin_dir: Path, short_tmp_path: Path, first: str, second: str, why: str
) -> None:
    """Truncated, then written in two steps, reloaded at each (and once more, as a SIGHUP
    would): anonymous scrapes stay refused and alice stays in until the file is whole; each
    refusal is counted, and logged once."""
    web = short_tmp_path / "web.yml"
    web.write_text(f"basic_auth_users:\n  alice: {HASH}\n")
    args = ("--simulate", "1", "--web-config-file", str(web))
    async with running_agent(device_plugin_dir, args, config_check_interval=3600) as run:
        with capture_logs() as logs:
            for state in ("", first):
                web.write_text(state)
                for _ in range(2):
                    assert await run.agent.reload() is None
                    assert [await status(run, u) for u in (None, "alice", "bob")] == [401, 200, 401]
            web.write_text(first + second)
            assert await run.agent.reload() == []
        assert [await status(run, u) for u in (None, "alice", "bob")] == [401, 401, 200]
        assert reloads(run) == ReloadStats(changed=1, invalid=4, last_successful=True)
        errors = [e["error"] for e in logs if e["log_level"] == "error"]
        assert errors == [
            f"--web-config-file: {web} holds no YAML document (empty, or comments only: written "
            "halfway?); a web config without TLS or authentication is written `{}`",
            f"--web-config-file basic_auth_users{'.bob' if 'hash' in why else ''}: {why} "
            f"(in {web})",
        ]


async def test_a_configmap_update_swaps_the_users_at_once(
    device_plugin_dir: Path, short_tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ConfigMap volume as the kubelet writes it: the files in a directory of their own,
    reached through the ``..data`` symlink, which is swapped by a rename. The reload loop finds
    one change (the swap), reloads once, and anonymous scrapes are refused throughout."""
    volume = short_tmp_path / "volume"
    volume.mkdir()
    (volume / "..v1").mkdir()
    (volume / "..v1" / "web.yml").write_text(f"basic_auth_users:\n  alice: {HASH}\n")
    (volume / "..data").symlink_to("..v1")
    web = volume / "web.yml"
    web.symlink_to("..data/web.yml")
    looks = 0  # how often the reload loop has read the watched files
    stamps = reload_module._stamps

    def counted(paths: Iterable[Path]) -> dict[Path, bytes | None]:
        nonlocal looks
        looks += 1
        return stamps(paths)

    monkeypatch.setattr(reload_module, "_stamps", counted)
    args = ("--simulate", "1", "--web-config-file", str(web))
    async with running_agent(device_plugin_dir, args) as run:
        (volume / "..v2").mkdir()
        (volume / "..v2" / "web.yml").write_text(USERS)
        assert await status(run, None) == 401
        (volume / "..data_tmp").symlink_to("..v2")
        assert await status(run, None) == 401
        os.replace(volume / "..data_tmp", volume / "..data")
        await eventually(lambda: reloads(run).changed == 1, what="the reload")
        assert [await status(run, u) for u in (None, "alice", "bob")] == [401, 401, 200]
        (volume / "..v1" / "web.yml").unlink()
        (volume / "..v1").rmdir()
        looked = looks
        await eventually(lambda: looks >= looked + 2, what="the loop to look again")
        assert reloads(run) == ReloadStats(changed=1)  # nothing new through the symlink


async def test_a_half_written_key_keeps_the_served_certificate(
    device_plugin_dir: Path, tmp_path: Path
) -> None:
    pki, other, cert, key, args = await served_over_tls(tmp_path)
    async with running_agent(device_plugin_dir, args, config_check_interval=3600) as run:
        port = run.port
        served = ssl.PEM_cert_to_DER_cert(pki.server_cert.read_text())
        cert.write_bytes(other.server_cert.read_bytes())
        new_key = other.server_key.read_bytes()
        for state in (b"", new_key[: len(new_key) // 2]):
            key.write_bytes(state)
            assert await run.agent.reload() is None
            assert await asyncio.to_thread(_served_certificate, port, pki.ca_cert) == served
        key.write_bytes(new_key)
        assert await run.agent.reload() == []
        rotated = await asyncio.to_thread(_served_certificate, port, other.ca_cert)
        assert rotated == ssl.PEM_cert_to_DER_cert(other.server_cert.read_text())


async def test_a_client_ca_replaced_closes_the_connections_it_verified(
    device_plugin_dir: Path, tmp_path: Path
) -> None:
    """A scraper's kept connection, verified by the CA the reload removes, is closed at once;
    the scraper connects again, with a certificate the new CA signed."""
    pki, other, _, _, args = await served_over_tls(tmp_path)
    ca = tmp_path / "client-ca.crt"
    ca.write_bytes(pki.ca_cert.read_bytes())
    web = tmp_path / "web.yml"
    web.write_text(
        web.read_text() + "  client_ca_file: client-ca.crt\n"
        "  client_auth_type: RequireAndVerifyClientCert\n"
    )
    async with running_agent(device_plugin_dir, args) as run:
        kept = KeptConnection(run.port, pki.ca_cert, cert=pki)
        try:
            assert (await kept.ask()).startswith("200 OK")
            replace_atomically(ca, other.ca_cert.read_text())
            await eventually(lambda: reloads(run).changed == 1, what="the reload")
            assert await kept.closed_by_server()
        finally:
            kept.close()
        again = KeptConnection(run.port, pki.ca_cert, cert=other)
        try:
            assert (await again.ask()).startswith("200 OK")
        finally:
            again.close()


def _served_certificate(port: int, ca: Path) -> bytes:
    """The certificate a new TLS connection to the agent is served (verified against ``ca``)."""
    context = ssl.create_default_context(cafile=ca)
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
        context.wrap_socket(raw, server_hostname="localhost") as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return der
