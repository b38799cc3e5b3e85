"""The kustomize overlays as the deployment tests see them: the tools they run, each build's
objects, their validation against the Kubernetes and Prometheus Operator schemas, and the
overlays' table (names, components, what each adds).

External tools (kubectl, hadolint, yamllint, systemd-analyze, promtool) are required when ``CI``
is set and skip the tests that need them otherwise.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml
from support.required import unavailable

from gpuagent.config import load_settings

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = ROOT / "manifests"
KUSTOMIZATIONS = {
    "base": MANIFESTS / "base",
    **{
        path.parent.name: path.parent
        for path in sorted((MANIFESTS / "overlays").glob("*/kustomization.yaml"))
    },
}
EXPECTED_OVERLAYS = {
    "base", "time-slicing", "mig-mixed", "cdi", "prometheus-operator", "dra", "accounting", "mps",
}  # fmt: skip
# Kustomize Components, added to any overlay with `components:`.
COMPONENTS = {
    path.parent.name: path.parent
    for path in sorted((MANIFESTS / "components").glob("*/kustomization.yaml"))
}
# Every overlay with the accounting component added, as an operator's kustomization would
# (built as "<overlay>+accounting"; the accounting overlay is the base with it).
COMBINED = (
    *(f"{name}+accounting" for name in sorted(KUSTOMIZATIONS)
      if name not in ("base", "accounting")),
    "base+taint-unhealthy-node",
    "dra+taint-unhealthy-node",
    "dra+dra-mig-dynamic",
    "dra+dra-shares",
)  # fmt: skip
ALL_BUILDS = (*sorted(KUSTOMIZATIONS), *COMBINED)
# Kubernetes versions whose schemas every manifest must pass: the oldest with CDI devices on by
# default in the device-plugin API (1.29) and the newest kubernetes-validate bundles.
K8S_VERSIONS = ("1.29.0", "latest")
# APIs newer than that: validated from the first version that serves them (DRA's resource.k8s.io/v1
# is served by default since 1.34; ValidatingAdmissionPolicy is v1 since 1.30).
FIRST_VERSION = {"resource.k8s.io/v1": "1.34.0", "admissionregistration.k8s.io/v1": "1.30.0"}
CLUSTER_SCOPED = {
    "ClusterRole", "ClusterRoleBinding", "DeviceClass",
    "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding",
}  # fmt: skip
# Overlays whose pod needs a service-account token: every one (the node condition and events; the
# DRA side too).
API_CLIENTS = EXPECTED_OVERLAYS
# Builds allowed to add a capability, and which: seeing every MIG device takes the driver's
# mig/monitor capability, which the NVIDIA runtime grants only to a CAP_SYS_ADMIN container, and
# making MIG devices (the dra-mig-dynamic component) takes CAP_SYS_ADMIN itself.
ADDED_CAPABILITIES = {
    "mig-mixed": {"SYS_ADMIN"},
    "dra+dra-mig-dynamic": {"SYS_ADMIN"},
    "dra+dra-shares": {"SYS_ADMIN"},
    "mps": {"SYS_ADMIN"},
}
# Host directories the DaemonSet must mount writable for features that have no agent option yet
# (the CDI directory only where a cdi-* device-list strategy writes a spec there).
EXTRA_HOST_DIRS = {
    "/var/run/cdi": "CDI specs (cdi-* device-list strategies)",
    "/etc/kubernetes/node-feature-discovery/features.d": "node-feature-discovery feature files",
}
CDI_HOST_DIR = "/var/run/cdi"
# Agent settings that are paths but not host paths the DaemonSet must provide.
NOT_HOST_PATHS = {
    "nvidia_driver_root",  # "/" inside the container: the NVIDIA runtime injects the driver there
    "driver_root_ctr_path",  # a path inside the container (where the driver root is mounted)
    "machine_type_file",  # /sys/class/dmi: a container sees the host's sysfs (not namespaced)
    "config_file",
    "sim_config",
    "web_config_file",
    "proc_root",  # the container's own /proc: with hostPID it shows the host's processes
    "cri_socket",  # optional: no runtime socket is mounted (docs/install.md says why)
}
# Host paths the agent uses only with DRA on (--dra-gpus): the kubelet's plugin directories.
DRA_HOST_PATHS = {"plugins_dir", "plugins_registry_dir"}
# Host paths the agent uses only with per-container accounting on (--container-accounting).
ACCOUNTING_HOST_PATHS = {"container_logs_dir"}
# The MPS root, used with MPS sharing only; its shm is the container's /dev/shm (the one mount
# whose path differs on purpose: the MPS server and its clients share memory there).
MPS_HOST_PATHS = {"mps_root"}
# Host paths the agent uses only with a cdi-* device-list strategy.
CDI_HOST_PATHS = {"cdi_spec_dir"}
T = 15.0


# ----- tools --------------------------------------------------------------------------------------


def tool(name: str) -> str:
    """The path of an external tool: the virtual environment's first (pinned in the test extra),
    then PATH. Missing: fails under CI, skips otherwise."""
    local = Path(sys.executable).parent / name
    if local.is_file() and os.access(local, os.X_OK):
        return str(local)
    found = shutil.which(name)
    if not found:
        unavailable(f"{name} not found (the test extra of pyproject.toml or .ci/run installs it)")
    return found


def module(name: str) -> Any:
    """Import an optional validation library: required under CI, skipped otherwise."""
    try:
        return __import__(name, fromlist=["_"])
    except ImportError:
        unavailable(f"python module {name} not installed (pip install -e '.[test]')")


def run(*cmd: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=120, check=False)


# ----- building the overlays ----------------------------------------------------------------------


def kustomize(name: str) -> subprocess.CompletedProcess[str]:
    """``kubectl kustomize`` of an overlay, or (``overlay+component``) of an operator's
    kustomization: the overlay plus the component (kustomize wants both as relative paths)."""
    kubectl = tool("kubectl")
    overlay, _, component = name.partition("+")
    if not component:
        return run(kubectl, "kustomize", str(KUSTOMIZATIONS[name]))
    with tempfile.TemporaryDirectory() as tmp:
        where = Path(tmp)
        (where / "kustomization.yaml").write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "kustomize.config.k8s.io/v1beta1",
                    "kind": "Kustomization",
                    "resources": [os.path.relpath(KUSTOMIZATIONS[overlay], where)],
                    "components": [os.path.relpath(COMPONENTS[component], where)],
                }
            ),
            encoding="utf-8",
        )
        return run(kubectl, "kustomize", str(where))


@functools.cache
def _build(name: str) -> tuple[dict[str, Any], ...]:
    result = kustomize(name)
    assert result.returncode == 0, f"kubectl kustomize {name} failed:\n{result.stderr}"
    docs = [doc for doc in yaml.safe_load_all(result.stdout) if doc is not None]
    assert docs, f"{name} built nothing"
    return tuple(docs)


def build(name: str) -> list[dict[str, Any]]:
    """The objects ``kubectl kustomize`` builds for an overlay (a fresh copy each call)."""
    return copy.deepcopy(list(_build(name)))


def only(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [doc for doc in docs if doc["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return daemonset(docs)[2]


def daemonset(docs: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The build's DaemonSet, its pod spec and the agent's container."""
    ds = only(docs, "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    (ctr,) = [c for c in pod["containers"] if c["name"] == "gpuagent"]
    return ds, pod, dict(ctr)


def config_text(docs: list[dict[str, Any]]) -> str:
    """The agent's config file as the DaemonSet mounts it (``--config`` in a configMap mount)."""
    _, pod, ctr = daemonset(docs)
    (config_arg,) = [a for a in ctr.get("args", []) if a.startswith("--config=")]
    path = Path(config_arg.partition("=")[2])
    (mount,) = [m for m in ctr["volumeMounts"] if path.parent == Path(m["mountPath"])]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    cm_name = volume["configMap"]["name"]
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == cm_name]
    return str(cm["data"][path.name])


