"""What a platform team installs: kustomize overlays, the image recipe, the systemd unit.

Every overlay is built with ``kubectl kustomize`` and validated offline against the Kubernetes
schemas (kubernetes-validate, strict: unknown fields fail) and, for the Prometheus Operator kinds,
against the operator's CRD schemas (tests/deploy/schemas). Rules the API server enforces beyond the
schemas, the agent's own config schema, and the paths the agent uses by default are checked here
too. Finally the agent is started exactly as the DaemonSet starts it and the probes the manifest
points at are asked.

External tools (kubectl, hadolint, yamllint, systemd-analyze, promtool) are required when ``CI``
is set and skip the tests that need them otherwise.
"""

from __future__ import annotations

import copy
import functools
import importlib
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import tomllib
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.fake_kubelet import FakeKubelet
from support.grpcstubs import StubModules
from support.nodes import gpu, node
from support.required import unavailable

from gpuagent.config import ConfigError, load_settings
from gpuagent.config.planning import make_plan
from gpuagent.domain.mpsplan import mps_daemons
from gpuagent.domain.resources import build_resources
from gpuagent.runtime.cri import DEFAULT_SOCKETS

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


# ----- the overlays exist and build ---------------------------------------------------------------


def overlay_of(name: str) -> str:
    """The overlay of a build (``cdi+accounting`` → ``cdi``)."""
    return name.partition("+")[0]


def test_every_overlay_is_there() -> None:
    assert set(KUSTOMIZATIONS) >= EXPECTED_OVERLAYS
    assert set(COMPONENTS) == {"accounting", "taint-unhealthy-node", "dra-mig-dynamic"}


@pytest.mark.parametrize("name", ALL_BUILDS)
def test_overlay_builds_with_kubectl_kustomize(name: str) -> None:
    kinds = sorted(doc["kind"] for doc in build(name))
    assert {"DaemonSet", "ServiceAccount", "Service", "ConfigMap"} <= set(kinds)
    for doc in build(name):
        namespace = None if doc["kind"] in CLUSTER_SCOPED else "kube-system"
        assert doc["metadata"].get("namespace") == namespace, doc["metadata"]
        assert doc["metadata"]["labels"]["app.kubernetes.io/name"] == "gpuagent"
    if overlay_of(name) == "prometheus-operator":
        assert {"ServiceMonitor", "PrometheusRule"} <= set(kinds)


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


@pytest.mark.parametrize("name", ALL_BUILDS)
def test_overlay_passes_kubernetes_schemas(name: str) -> None:
    for doc in build(name):
        validate(doc)


def test_the_validators_reject_unknown_and_mistyped_fields() -> None:
    """The schema checks are real, strict and offline: a typo'd field or a wrong type fails."""
    kv = module("kubernetes_validate")
    docs = build("prometheus-operator")
    ds = only(docs, "DaemonSet")
    ds["spec"]["template"]["spec"]["containers"][0]["readOnlyRootFileSystem"] = True
    with pytest.raises(kv.ValidationError):
        validate(ds)
    service = only(docs, "Service")
    service["spec"]["ports"][0]["port"] = "9400"
    with pytest.raises(kv.ValidationError):
        validate(service)
    monitor = only(docs, "ServiceMonitor")
    monitor["spec"]["endpoints"][0]["intervall"] = "15s"
    with pytest.raises(AssertionError, match="'intervall' was unexpected"):
        validate(monitor)


@pytest.mark.parametrize("name", ALL_BUILDS)
def test_references_inside_the_build_resolve(name: str) -> None:
    """What the API server or the controllers would only find out at run time."""
    docs = build(name)
    ds, pod, ctr = daemonset(docs)
    labels = ds["spec"]["template"]["metadata"]["labels"]
    assert ds["spec"]["selector"]["matchLabels"].items() <= labels.items()
    # Volumes, ConfigMaps, the ServiceAccount.
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert {m["name"] for m in ctr["volumeMounts"]} <= set(volumes)
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    for volume in volumes.values():
        if "configMap" in volume:
            assert ("ConfigMap", volume["configMap"]["name"]) in names
    assert ("ServiceAccount", pod["serviceAccountName"]) in names
    # Probes and the Service point at a named container port.
    ports = {p["name"]: p["containerPort"] for p in ctr["ports"]}
    for probe in ("livenessProbe", "readinessProbe"):
        assert ctr[probe]["httpGet"]["port"] in ports
    service = only(docs, "Service")
    assert service["spec"]["selector"].items() <= labels.items()
    for port in service["spec"]["ports"]:
        assert port["targetPort"] in ports
    # The ServiceMonitor finds the Service and its port.
    for monitor in (d for d in docs if d["kind"] == "ServiceMonitor"):
        assert monitor["spec"]["selector"]["matchLabels"].items() <= (
            service["metadata"]["labels"].items()
        )
        service_ports = {p["name"] for p in service["spec"]["ports"]}
        assert {e["port"] for e in monitor["spec"]["endpoints"]} <= service_ports
        assert monitor["metadata"]["namespace"] == service["metadata"]["namespace"]
    # API server rule (not in the schema): no escalation forbidden together with CAP_SYS_ADMIN.
    sc = ctr["securityContext"]
    if sc.get("allowPrivilegeEscalation") is False:
        assert "SYS_ADMIN" not in sc["capabilities"].get("add", [])
        assert not sc.get("privileged")


# ----- what each build grants ---------------------------------------------------------------------

HostPath = tuple[str, str, bool]  # (host path, where the container sees it, read-only)
Rule = tuple[str, str, str]  # (API group, resource, verb), or ("", "<non-resource URL>", verb)


