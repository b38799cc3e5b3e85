"""The credentials told without the API client: :func:`unusable` refuses what the client cannot
load (so the DRA side refuses it before anything starts), and passes what it loads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from lightkube import ConfigError as LightkubeConfigError
from lightkube import KubeConfig
from support.tls import make_pki

from gpuagent.kube.client import KubeApi, KubeConfigError, load_config
from gpuagent.kube.credentials import unusable


def _kubeconfig(**changes: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:6443"}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "x",
    }
    config.update(changes)
    return config


BAD = [
    pytest.param(None, "no such file", id="missing"),
    pytest.param("clusters: [a\n", "1:", id="not-yaml"),
    pytest.param(["a"], "not a kubeconfig", id="not-a-mapping"),
    pytest.param(_kubeconfig(clusters="c"), "clusters: not a list", id="clusters-not-a-list"),
    pytest.param(_kubeconfig(contexts=[{"name": "x"}]), "contexts[0]: no context mapping",
                 id="context-without-mapping"),
    pytest.param(_kubeconfig(**{"current-context": None}), "no current-context",
                 id="no-current-context"),
    pytest.param(_kubeconfig(**{"current-context": "y"}), "current-context 'y': no such context",
                 id="current-context-absent"),
    pytest.param(_kubeconfig(clusters=[]), "context 'x': no cluster named 'c'",
                 id="cluster-absent"),
    pytest.param(_kubeconfig(users=[]), "context 'x': no user named 'u'", id="user-absent"),
    pytest.param(
        _kubeconfig(clusters=[{"name": "c", "cluster": {
            "server": "https://127.0.0.1:6443", "certificate-authority": "pki/ca.crt"}}]),
        "cluster 'c': certificate-authority ", id="ca-file-absent"),
    pytest.param(
        _kubeconfig(users=[{"name": "u", "user": {
            "client-certificate": "/nonexistent/client.crt", "client-key": "pki/client.key"}}]),
        "user 'u': client-certificate /nonexistent/client.crt: no such file",
        id="client-certificate-absent"),
]  # fmt: skip


def _write(tmp_path: Path, content: object) -> Path:
    path = tmp_path / "kubeconfig"
    if content is not None:
        path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


NO_SERVER = pytest.param(
    _kubeconfig(clusters=[{"name": "c", "cluster": {}}]), "cluster 'c': no server", id="no-server"
)
# What the client raises for them: each of these took the agent down with a traceback before
# the check (only its own KubeConfigError was a configuration error).
# A file the kubeconfig names that is not there: OSError, as the client makes its TLS context.
CLIENT_ERRORS = (
    KubeConfigError, LightkubeConfigError, yaml.YAMLError, AttributeError, KeyError, OSError
)  # fmt: skip


@pytest.mark.parametrize(("content", "said"), [*BAD, NO_SERVER])
def test_a_kubeconfig_the_client_cannot_use_is_refused_naming_it(
    tmp_path: Path, content: object, said: str
) -> None:
    path = _write(tmp_path, content)
    why = unusable(path)
    assert why is not None
    assert why.startswith(f"{path}: ")
    assert said in why


@pytest.mark.parametrize(("content", "said"), BAD)
async def test_what_is_refused_the_client_cannot_use_either(
    tmp_path: Path, content: object, said: str
) -> None:
    """No refusal of credentials the client would have used (but a cluster without a server,
    which the client would take for http://localhost:8080 and kubectl refuses)."""
    path = _write(tmp_path, content)
    with pytest.raises(CLIENT_ERRORS):
        await _client(path)


async def test_a_kubeconfig_the_client_loads_passes(tmp_path: Path) -> None:
    path = _write(tmp_path, _kubeconfig(users=[{"name": "u", "user": {}}]))
    assert unusable(path) is None
    await _client(path)  # (and the client loads it)


@pytest.fixture
def with_ca(tmp_path: Path) -> Path:
    """``tmp_path``, with a CA's certificate at ``pki/ca.crt``."""
    make_pki(tmp_path / "pki")
    return tmp_path


async def test_files_named_relative_to_the_kubeconfig_are_found_there(with_ca: Path) -> None:
    tmp_path = with_ca
    cluster = {"server": "https://127.0.0.1:6443", "certificate-authority": "pki/ca.crt"}
    path = _write(tmp_path, _kubeconfig(clusters=[{"name": "c", "cluster": cluster}]))
    assert unusable(path) is None
    await _client(path)  # (and the client reads it there)


def test_without_a_user_the_context_passes(tmp_path: Path) -> None:
    config = _kubeconfig(contexts=[{"name": "x", "context": {"cluster": "c"}}])
    assert unusable(_write(tmp_path, config)) is None


async def _client(path: Path) -> None:
    """The client, made from ``path`` as the DRA side makes it, and closed."""
    await KubeApi(load_config(path)).close()


def _account(tmp_path: Path, *files: str) -> Path:
    for name in files:
        (tmp_path / name).write_text("x")
    return tmp_path


IN_A_POD = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "KUBERNETES_SERVICE_PORT": "443"}


@pytest.mark.parametrize(
    ("environ", "files", "said"),
    [
        ({}, ("token", "namespace", "ca.crt"), "KUBERNETES_SERVICE_HOST unset (not in a pod?)"),
        ({"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, ("token", "namespace", "ca.crt"),
         "KUBERNETES_SERVICE_PORT unset"),
        (IN_A_POD, ("namespace", "ca.crt"), "no token in"),
        (IN_A_POD, ("token", "ca.crt"), "no namespace in"),
        (IN_A_POD, ("token", "namespace"), "no ca.crt in"),
    ],
    ids=["not-in-a-pod", "no-port", "no-token", "no-namespace", "no-ca"],
)  # fmt: skip
def test_the_service_account_refused_saying_what_is_missing(
    tmp_path: Path, environ: dict[str, str], files: tuple[str, ...], said: str
) -> None:
    why = unusable(None, environ=environ, account=_account(tmp_path, *files))
    assert why is not None
    assert why.startswith("in-cluster service account: ")
    assert said in why


async def test_a_pods_service_account_passes(
    with_ca: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    account = _account(with_ca, "token", "namespace")
    (account / "ca.crt").write_bytes((with_ca / "pki" / "ca.crt").read_bytes())
    assert unusable(None, environ=IN_A_POD, account=account) is None
    for variable, value in IN_A_POD.items():
        monkeypatch.setenv(variable, value)
    await KubeApi(KubeConfig.from_service_account(account)).close()  # (and the client loads it)