def manifest_env(ctr: dict[str, Any]) -> dict[str, str]:
    """The container's environment from the manifest, field references resolved for a test node."""
    fields = {"spec.nodeName": "test-node", "metadata.name": "gpuagent-test"}
    env: dict[str, str] = {}
    for item in ctr.get("env", []):
        if "value" in item:
            env[item["name"]] = str(item["value"])
        else:
            path = item["valueFrom"]["fieldRef"]["fieldPath"]
            assert path in fields, f"env {item['name']}: no test value for fieldRef {path}"
            env[item["name"]] = fields[path]
    return env


def image_env() -> dict[str, str]:
    """The ENV of the Containerfile's final stage (what the image adds to every container)."""
    text = (ROOT / "Containerfile").read_text(encoding="utf-8").replace("\\\n", " ")
    final = text.rsplit("\nFROM ", 1)[1]
    env: dict[str, str] = {}
    for line in final.splitlines():
        if line.startswith("ENV "):
            for name, value in re.findall(r"(\w+)=(\S+)", line[4:]):
                env[name] = value
    return env


def effective_settings(docs: list[dict[str, Any]], tmp: Path) -> Any:
    """The agent's settings as the DaemonSet's command line, env and config file resolve them."""
    config = tmp / "config.yaml"
    config.write_text(config_text(docs), encoding="utf-8")
    args = [
        f"--config={config}" if a.startswith("--config=") else a
        for a in container(docs).get("args", [])
    ]
    return load_settings(args, {**image_env(), **manifest_env(container(docs))})


def overlay_of(name: str) -> str:
    """The overlay of a build (``cdi+accounting`` → ``cdi``)."""
    return name.partition("+")[0]


# ----- schemas ------------------------------------------------------------------------------------


def _validate_core(doc: dict[str, Any]) -> None:
    kv = module("kubernetes_validate")
    first = FIRST_VERSION.get(doc["apiVersion"])
    for version in (first, "latest") if first else K8S_VERSIONS:
        wanted = kv.latest_version() if version == "latest" else version
        kv.validate(doc, wanted, strict=True)


MONITORING_SCHEMAS = Path(__file__).parent / "schemas" / "monitoring.coreos.com-v1.json"


@functools.cache
def _monitoring_validators() -> dict[str, Any]:
    jsonschema = module("jsonschema")
    kinds = json.loads(MONITORING_SCHEMAS.read_text(encoding="utf-8"))["kinds"]
    return {kind: jsonschema.Draft202012Validator(schema) for kind, schema in kinds.items()}


def _validate_monitoring(doc: dict[str, Any]) -> None:
    """Prometheus Operator kinds against the CRDs' schemas (tests/deploy/schemas, made strict by
    scripts/gen_crd_schemas.py: an unknown field fails, as ``kubectl apply`` would refuse it)."""
    assert doc["apiVersion"] == "monitoring.coreos.com/v1", doc["apiVersion"]
    validator = _monitoring_validators()[doc["kind"]]
    errors = [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(doc)]
    assert not errors, f"{doc['kind']} fails the CRD schema:\n" + "\n".join(errors)


def validate(doc: dict[str, Any]) -> None:
    if doc["apiVersion"].startswith("monitoring.coreos.com/"):
        _validate_monitoring(doc)
    else:
        _validate_core(doc)