@dataclass(frozen=True)
class Grants:
    """What a build grants the agent: on the node (namespaces, privileges, host paths and ports,
    its uid) and in the cluster (a service-account token, RBAC)."""

    host_namespaces: frozenset[str] = frozenset()  # of "pid", "network", "ipc"
    privileged: bool = False
    escalation: bool = False  # allowPrivilegeEscalation not false
    capabilities: frozenset[str] = frozenset()  # added (every one is dropped first)
    host_paths: frozenset[HostPath] = frozenset()
    host_ports: frozenset[int] = frozenset()
    run_as_users: frozenset[int | None] = frozenset({0})
    volume_kinds: frozenset[str] = frozenset({"configMap", "hostPath"})
    token: bool = False
    rbac: frozenset[Rule] = frozenset()

    def plus(self, other: Grants) -> Grants:
        """Both grants (``other``'s flags and sets added to this one's)."""
        return Grants(
            self.host_namespaces | other.host_namespaces,
            self.privileged or other.privileged,
            self.escalation or other.escalation,
            self.capabilities | other.capabilities,
            self.host_paths | other.host_paths,
            self.host_ports | other.host_ports,
            self.run_as_users,
            self.volume_kinds | other.volume_kinds,
            self.token or other.token,
            self.rbac | other.rbac,
        )


def _same(path: str, read_only: bool) -> HostPath:
    return (path, path, read_only)


BASE_GRANTS = Grants(
    # The node condition GPUHealthy and GPU health events (admission-policy.yaml narrows each to
    # the agent's own node; docs/install.md says what the token can do).
    token=True,
    rbac=frozenset(
        {
            ("", "nodes", "get"),
            ("", "nodes/status", "patch"),
            ("events.k8s.io", "events", "create"),
            ("events.k8s.io", "events", "patch"),
            ("", "events", "create"),
            ("", "events", "patch"),
        }
    ),
    host_paths=frozenset(
        {
            # The plugin socket is created here, beside the kubelet's kubelet.sock.
            _same("/var/lib/kubelet/device-plugins", False),
            # The kubelet's pod-resources socket (connecting needs no write access).
            _same("/var/lib/kubelet/pod-resources", True),
            # node-feature-discovery's feature file (GPU feature discovery's labels).
            _same("/etc/kubernetes/node-feature-discovery/features.d", False),
        }
    ),
)
# What each overlay adds to the base.
OVERLAY_GRANTS = {
    "base": Grants(),
    "time-slicing": Grants(),
    "prometheus-operator": Grants(),
    "mig-mixed": Grants(capabilities=frozenset({"SYS_ADMIN"}), escalation=True),
    # The MPS root (its pipe directories are mounted into the containers) and its shared memory
    # at /dev/shm; CAP_SYS_ADMIN for the GPUs' compute mode.
    "mps": Grants(
        capabilities=frozenset({"SYS_ADMIN"}),
        escalation=True,
        host_paths=frozenset(
            {_same("/run/nvidia/mps", False), ("/run/nvidia/mps/shm", "/dev/shm", False)}
        ),
    ),
    "cdi": Grants(
        host_paths=frozenset({_same("/var/run/cdi", False), ("/", "/driver-root", True)})
    ),
    "dra": Grants(
        host_paths=frozenset(
            {
                _same("/var/lib/kubelet/plugins_registry", False),
                _same("/var/lib/kubelet/plugins", False),
            }
        ),
        rbac=frozenset(
            {
                ("resource.k8s.io", "resourceclaims", "get"),
                ("", "nodes", "get"),
                *(
                    ("resource.k8s.io", "resourceslices", verb)
                    for verb in ("get", "list", "create", "update", "delete")
                ),
            }
        ),
    ),
}
# What the accounting component adds: the host's PID namespace and the log links, read-only.
ACCOUNTING_GRANTS = Grants(
    host_namespaces=frozenset({"pid"}),
    host_paths=frozenset({_same("/var/log/containers", True)}),
)
OVERLAY_GRANTS["accounting"] = ACCOUNTING_GRANTS
# What the taint component adds: patch on Nodes (their spec holds the taints), narrowed by its
# admission policy to the one taint of the agent's own node.
TAINT_GRANTS = Grants(rbac=frozenset({("", "nodes", "patch")}))
# What the dynamic-MIG component adds (on the dra overlay): CAP_SYS_ADMIN, which making MIG
# devices takes, and so no refusal of privilege escalation.
MIG_DYNAMIC_GRANTS = Grants(capabilities=frozenset({"SYS_ADMIN"}), escalation=True)
COMPONENT_GRANTS = {
    "accounting": ACCOUNTING_GRANTS,
    "taint-unhealthy-node": TAINT_GRANTS,
    "dra-mig-dynamic": MIG_DYNAMIC_GRANTS,
}


def expected_grants(name: str) -> Grants:
    overlay, _, component = name.partition("+")
    grants = BASE_GRANTS.plus(OVERLAY_GRANTS[overlay])
    return grants.plus(COMPONENT_GRANTS[component]) if component else grants


