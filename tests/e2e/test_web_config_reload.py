"""--web-config-file is reloaded by the agent's one reload path: SIGHUP, or a change of the config
file, of the web config file or of a TLS file it names (the reload loop's file stamps)."""

from __future__ import annotations

import asyncio
import base64
import socket
import ssl
from pathlib import Path

import bcrypt
from structlog.testing import capture_logs
from support.tls import make_pki
from support.waiting import eventually

from e2e.agentrun import RunningAgent, running_agent
from gpuagent.state.counters import ReloadStats

PASSWORD = b"correct horse"
HASH = bcrypt.hashpw(PASSWORD, bcrypt.gensalt(4)).decode()


def basic(user: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:".encode() + PASSWORD).decode()}


def reloads(run: RunningAgent) -> ReloadStats:
    return run.agent.store.counters.read().reloads


async def status(run: RunningAgent, user: str) -> int:
    async with run.http.get(run.base_url + "/metrics", headers=basic(user)) as response:
        return response.status


async def test_a_changed_web_config_is_served_without_a_signal(
    device_plugin_dir: Path, tmp_path: Path
) -> None:
    web = tmp_path / "web.yml"
    web.write_text(f"basic_auth_users:\n  alice: {HASH}\n")
    args = ("--simulate", "1", "--web-config-file", str(web))
    async with running_agent(device_plugin_dir, args) as run:
        assert (await status(run, "alice"), await status(run, "bob")) == (200, 401)
        with capture_logs() as logs:
            web.write_text(f"basic_auth_users:\n  bob: {HASH}\n")
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
    async with running_agent(device_plugin_dir, args, config_poll_interval=3600) as run:
        web.write_text("basic_auth_users:\n  bob: plaintext\n")
        config.write_text("version: v1\nmig-strategy: mixed\n")
        with capture_logs() as logs:
            assert await run.agent.reload() is None
        (entry,) = [e for e in logs if e["log_level"] == "error"]
        assert entry["error"] == (
            "web-config-file basic_auth_users.bob: must be a bcrypt hash ($2a$, $2b$ or $2y$) "
            f"(in {web})"
        )
        assert reloads(run) == ReloadStats(invalid=1, last_successful=False)
        assert run.agent.store.plan.generation == 0
        assert await status(run, "alice") == 200


async def test_new_certificates_are_served_to_new_connections(
    device_plugin_dir: Path, tmp_path: Path
) -> None:
    pki = await asyncio.to_thread(make_pki, tmp_path / "pki")
    other = await asyncio.to_thread(make_pki, tmp_path / "other")
    cert, key = tmp_path / "server.crt", tmp_path / "server.key"
    cert.write_bytes(pki.server_cert.read_bytes())
    key.write_bytes(pki.server_key.read_bytes())
    web = tmp_path / "web.yml"
    web.write_text("tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n")
    args = ("--simulate", "1", "--web-config-file", str(web))
    async with running_agent(device_plugin_dir, args) as run:
        port = run.agent.rest.http.port
        first = await asyncio.to_thread(_served_certificate, port, pki.ca_cert)
        assert first == ssl.PEM_cert_to_DER_cert(pki.server_cert.read_text())
        key.write_bytes(other.server_key.read_bytes())  # a key, then its certificate
        cert.write_bytes(other.server_cert.read_bytes())
        await eventually(lambda: reloads(run).changed >= 1, what="the reload")
        rotated = await asyncio.to_thread(_served_certificate, port, other.ca_cert)
        assert rotated == ssl.PEM_cert_to_DER_cert(other.server_cert.read_text())


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
