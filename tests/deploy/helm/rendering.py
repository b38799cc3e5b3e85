"""The Helm chart rendered offline (helm-python-sdk: Helm v4 as a shared library), and the agent
run on what a rendered DaemonSet hands it.

``render`` is ``helm template`` (or the rendering step of ``helm install``): the values are checked
against values.schema.json, the templates rendered, no cluster contacted (``lookup`` finds
nothing). ``check_config`` runs ``gpuagent --check-config`` with a rendered container's
arguments and environment, its ConfigMaps and Secrets written where its mounts put them, and
returns the effective settings the agent prints.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from deploy.kustomize import ROOT, image_env, module

CHART = ROOT / "deploy" / "helm" / "gpuagent"
DATA = Path(__file__).resolve().parent / "data"
RELEASE = "gpuagent"
NAMESPACE = "kube-system"

Doc = dict[str, Any]


def helm() -> Any:
    """The helm_python module: required under CI, skipped otherwise."""
    return module("helm_python")


def data(name: str) -> Doc:
    """A values file of tests/deploy/helm/data."""
    loaded = yaml.safe_load((DATA / name).read_text(encoding="utf-8"))
    assert isinstance(loaded, dict)
    return loaded


@functools.cache
def _render(values: str, release: str, namespace: str) -> tuple[Doc, ...]:
    with helm().Chart.load(CHART) as chart:
        rendered = chart.render(
            json.loads(values), name=release, namespace=namespace, is_install=True
        )
    docs = [
        doc
        for path, text in sorted(rendered.items())
        if path.endswith((".yaml", ".yml"))
        for doc in yaml.safe_load_all(text)
        if doc is not None
    ]
    return tuple(docs)


def render(
    values: Mapping[str, Any] | None = None,
    *,
    release: str = RELEASE,
    namespace: str = NAMESPACE,
) -> list[Doc]:
    """The objects the chart renders with ``values`` (a fresh copy each call)."""
    return copy.deepcopy(list(_render(json.dumps(values or {}), release, namespace)))


def render_error(values: Mapping[str, Any]) -> str:
    """The message with which the chart refuses ``values`` (fails if it renders)."""
    h = helm()
    try:
        render(values)
    except h.HelmError as error:
        return str(error)
    raise AssertionError(f"the chart rendered {values}")


def of_kind(docs: list[Doc], kind: str) -> list[Doc]:
    return [doc for doc in docs if doc["kind"] == kind]


def named(docs: list[Doc], kind: str, name: str) -> Doc:
    (found,) = [d for d in of_kind(docs, kind) if d["metadata"]["name"] == name]
    return found


def agent_container(ds: Doc) -> Doc:
    (ctr,) = [c for c in ds["spec"]["template"]["spec"]["containers"] if c["name"] == "gpuagent"]
    return dict(ctr)


def container_env(ctr: Doc) -> dict[str, str]:
    """The container's environment, field references resolved as on a node named test-node."""
    fields = {"spec.nodeName": "test-node"}
    env: dict[str, str] = {}
    for item in ctr.get("env", []):
        if "value" in item:
            env[item["name"]] = str(item["value"])
        else:
            env[item["name"]] = fields[item["valueFrom"]["fieldRef"]["fieldPath"]]
    return env


def _volume_files(docs: list[Doc], volume: Doc, secrets: Mapping[str, Mapping[str, str]]) -> Doc:
    """The files a configMap, secret or projected volume shows, by name."""

    def source(kind: str, spec: Doc) -> dict[str, str]:
        name = spec["name"]
        if kind == "secret" and name in secrets:
            content = dict(secrets[name])
        elif kind == "secret":
            content = dict(named(docs, "Secret", name).get("stringData", {}))
        else:
            content = dict(named(docs, "ConfigMap", name)["data"])
        items = spec.get("items")
        return {i["path"]: content[i["key"]] for i in items} if items else content

    if "configMap" in volume:
        return source("configMap", volume["configMap"])
    if "secret" in volume:
        return source("secret", {"name": volume["secret"]["secretName"], **volume["secret"]})
    files: dict[str, str] = {}
    for item in volume["projected"]["sources"]:
        (kind,) = item
        files |= source(kind, item[kind])
    return files


def _relocated(value: Any, moves: Mapping[str, Path]) -> Any:
    """A path under a mount moved to where the test wrote that mount's files."""
    if isinstance(value, str):
        for mount, where in moves.items():
            if value == mount or value.startswith(mount + "/"):
                return str(where) + value[len(mount) :]
    return value


def _relocated_arg(arg: str, moves: Mapping[str, Path]) -> str:
    flag, equals, value = arg.partition("=")
    return f"{flag}={_relocated(value, moves)}" if equals else arg


def check_config(
    docs: list[Doc],
    tmp: Path,
    *,
    daemonset: str = RELEASE,
    secrets: Mapping[str, Mapping[str, str]] | None = None,
) -> Doc:
    """``gpuagent --check-config`` on what the DaemonSet hands the agent: its arguments, its
    environment (the image's, then the container's), and its ConfigMap and Secret mounts written
    under ``tmp`` (paths into them moved there; ``secrets``: Secrets the chart does not render).
    Returns the effective settings; fails with the agent's error if it refuses them."""
    ds = named(docs, "DaemonSet", daemonset)
    pod, ctr = ds["spec"]["template"]["spec"], agent_container(ds)
    volumes = {v["name"]: v for v in pod["volumes"]}
    moves: dict[str, Path] = {}
    for mount in ctr["volumeMounts"]:
        volume = volumes[mount["name"]]
        if "hostPath" in volume:
            continue
        where = tmp / mount["name"]
        where.mkdir(parents=True, exist_ok=True)
        for name, text in _volume_files(docs, volume, secrets or {}).items():
            (where / name).write_text(text, encoding="utf-8")
        moves[mount["mountPath"]] = where
    args = [_relocated_arg(arg, moves) for arg in ctr.get("args", [])]
    config = Path(next(a for a in args if a.startswith("--config=")).partition("=")[2])
    content = yaml.safe_load(config.read_text(encoding="utf-8"))
    config.write_text(yaml.safe_dump({k: _relocated(v, moves) for k, v in content.items()}))
    env = {k: str(_relocated(v, moves)) for k, v in container_env(ctr).items()}
    env = {**image_env(), **env, "PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    result = subprocess.run(
        [sys.executable, "-m", "gpuagent", *args, f"--check-config={config}"],
        capture_output=True, text=True, timeout=60, check=False, env=env,
    )  # fmt: skip
    assert result.returncode == 0, f"{daemonset}: the agent refuses its settings:\n{result.stderr}"
    settings = json.loads(result.stdout)
    assert isinstance(settings, dict)
    return settings