def grants_of(docs: list[dict[str, Any]]) -> Grants:
    """What the build's DaemonSet and RBAC grant, read from the objects as the API server would."""
    ds = only(docs, "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    pod_sc = pod.get("securityContext", {})
    keys = {"pid": "hostPID", "network": "hostNetwork", "ipc": "hostIPC"}
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    containers = [*pod.get("initContainers", []), *pod["containers"]]
    host_paths: set[HostPath] = set()
    mounted: set[str] = set()
    caps: set[str] = set()
    ports: set[int] = set()
    users: set[int | None] = set()
    privileged = escalation = False
    for ctr in containers:
        sc = ctr.get("securityContext", {})
        privileged |= bool(sc.get("privileged"))
        escalation |= sc.get("allowPrivilegeEscalation") is not False
        assert sc.get("capabilities", {}).get("drop") == ["ALL"], ctr["name"]
        caps |= set(sc.get("capabilities", {}).get("add", []))
        users.add(sc.get("runAsUser", pod_sc.get("runAsUser")))
        ports |= {p["hostPort"] for p in ctr.get("ports", []) if "hostPort" in p}
        for mount in ctr.get("volumeMounts", []):
            mounted.add(mount["name"])
            volume = volumes[mount["name"]]
            if "hostPath" in volume:
                path, read_only = volume["hostPath"]["path"], bool(mount.get("readOnly"))
                host_paths.add((path, mount["mountPath"], read_only))
    # A host path in the pod but in no container is still the pod's: listed as unseen.
    for name, volume in volumes.items():
        if "hostPath" in volume and name not in mounted:
            host_paths.add((volume["hostPath"]["path"], "", True))
    account = pod["serviceAccountName"]
    accounts = [d for d in docs if d["kind"] == "ServiceAccount"]
    (sa,) = [d for d in accounts if d["metadata"]["name"] == account]
    token = pod.get("automountServiceAccountToken", sa.get("automountServiceAccountToken", True))
    namespace = ds["metadata"]["namespace"]
    roles = {(d["kind"], d["metadata"]["name"]): d for d in docs if d["kind"].endswith("Role")}
    rules: set[Rule] = set()
    for binding in (d for d in docs if d["kind"].endswith("RoleBinding")):
        subjects = binding.get("subjects", [])
        if {"kind": "ServiceAccount", "name": account, "namespace": namespace} not in subjects:
            continue
        role = roles[(binding["roleRef"]["kind"], binding["roleRef"]["name"])]
        for rule in role["rules"]:
            for verb in rule["verbs"]:
                rules |= {("", url, verb) for url in rule.get("nonResourceURLs", [])}
                rules |= {
                    (group, resource, verb)
                    for group in rule.get("apiGroups", [])
                    for resource in rule.get("resources", [])
                }
    return Grants(
        host_namespaces=frozenset(ns for ns, key in keys.items() if pod.get(key)),
        privileged=privileged,
        escalation=escalation,
        capabilities=frozenset(caps),
        host_paths=frozenset(host_paths),
        host_ports=frozenset(ports),
        run_as_users=frozenset(users),
        volume_kinds=frozenset(k for v in volumes.values() for k in v if k != "name"),
        token=bool(token),
        rbac=frozenset(rules),
    )


@pytest.mark.parametrize("name", ALL_BUILDS)
def test_each_build_grants_exactly_its_table_row(name: str) -> None:
    """The base grants the device plugin, health, labels and metrics what they need and nothing
    else (no host namespace, no runtime socket, no host /); each overlay and the accounting
    component add exactly their row. A grant that appears, goes or changes fails here."""
    assert grants_of(build(name)) == expected_grants(name)


def test_the_base_grants_no_host_namespace_runtime_socket_or_host_root() -> None:
    grants = grants_of(build("base"))
    assert grants.host_namespaces == frozenset()
    hosts = {host for host, _, _ in grants.host_paths}
    assert "/" not in hosts
    assert not {h for h in hosts if "containerd" in h or "crio" in h or h.endswith(".sock")}
    assert (grants.privileged, grants.escalation) == (False, False)
    # A token, for the node condition and events only: no read of secrets, pods or anything
    # else; writes to the Node's status and events, pinned to the own node by admission policy.
    assert grants.token
    assert {resource for _, resource, _ in grants.rbac} == {"nodes", "nodes/status", "events"}
    assert {(r, verb) for _, r, verb in grants.rbac if r.startswith("nodes")} == {
        ("nodes", "get"), ("nodes/status", "patch"),
    }  # fmt: skip


@pytest.mark.parametrize(
    ("change", "seen"),
    [
        (lambda pod, ctr: pod.update(hostNetwork=True), "host_namespaces"),
        (lambda pod, ctr: pod.update(hostIPC=True), "host_namespaces"),
        (lambda pod, ctr: ctr["securityContext"]["capabilities"].update(add=["NET_ADMIN"]),
         "capabilities"),
        (lambda pod, ctr: ctr["securityContext"].update(privileged=True), "privileged"),
        (lambda pod, ctr: ctr["securityContext"].update(allowPrivilegeEscalation=True),
         "escalation"),
        (lambda pod, ctr: ctr["volumeMounts"][-1].update(readOnly=True), "host_paths"),
        (lambda pod, ctr: pod["volumes"].append(
            {"name": "x", "hostPath": {"path": "/run/containerd"}}), "host_paths"),
        (lambda pod, ctr: ctr["ports"][0].update(hostPort=9400), "host_ports"),
        (lambda pod, ctr: ctr["securityContext"].update(runAsUser=1000), "run_as_users"),
        (lambda pod, ctr: pod.update(automountServiceAccountToken=False), "token"),
        (lambda pod, ctr: pod["volumes"].append({"name": "t", "projected": {"sources": []}}),
         "volume_kinds"),
    ],
)  # fmt: skip
def test_the_grants_table_sees_a_changed_grant(change: Any, seen: str) -> None:
    docs = build("base")
    _, pod, _ = daemonset(docs)
    (ctr,) = pod["containers"]
    change(pod, ctr)
    found, expected = grants_of(docs), expected_grants("base")
    assert getattr(found, seen) != getattr(expected, seen)


def test_the_grants_table_sees_a_changed_rbac_rule() -> None:
    docs = build("dra")
    (role,) = [
        d for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"] == "gpuagent-dra"
    ]
    role["rules"][0]["verbs"].append("list")
    assert grants_of(docs).rbac - expected_grants("dra").rbac == {
        ("resource.k8s.io", "resourceclaims", "list")
    }


# ----- what the DaemonSet promises ----------------------------------------------------------------


@pytest.mark.parametrize("name", ALL_BUILDS)
def test_daemonset_runs_as_a_node_critical_least_privileged_plugin(name: str) -> None:
    docs = build(name)
    ds, pod, ctr = daemonset(docs)
    assert pod["priorityClassName"] == "system-node-critical"
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in (
        pod["tolerations"]
    )
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    keys = {e["key"] for t in terms["nodeSelectorTerms"] for e in t["matchExpressions"]}
    assert keys == {"feature.node.kubernetes.io/pci-10de.present", "nvidia.com/gpu.present"}
    assert pod["automountServiceAccountToken"] is (overlay_of(name) in API_CLIENTS)
    assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"

    sc = ctr["securityContext"]
    assert sc["capabilities"]["drop"] == ["ALL"]
    added = ADDED_CAPABILITIES.get(name, ADDED_CAPABILITIES.get(overlay_of(name), set()))
    assert set(sc["capabilities"].get("add", [])) == added
    if not added:
        assert sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc.get("privileged", False) is False

    resources = ctr["resources"]
    assert {"cpu", "memory"} <= set(resources["requests"])
    assert "memory" in resources["limits"]
    assert "cpu" not in resources["limits"], "a CPU limit throttles start-up (docs/install.md)"

    assert ctr["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert ctr["readinessProbe"]["httpGet"]["path"] == "/readyz"

    update = ds["spec"]["updateStrategy"]
    assert update["type"] == "RollingUpdate"
    # One node at a time, never two agents on one node (they would take the socket from each
    # other); the agent stops in about 2 s, well within the grace period.
    assert update["rollingUpdate"] == {"maxUnavailable": 1, "maxSurge": 0}
    assert 2 < pod["terminationGracePeriodSeconds"] <= 30


@pytest.mark.parametrize("name", ALL_BUILDS)
def test_mounts_match_the_paths_the_agent_uses(name: str, tmp_path: Path) -> None:
    """Every host path the agent uses — its defaults, and what the manifest's own command line,
    env and config file resolve to — is a hostPath mounted at the same path in the container,
    for the features the build turns on (DRA, CDI, per-container accounting) and no others."""
    docs = build(name)
    _, pod, ctr = daemonset(docs)
    host = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    mounted: dict[Path, bool] = {}
    for mount in ctr["volumeMounts"]:
        if mount["name"] == "driver-root":
            continue  # the host's driver root, read at driver-root-ctr-path (its own test)
        if mount["name"] == "mps-shm":
            continue  # the MPS root's shm at /dev/shm (test_mps_overlay_shares_through_…)
        if mount["name"] in host:
            assert mount["mountPath"] == host[mount["name"]], "host paths keep their path"
            mounted[Path(mount["mountPath"])] = not mount.get("readOnly", False)

    def covering(path: Path) -> Path | None:
        return next((m for m in mounted if path == m or m in path.parents), None)

    effective = effective_settings(docs, tmp_path)
    cdi = any(s.startswith("cdi-") for s in effective.device_list_strategy)
    unused = (
        (DRA_HOST_PATHS if effective.dra_gpus == "none" else set())
        | (set() if effective.container_accounting else ACCOUNTING_HOST_PATHS)
        | (set() if cdi else CDI_HOST_PATHS)
        | (set() if effective.sharing.mps.enabled else MPS_HOST_PATHS)
    )
    for settings in (load_settings([], {}), effective):
        for field, value in settings.as_dict().items():
            if field in NOT_HOST_PATHS or field in unused:
                continue
            if not isinstance(getattr(settings, field), Path):
                continue
            assert covering(Path(str(value))) is not None, f"{field}={value} is not mounted"
        # The plugin socket is created in socket-dir: that mount must be writable. The
        # pod-resources socket is only connected to: the directory (not the file) is mounted,
        # so a restarted kubelet's new socket is seen.
        assert mounted[settings.socket_dir] is True
        assert settings.kubelet_socket.parent == settings.socket_dir
        assert settings.pod_resources_socket.parent in mounted
    # Per-container accounting: NVML lists only the processes of the agent's PID namespace, so
    # it is on exactly where the pod shares the host's; the log links are only read.
    assert effective.container_accounting is bool(pod.get("hostPID"))
    assert effective.proc_root == Path("/proc")
    if effective.container_accounting:
        assert mounted[effective.container_logs_dir] is False
    # No container-runtime socket in any build: the CRI is an option, not a default.
    for cri_socket in DEFAULT_SOCKETS:
        assert covering(cri_socket) is None, f"{cri_socket.parent} is mounted"
    for path, what in EXTRA_HOST_DIRS.items():
        if path == CDI_HOST_DIR and not cdi:
            assert covering(Path(path)) is None, f"{path} ({what}) is mounted but unused"
            continue
        assert mounted.get(Path(path)) is True, f"{path} ({what}) must be mounted writable"
    # The probes' port is the port the agent listens on.
    (port,) = [p["containerPort"] for p in ctr["ports"] if p["name"] == "metrics"]
    assert effective.metrics_port == port
    assert effective.metrics_host == ""


@pytest.mark.parametrize(
    ("module_name", "constant", "host_dir"),
    [
        ("gpuagent.nodefiles.cdi", "DEFAULT_CDI_DIR", "/var/run/cdi"),
        (
            "gpuagent.nodefiles.labels",
            "DEFAULT_FEATURES_FILE",
            "/etc/kubernetes/node-feature-discovery/features.d",
        ),
    ],
)
def test_extra_host_dirs_are_the_agents_defaults(
    module_name: str, constant: str, host_dir: str
) -> None:
    """The CDI and NFD directories the DaemonSet mounts are where the agent writes by default."""
    assert host_dir in EXTRA_HOST_DIRS
    if importlib.util.find_spec(module_name) is None:
        pytest.skip(f"{module_name} is not in this version of the agent")
    default = Path(getattr(importlib.import_module(module_name), constant))
    assert host_dir in (str(default), str(default.parent)), f"{module_name}.{constant}={default}"


@pytest.mark.parametrize("name", ALL_BUILDS)
def test_overlay_config_is_valid_for_the_agent(name: str, tmp_path: Path) -> None:
    """Key names and values pass the agent's config schema and its checks beyond the syntax."""
    docs = build(name)
    settings = effective_settings(docs, tmp_path)
    assert settings.config_file is not None
    refused: ConfigError | None = None
    try:
        make_plan(settings)
    except ConfigError as exc:
        refused = exc
    assert refused is None, f"{name} does not run: {refused}"


def test_overlays_set_their_mode() -> None:
    def config(name: str) -> dict[str, Any]:
        loaded = yaml.safe_load(config_text(build(name)))
        assert isinstance(loaded, dict)
        return loaded

    assert config("base")["mig-strategy"] == "none"
    assert config("mig-mixed")["mig-strategy"] == "mixed"
    assert config("cdi")["device-list-strategy"] in ("cdi-cri", "cdi-annotations")
    env = manifest_env(container(build("mig-mixed")))
    assert env["NVIDIA_MIG_MONITOR_DEVICES"] == "all"
    sharing = config("time-slicing")["sharing"]["timeSlicing"]
    assert sharing["resources"] == [{"name": "nvidia.com/gpu", "replicas": 4}]
    cdi = config("cdi")
    assert (cdi["nvidia-driver-root"], cdi["driver-root-ctr-path"]) == ("/", "/driver-root")


def test_time_slicing_overlay_really_slices(tmp_path: Path) -> None:
    """The overlay's config advertises each GPU four times under nvidia.com/gpu."""
    settings = effective_settings(build("time-slicing"), tmp_path)
    resources = build_resources(node(gpu(0), gpu(1)), make_plan(settings).serving.resources)
    (resource,) = resources.resources
    assert resource.name == "nvidia.com/gpu"
    assert len(resource.devices) == 8
    assert {d.id.rsplit("::", 1)[1] for d in resource.devices} == {"0", "1", "2", "3"}


def test_mps_overlay_shares_through_an_mps_daemon(tmp_path: Path) -> None:
    """The overlay's config advertises each GPU four times through one MPS daemon, whose pipe
    directory is under the MPS root the DaemonSet mounts."""
    docs = build("mps")
    settings = effective_settings(docs, tmp_path)
    plan = make_plan(settings)
    resources = build_resources(node(gpu(0), gpu(1)), plan.serving.resources)
    (resource,) = resources.resources
    assert (resource.name, resource.mps, len(resource.devices)) == ("nvidia.com/gpu", True, 8)
    (daemon,) = mps_daemons(resources)
    assert daemon.thread_percentage == 25
    pipe = Path(plan.serving.containers.mps.pipe(daemon.name))
    mounts = {Path(m["mountPath"]) for m in container(docs)["volumeMounts"]}
    assert settings.mps_root in mounts
    _, pod, _ = daemonset(docs)
    (shm,) = [v for v in pod["volumes"] if v["name"] == "mps-shm"]
    (shm_mount,) = [m for m in container(docs)["volumeMounts"] if m["name"] == "mps-shm"]
    assert shm["hostPath"]["path"] == plan.serving.containers.mps.shm
    assert shm_mount["mountPath"] == "/dev/shm"
    assert settings.mps_root in pipe.parents


def test_cdi_overlay_mounts_the_driver_root_where_the_agent_reads_it(tmp_path: Path) -> None:
    docs = build("cdi")
    settings = effective_settings(docs, tmp_path)
    _, pod, _ = daemonset(docs)
    (volume,) = [v for v in pod["volumes"] if v["name"] == "driver-root"]
    (mount,) = [m for m in container(docs)["volumeMounts"] if m["name"] == "driver-root"]
    assert volume["hostPath"]["path"] == str(settings.nvidia_driver_root)
    assert mount["mountPath"] == str(settings.driver_root_ctr_path)
    assert mount["readOnly"] is True


# ----- Prometheus Operator ------------------------------------------------------------------------


def test_prometheus_rule_passes_promtool(tmp_path: Path) -> None:
    rule = only(build("prometheus-operator"), "PrometheusRule")
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}), encoding="utf-8")
    result = run(tool("promtool"), "check", "rules", str(rules))
    assert result.returncode == 0, result.stdout + result.stderr


