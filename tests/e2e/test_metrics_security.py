"""--web-config-file end to end: TLS and basic auth on the running agent, and bad files refused."""

from __future__ import annotations

import asyncio
import base64
import ssl
import subprocess
import sys
from pathlib import Path

import aiohttp
import bcrypt
import pytest
import structlog
from support.tls import make_pki

from e2e.agentrun import running_agent
from gpuagent.app.agent import Agent
from gpuagent.config import ConfigError, load_settings

PASSWORD = b"correct horse"
HASH = bcrypt.hashpw(PASSWORD, bcrypt.gensalt(4)).decode()


async def test_tls_and_basic_auth_on_the_agent(device_plugin_dir: Path, tmp_path: Path) -> None:
    pki = await asyncio.to_thread(make_pki, tmp_path / "pki")
    web = tmp_path / "web.yml"
    web.write_text(
        f"tls_server_config:\n  cert_file: {pki.server_cert}\n  key_file: {pki.server_key}\n"
        f"basic_auth_users:\n  prometheus: {HASH}\n"
    )
    client_tls = ssl.create_default_context(cafile=pki.ca_cert)
    good = {"Authorization": "Basic " + base64.b64encode(b"prometheus:" + PASSWORD).decode()}
    args = ("--simulate", "1", "--web-config-file", str(web))
    async with running_agent(device_plugin_dir, args) as run, aiohttp.ClientSession() as http:
        url = f"https://127.0.0.1:{run.port}"
        async with http.get(url + "/metrics", ssl=client_tls) as response:
            assert response.status == 401
        async with http.get(url + "/metrics", ssl=client_tls, headers=good) as response:
            assert response.status == 200
            assert "gpuagent_gpus 1" in await response.text()
        async with http.post(url + "/sim/faults", ssl=client_tls, json={}) as response:
            assert response.status == 401  # fault injection is behind auth too
        async with http.get(url + "/healthz", ssl=client_tls) as response:
            assert response.status == 200  # kubelet probes send no credentials


@pytest.mark.parametrize(
    ("body", "key"),
    [
        pytest.param(
            "tls_server_config:\n  cert_file: a\n  key_file: b\n  typo: 1\n",
            "tls_server_config.typo",
            id="unknown-tls-key",
        ),
        pytest.param("basic_auth_user:\n  a: b\n", "basic_auth_user", id="unknown-top-key"),
        pytest.param("basic_auth_users:\n  a: plain\n", "basic_auth_users.a", id="not-bcrypt"),
        pytest.param(
            "tls_server_config:\n  cert_file: /none.crt\n  key_file: /none.key\n",
            "tls_server_config.cert_file",
            id="missing-cert",
        ),
    ],
)
def test_bad_web_config_is_a_config_error(tmp_path: Path, body: str, key: str) -> None:
    web = tmp_path / "web.yml"
    web.write_text(body)
    settings = load_settings(["--simulate", "1", "--web-config-file", str(web)], {})
    with pytest.raises(ConfigError) as info:
        Agent(settings)
    assert info.value.key == f"--web-config-file {key}"  # the flag as typed


@pytest.mark.slow
def test_bad_web_config_exits_2_naming_the_key(tmp_path: Path) -> None:
    web = tmp_path / "web.yml"
    web.write_text("http_server_config:\n  headerz: {}\n")
    result = subprocess.run(
        [sys.executable, "-m", "gpuagent", "--simulate", "1", "--web-config-file", str(web)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2, result.stderr
    assert "http_server_config.headerz" in result.stderr


async def test_credentials_never_reach_the_logs(device_plugin_dir: Path, tmp_path: Path) -> None:
    web = tmp_path / "web.yml"
    web.write_text(f"basic_auth_users:\n  prometheus: {HASH}\n")
    wrong = {"Authorization": "Basic " + base64.b64encode(b"prometheus:hunter2").decode()}
    good = {"Authorization": "Basic " + base64.b64encode(b"prometheus:" + PASSWORD).decode()}
    args = ("--simulate", "1", "--web-config-file", str(web), "--log-level", "debug")
    with structlog.testing.capture_logs() as logs:
        async with running_agent(device_plugin_dir, args) as run, aiohttp.ClientSession() as http:
            for headers in (wrong, good):
                async with http.get(run.base_url + "/metrics", headers=headers) as response:
                    assert response.status in (200, 401)
    text = repr(logs)
    assert logs
    for secret in (
        "hunter2",
        PASSWORD.decode(),
        HASH,
        wrong["Authorization"],
        good["Authorization"],
    ):
        assert secret not in text
