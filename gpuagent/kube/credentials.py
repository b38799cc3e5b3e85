"""Whether the agent has API-server credentials, told without importing the client: at all
(:func:`missing`: the node condition and events are on by default exactly where it has), and
whether they can be loaded (:func:`unusable`: the DRA side refuses to start without, before
anything starts, while the client is imported only once the kubelet has its device plugin)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gpuagent.yamlfile import YamlFileError, read_yaml

__all__ = ["SERVICE_ACCOUNT", "missing", "unusable"]

#: Where a pod's service-account token is mounted.
SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")


def missing(
    kubeconfig: Path | None,
    *,
    environ: Mapping[str, str] = os.environ,
    account: Path = SERVICE_ACCOUNT,
    named: str = "--kubeconfig",
) -> str | None:
    """Why the agent has no credentials (``--kubeconfig``, given as ``named``, else the pod's
    service account), or ``None`` when it has some (whether they are valid is found when they
    are loaded)."""
    if kubeconfig is not None:
        return None if kubeconfig.is_file() else f"{named} {kubeconfig}: no such file"
    if not environ.get("KUBERNETES_SERVICE_HOST"):
        return "not in a pod (KUBERNETES_SERVICE_HOST unset) and no --kubeconfig"
    if not (account / "token").is_file():
        return f"no service-account token in {account} (automountServiceAccountToken: false?)"
    return None


def unusable(
    kubeconfig: Path | None,
    *,
    environ: Mapping[str, str] = os.environ,
    account: Path = SERVICE_ACCOUNT,
) -> str | None:
    """Why the credentials cannot be loaded, as the client loads them (``kubeconfig``'s current
    context, else the pod's service account), or ``None``. What the client's models then make of
    the values (a field of the wrong type) is found when it loads them."""
    if kubeconfig is not None:
        problem = _kubeconfig_problem(kubeconfig)
        return None if problem is None else f"{kubeconfig}: {problem}"
    problem = _account_problem(environ, account)
    return None if problem is None else f"in-cluster service account: {problem}"


def _account_problem(environ: Mapping[str, str], account: Path) -> str | None:
    for variable in ("KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT"):
        if not environ.get(variable):
            return f"{variable} unset (not in a pod?)"
    for name in ("token", "namespace", "ca.crt"):  # (the client reads ca.crt as it is made)
        if not (account / name).is_file():
            return f"no {name} in {account} (automountServiceAccountToken: false?)"
    return None


def _kubeconfig_problem(path: Path) -> str | None:
    """What keeps the current context of the kubeconfig at ``path`` from being loaded."""
    if not path.is_file():
        return "no such file"
    try:
        config = read_yaml(path)
    except YamlFileError as exc:
        return str(exc).removeprefix(f"{path}:").lstrip()
    if not isinstance(config, dict):
        return "not a kubeconfig (a mapping with clusters, contexts and current-context)"
    try:
        clusters = _named(config, "clusters", "cluster")
        contexts = _named(config, "contexts", "context")
        users = _named(config, "users", "user") if "users" in config else {}
    except _NotAKubeconfig as exc:
        return str(exc)
    current = config.get("current-context")
    if not current:
        return "no current-context"
    if current not in contexts:
        return f"current-context {current!r}: no such context"
    context = contexts[current]
    if context.get("cluster") not in clusters:
        return f"context {current!r}: no cluster named {context.get('cluster')!r}"
    if not clusters[context["cluster"]].get("server"):
        return f"cluster {context['cluster']!r}: no server"
    if context.get("user") and context["user"] not in users:
        return f"context {current!r}: no user named {context['user']!r}"
    named = [("cluster", context["cluster"], clusters[context["cluster"]])]
    if context.get("user"):
        named.append(("user", context["user"], users[context["user"]]))
    return _missing_file(path, named)


#: The files a cluster's or user's entry may name, which the client reads as it is made.
_FILES = ("certificate-authority", "client-certificate", "client-key")


def _missing_file(kubeconfig: Path, named: list[tuple[str, str, dict[Any, Any]]]) -> str | None:
    """The first file the entries ``named`` (kind, name, entry) name that is not there (a
    relative path is the kubeconfig's directory's, as the client and kubectl read it)."""
    for kind, name, entry in named:
        for key in _FILES:
            value = entry.get(key)
            if isinstance(value, str) and value:
                file = kubeconfig.parent / Path(value).expanduser()
                if not file.is_file():
                    return f"{kind} {name!r}: {key} {file}: no such file"
    return None


class _NotAKubeconfig(Exception):
    """A kubeconfig's list not of the shape the client reads."""


def _named(config: dict[Any, Any], key: str, inner: str) -> dict[str, dict[Any, Any]]:
    """The kubeconfig's list ``key`` by name: each entry's ``inner`` mapping (raises
    :class:`_NotAKubeconfig`, saying which entry is not of that shape)."""
    entries = config.get(key)
    if not isinstance(entries, list):
        raise _NotAKubeconfig(f"{key}: not a list")
    found: dict[str, dict[Any, Any]] = {}
    for n, entry in enumerate(entries):
        if not isinstance(entry, dict) or not isinstance(entry.get(inner), dict):
            raise _NotAKubeconfig(f"{key}[{n}]: no {inner} mapping")
        found[str(entry.get("name"))] = entry[inner]
    return found