# ----- YAML, Containerfile, systemd unit ----------------------------------------------------------


def test_yaml_lint() -> None:
    result = run(tool("yamllint"), "--strict", "--format", "parsable", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_containerfile_lint() -> None:
    result = run(tool("hadolint"), "--no-color", "--failure-threshold", "style", "Containerfile")
    assert result.returncode == 0, result.stdout + result.stderr


def test_containerfile_shape() -> None:
    text = (ROOT / "Containerfile").read_text(encoding="utf-8")
    stages = re.findall(r"^FROM (\S+)", text, re.MULTILINE)
    assert len(stages) >= 2, "multi-stage: build tools stay out of the final image"
    # Both stages on one base: the venv's python is a link to the base's interpreter.
    assert set(stages) == {"${BASE}"}
    (default,) = re.findall(r"^ARG BASE=(\S+)$", text, re.MULTILINE)
    assert "slim" in default
    final = text.rsplit("\nFROM ", 1)[1]
    assert "--from=build" in final
    assert not re.search(r"^RUN ", final, re.MULTILINE), "the final stage only copies the venv"
    assert "--no-index" in text, "the build installs from the context's wheels, no index"
    assert 'ENTRYPOINT ["gpuagent"]' in final
    env = image_env()
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert env["NVIDIA_DRIVER_CAPABILITIES"] == "utility"
    user = re.findall(r"^USER (\S+)", final, re.MULTILINE)
    assert user, "the image names its user"
    assert user[-1].split(":")[0] not in ("0", "root")
    for label in ("title", "description", "version", "revision", "source", "licenses"):
        assert f"org.opencontainers.image.{label}=" in final


def _images(docs: list[dict[str, Any]]) -> set[str]:
    """Every container image a build's pod templates name."""
    found = set()
    for doc in docs:
        pod = doc.get("spec", {}).get("template", {}).get("spec", {})
        for key in ("containers", "initContainers", "ephemeralContainers"):
            found |= {c["image"] for c in pod.get(key, [])}
    return found


def test_the_image_is_named_in_one_place() -> None:
    """The base's ``images:`` entry names the image (its tag: the project's version); the
    DaemonSet holds only the placeholder it replaces, and no overlay names another."""
    kustomization = yaml.safe_load((KUSTOMIZATIONS["base"] / "kustomization.yaml").read_text())
    (entry,) = kustomization["images"]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert entry["newTag"] == project["version"]
    reference = f"{entry['newName']}:{entry['newTag']}"
    sources = [p for p in MANIFESTS.rglob("*.yaml") if p.parent != MANIFESTS / "monitoring"]
    placeholders = [
        (path.name, line.split("image:", 1)[1].strip())
        for path in sources
        for line in path.read_text(encoding="utf-8").splitlines()
        if re.match(r"\s*(- )?image:", line)
    ]
    assert placeholders == [("daemonset.yaml", entry["name"])]
    for name, folder in KUSTOMIZATIONS.items():
        assert _images(build(name)) == {reference}, name
        if name != "base":
            text = (folder / "kustomization.yaml").read_text(encoding="utf-8")
            assert "images" not in yaml.safe_load(text), f"{name} names its own image"


def test_an_overlay_points_the_kustomization_at_your_image(tmp_path: Path) -> None:
    """install.md's way to use your own registry: an ``images:`` entry on top of an overlay,
    naming the image by the reference the base gives it."""
    kubectl = tool("kubectl")
    (entry,) = yaml.safe_load((KUSTOMIZATIONS["base"] / "kustomization.yaml").read_text())["images"]
    mine = tmp_path / "my-cluster"
    mine.mkdir()
    overlay = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [os.path.relpath(KUSTOMIZATIONS["prometheus-operator"], mine)],
        "images": [
            {
                "name": entry["newName"],
                "newName": "registry.example.com/gpuagent",
                "newTag": "1.2.3",
            }
        ],
    }
    (mine / "kustomization.yaml").write_text(yaml.safe_dump(overlay), encoding="utf-8")
    result = run(kubectl, "kustomize", str(mine))
    assert result.returncode == 0, result.stderr
    docs = [doc for doc in yaml.safe_load_all(result.stdout) if doc is not None]
    assert _images(docs) == {"registry.example.com/gpuagent:1.2.3"}
    install = (ROOT / "docs" / "install.md").read_text(encoding="utf-8")
    assert f"- name: {entry['newName']}\n" in install, "install.md's example names that reference"


UNIT = ROOT / "deploy" / "systemd" / "gpuagent.service"


def _unit_values(key: str) -> list[str]:
    text = UNIT.read_text(encoding="utf-8")
    return re.findall(rf"^{key}=(.*)$", text, re.MULTILINE)


def test_systemd_unit_verifies(tmp_path: Path) -> None:
    """``systemd-analyze verify`` knows every key; its exposure score stays low."""
    analyze = tool("systemd-analyze")
    unit = tmp_path / "gpuagent.service"
    # verify checks that the executable exists: point it at this environment's gpuagent.
    agent = Path(sys.executable).parent / "gpuagent"
    unit.write_text(
        UNIT.read_text(encoding="utf-8").replace("/usr/local/bin/gpuagent", str(agent)),
        encoding="utf-8",
    )
    result = run(analyze, "verify", str(unit))
    assert result.returncode == 0, result.stderr
    assert not result.stderr.strip(), "systemd-analyze warns about the unit"
    result = run(analyze, "security", "--offline=true", str(unit))
    match = re.search(r"Overall exposure level for \S+: ([\d.]+)", result.stdout)
    assert match, result.stdout + result.stderr
    assert float(match.group(1)) <= 3.0, result.stdout
    # What docs/install.md says it rates (another systemd may weigh a setting a step apart).
    install = " ".join((ROOT / "docs" / "install.md").read_text(encoding="utf-8").split())
    said = re.search(r"`systemd-analyze security` rates the unit at ([\d.]+)", install)
    assert said, "install.md no longer gives the unit's exposure score"
    assert abs(float(said.group(1)) - float(match.group(1))) <= 0.1, result.stdout


def test_systemd_unit_leaves_gpu_processes_visible() -> None:
    """Per-container accounting (on by default) reads ``/proc/<pid>/cgroup`` of other users'
    processes: a hidepid mount (``ProtectProc=`` other than ``default``) would hide them from an
    agent without CAP_SYS_PTRACE, and every process would go unattributed."""
    (exec_start,) = _unit_values("ExecStart")
    args = [
        str(ROOT / "deploy" / "systemd" / "config.yaml") if a == "/etc/gpuagent/config.yaml" else a
        for a in exec_start.split()[1:]
    ]
    assert load_settings(args, {}).container_accounting
    assert _unit_values("ProtectProc") in ([], ["default"])


def test_systemd_unit_command_line_is_valid_and_writes_only_where_needed() -> None:
    (exec_start,) = _unit_values("ExecStart")
    argv = exec_start.split()
    assert argv[0] == "/usr/local/bin/gpuagent"
    args = [
        str(ROOT / "deploy" / "systemd" / "config.yaml") if a == "/etc/gpuagent/config.yaml" else a
        for a in argv[1:]
    ]
    settings = load_settings(args, {})
    make_plan(settings)
    assert settings.socket_dir == load_settings([], {}).socket_dir
    writable = " ".join(_unit_values("ReadWritePaths")).split()
    assert str(settings.socket_dir) in writable
    assert {w.lstrip("-") for w in writable} == {str(settings.socket_dir), *EXTRA_HOST_DIRS}
    assert _unit_values("ProtectSystem") == ["strict"]
    assert _unit_values("NoNewPrivileges") == ["yes"]
    assert _unit_values("CapabilityBoundingSet") == [""]


# ----- the agent as the DaemonSet starts it -------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _probe(port: int, probe: dict[str, Any]) -> int | None:
    url = f"http://127.0.0.1:{port}{probe['httpGet']['path']}"
    try:
        with urllib.request.urlopen(url, timeout=probe.get("timeoutSeconds", 1)) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        return int(error.code)
    except OSError:
        return None


def _wait_probe(port: int, probe: dict[str, Any], status: int) -> None:
    deadline = time.monotonic() + T
    last = None
    while time.monotonic() < deadline:
        last = _probe(port, probe)
        if last == status:
            return
        time.sleep(0.05)
    raise AssertionError(f"{probe['httpGet']['path']} never answered {status}; last {last}")


@pytest.fixture
def daemonset_agent(
    short_tmp_path: Path,
) -> Iterator[tuple[subprocess.Popen[str], dict[str, Any], Path, int, dict[str, Any]]]:
    """The agent started with the base DaemonSet's entrypoint, args and env (image ENV included).

    Overrides, appended after the manifest's args (flags take precedence over the config file),
    because a test cannot be a GPU node: ``--simulate 2`` (no driver here), ``--socket-dir`` and
    ``--pod-resources-socket`` under a temporary directory (the hostPath mounts), and
    ``--metrics-address 127.0.0.1:<free port>`` (:9400 may be taken). The config file is the
    ConfigMap's, at a temporary path instead of /etc/gpuagent.
    """
    docs = build("base")
    ctr = container(docs)
    _, pod, _ = daemonset(docs)
    config = short_tmp_path / "config.yaml"
    config.write_text(config_text(docs), encoding="utf-8")
    args = [f"--config={config}" if a.startswith("--config=") else a for a in ctr["args"]]
    socket_dir = short_tmp_path / "device-plugins"
    port = _free_port()
    overrides = [
        "--simulate", "2",
        "--socket-dir", str(socket_dir),
        "--pod-resources-socket", str(short_tmp_path / "pod-resources" / "kubelet.sock"),
        "--metrics-address", f"127.0.0.1:{port}",
    ]  # fmt: skip
    # The image's PATH points at its own virtual environment: here that is sys.executable's.
    env = {**image_env(), **manifest_env(ctr), "PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    assert ctr.get("command") is None, "the image's ENTRYPOINT (gpuagent) runs"
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpuagent", *args, *overrides],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        yield proc, ctr, socket_dir, port, pod
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=T)


@pytest.mark.slow
def test_agent_started_as_the_daemonset_answers_its_probes(
    daemonset_agent: tuple[subprocess.Popen[str], dict[str, Any], Path, int, dict[str, Any]],
    grpc_stubs: StubModules,
) -> None:
    proc, ctr, socket_dir, port, pod = daemonset_agent
    liveness, readiness = ctr["livenessProbe"], ctr["readinessProbe"]
    # Alive at once, not ready while no kubelet is there (the agent waits for kubelet.sock).
    _wait_probe(port, liveness, 200)
    assert _probe(port, readiness) == 503
    with FakeKubelet(socket_dir, grpc_stubs) as kubelet:
        (registration,) = kubelet.wait_for_registrations(1, T)
        assert registration.resource_name == "nvidia.com/gpu"
        assert len(registration.next_update(T).devices) == 2
        _wait_probe(port, readiness, 200)
        assert _probe(port, liveness) == 200
        # Stopping (what the kubelet does on a rolling update) ends before the kubelet's SIGKILL:
        # the wait's deadline is the grace period.
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=pod["terminationGracePeriodSeconds"])
        assert code == 0, proc.communicate()[1]
    _, stderr = proc.communicate(timeout=T)
    assert stderr.lstrip().startswith("{"), "log-format json from the ConfigMap"


# ----- the DRA overlay ----------------------------------------------------------------------------


def test_dra_overlay_grants_only_what_the_dra_side_uses_to_its_own_service_account(
    tmp_path: Path,
) -> None:
    docs = build("dra")
    settings = effective_settings(docs, tmp_path)
    assert settings.dra_gpus == "all"
    _, pod, _ = daemonset(docs)
    account = pod["serviceAccountName"]
    namespace = only(docs, "DaemonSet")["metadata"]["namespace"]
    env = manifest_env(container(docs))
    assert env["NODE_NAME"] == "test-node", "the pool is the node: NODE_NAME from spec.nodeName"
    # RBAC: exactly the rules of the grants table (test_each_build_grants_exactly_its_table_row),
    # through a binding of this service account only.
    (role,) = [
        d for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"] == "gpuagent-dra"
    ]
    (binding,) = [
        d
        for d in docs
        if d["kind"] == "ClusterRoleBinding" and d["roleRef"]["name"] == "gpuagent-dra"
    ]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account, "namespace": namespace}
    ]
    # The admission policy binds this service account's slice writes to its own node.
    (policy,) = [d for d in docs if d["metadata"]["name"] == "gpuagent-dra-resourceslices"
                 and d["kind"] == "ValidatingAdmissionPolicy"]  # fmt: skip
    (condition,) = policy["spec"]["matchConditions"]
    assert f"system:serviceaccount:{namespace}:{account}" in condition["expression"]
    assert "authentication.kubernetes.io/node-name" in str(policy["spec"]["variables"])
    bindings = [d for d in docs if d["kind"] == "ValidatingAdmissionPolicyBinding"]
    assert policy["metadata"]["name"] in {b["spec"]["policyName"] for b in bindings}
    # NVIDIA's DeviceClasses, for the driver name the agent publishes under.
    classes = {d["metadata"]["name"]: d for d in docs if d["kind"] == "DeviceClass"}
    assert set(classes) == {"gpu.nvidia.com", "mig.nvidia.com"}
    for device_class in classes.values():
        (selector,) = device_class["spec"]["selectors"]
        assert f"device.driver == '{settings.dra_driver_name}'" in selector["cel"]["expression"]


def test_systemd_standalone_dropin_verifies(tmp_path: Path) -> None:
    """The unit with the drop-in for a host without Kubernetes: ``systemd-analyze verify`` loads
    both (a second ExecStart= without the reset would be refused); nothing is writable."""
    analyze = tool("systemd-analyze")
    agent = str(Path(sys.executable).parent / "gpuagent")
    dropin = ROOT / "deploy" / "systemd" / "standalone" / "gpuagent.service.d" / "standalone.conf"
    (tmp_path / "gpuagent.service.d").mkdir()
    for source, target in ((UNIT, "gpuagent.service"),
                           (dropin, "gpuagent.service.d/standalone.conf")):  # fmt: skip
        text = source.read_text(encoding="utf-8").replace("/usr/local/bin/gpuagent", agent)
        (tmp_path / target).write_text(text, encoding="utf-8")
    env = {**os.environ, "SYSTEMD_UNIT_PATH": f"{tmp_path}:"}
    result = subprocess.run(
        [analyze, "verify", str(tmp_path / "gpuagent.service")],
        capture_output=True, text=True, timeout=120, check=False, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    settings = dropin.read_text(encoding="utf-8")
    assert re.search(r"^ReadWritePaths=$", settings, re.MULTILINE)
    assert "--kubernetes=false" in settings


# ----- the node condition and events --------------------------------------------------------------


def _policies(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    bound = {
        d["spec"]["policyName"] for d in docs if d["kind"] == "ValidatingAdmissionPolicyBinding"
    }
    policies = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ValidatingAdmissionPolicy"}
    assert set(policies) <= bound, "every policy is bound"
    return policies


@pytest.mark.parametrize("name", ["base", "base+taint-unhealthy-node"])
def test_every_write_the_token_allows_is_pinned_to_the_agents_own_node(name: str) -> None:
    """Each rule that writes (nodes/status, events, nodes with the taint component) has an
    admission policy for this service account that compares the token's node name with what the
    request changes, and denies with 403 (the agent says so once and goes on)."""
    docs = build(name)
    pod = only(docs, "DaemonSet")["spec"]["template"]["spec"]
    user = f"system:serviceaccount:kube-system:{pod['serviceAccountName']}"
    covered: set[tuple[str, str]] = set()
    for policy in _policies(docs).values():
        spec = policy["spec"]
        (condition,) = spec["matchConditions"]
        assert user in condition["expression"]
        assert "authentication.kubernetes.io/node-name" in str(spec["variables"])
        assert spec["failurePolicy"] == "Fail"
        assert all(v.get("reason") == "Forbidden" for v in spec["validations"])
        for rule in spec["matchConstraints"]["resourceRules"]:
            covered |= {(g, r) for g in rule["apiGroups"] for r in rule["resources"]}
    writes = {(g, r) for g, r, verb in grants_of(docs).rbac if verb in ("create", "patch")}
    dra = {("resource.k8s.io", "resourceslices")}
    assert writes - dra <= covered, writes - covered


def test_the_status_policy_lets_only_the_gpuhealthy_condition_change() -> None:
    policy = _policies(build("base"))["gpuagent-node-status"]
    text = json.dumps(policy["spec"])
    assert "c.type != 'GPUHealthy'" in text
    for pinned in ("capacity", "allocatable", "addresses", "labels", "annotations"):
        assert pinned in text, pinned
    (rule,) = policy["spec"]["matchConstraints"]["resourceRules"]
    assert rule["resources"] == ["nodes/status"]


def test_the_taint_component_switches_the_taint_on_and_pins_it(tmp_path: Path) -> None:
    docs = build("base+taint-unhealthy-node")
    assert effective_settings(docs, tmp_path).taint_unhealthy_node is True
    assert effective_settings(build("base"), tmp_path).taint_unhealthy_node is False
    text = json.dumps(_policies(docs)["gpuagent-node-taint"]["spec"])
    assert "nvidia.com/gpu-unhealthy" in text
    assert "NoSchedule" in text


@pytest.mark.parametrize("overlay", sorted(set(KUSTOMIZATIONS) - {"dra"}))
def test_the_dynamic_mig_component_does_not_build_without_the_dra_overlay(overlay: str) -> None:
    """MIG made on demand serves DRA's claims: on an overlay without DRA it would add
    CAP_SYS_ADMIN for nothing (and the agent refuses --dra-mig dynamic without a DRA GPU)."""
    result = kustomize(f"{overlay}+dra-mig-dynamic")
    assert result.returncode != 0
    assert "DeviceClass.v1.resource.k8s.io/mig.nvidia.com" in result.stderr


def test_the_dynamic_mig_component_switches_it_on_with_the_runtimes_mig_capabilities() -> None:
    env = {e["name"]: e.get("value") for e in container(build("dra+dra-mig-dynamic"))["env"]}
    assert env["GPUAGENT_DRA_MIG"] == "dynamic"
    assert env["NVIDIA_MIG_CONFIG_DEVICES"] == env["NVIDIA_MIG_MONITOR_DEVICES"] == "all"
    assert "GPUAGENT_DRA_MIG" not in {e["name"] for e in container(build("dra"))["env"]}


def test_install_md_s_own_overlay_builds_with_the_operators_config(tmp_path: Path) -> None:
    """docs/install.md's overlay of one's own: on an overlay that keeps the base's config, the
    operator's ``config.yaml`` replaces it, and the DaemonSet mounts that."""
    install = (ROOT / "docs" / "install.md").read_text(encoding="utf-8")
    (example,) = [
        block
        for block in re.findall(r"```yaml\n(.*?)```", install, re.DOTALL)
        if block.startswith("# my-cluster/kustomization.yaml") and "configMapGenerator" in block
    ]
    mine = tmp_path / "my-cluster"
    mine.mkdir()
    there = os.path.relpath(MANIFESTS, mine)
    (mine / "kustomization.yaml").write_text(example.replace("../gpuagent/manifests", there))
    config = (MANIFESTS / "base" / "config.yaml").read_text(encoding="utf-8")
    (mine / "config.yaml").write_text(config.replace("log-level: info", "log-level: debug"))

    result = run(tool("kubectl"), "kustomize", str(mine))

    assert result.returncode == 0, result.stderr
    docs = [doc for doc in yaml.safe_load_all(result.stdout) if doc is not None]
    config_map = only(docs, "ConfigMap")
    assert "log-level: debug" in config_map["data"]["config.yaml"]
    _, pod, ctr = daemonset(docs)
    mounted = {v["name"]: v for v in pod["volumes"]}["config"]["configMap"]["name"]
    assert mounted == config_map["metadata"]["name"]
    assert pod["runtimeClassName"] == "nvidia"
    assert ctr["image"] == "registry.example.com/gpuagent:0.1.0"


def test_the_overlays_the_docs_say_keep_the_base_s_config_do() -> None:
    """docs/install.md names the overlays with a config.yaml of their own, and those without."""
    install = " ".join((ROOT / "docs" / "install.md").read_text(encoding="utf-8").split())
    own = {name for name, path in KUSTOMIZATIONS.items() if (path / "config.yaml").exists()}
    own.discard("base")
    keep = set(KUSTOMIZATIONS) - own - {"base"}
    said = re.search(r"which the (.*?) overlays keep, or the overlay's own `config.yaml` \((.*?)\)",
                     install)  # fmt: skip
    assert said, "install.md no longer says which overlays have a config.yaml"
    assert set(re.findall(r"`([\w-]+)`", said.group(1))) == keep
    assert set(re.findall(r"`([\w-]+)`", said.group(2))) == own
