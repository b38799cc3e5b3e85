"""Every documented combination of the chart's values renders objects the API server accepts,
and every value reaches the agent: each rendered DaemonSet's container, ConfigMap and Secrets
go through ``gpuagent --check-config``, and the effective settings must show what was asked.
Where the kustomize manifests have the same deployment (an overlay, an overlay with a
component), the chart renders the same objects and the agent ends up with the same settings.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.tls import make_pki

from deploy.grants import BASE_GRANTS, OVERLAY_GRANTS, Grants, expected_grants, grants_of
from deploy.helm.rendering import (
    NAMESPACE,
    Doc,
    agent_container,
    check_config,
    container_env,
    named,
    of_kind,
    render,
)
from deploy.kustomize import CLUSTER_SCOPED, MANIFESTS, build, validate
from gpuagent.domain.mps import MpsDirs

# A bcrypt hash (cost 4, of "secret"): the web config's basic-auth user.
PASSWORD_HASH = "$2b$04$4/ostKi6zwjteR9/A6s3Ee2zdll6BJyRMkf6PZ7SYy3NkyIDdOaQS"
TIME_SLICING = """version: v1
sharing:
  timeSlicing:
    renameByDefault: false
    failRequestsGreaterThanOne: false
    resources:
      - name: nvidia.com/gpu
        replicas: 4
"""
# manifests/overlays/mps/config.yaml's sharing block, as NVIDIA's config file.
MPS = """version: v1
sharing:
  mps:
    renameByDefault: false
    resources:
      - name: nvidia.com/gpu
        replicas: 4
"""
MPS_SHARING = {
    "mps": {
        "renameByDefault": False,
        "failRequestsGreaterThanOne": True,
        "resources": [{"name": "nvidia.com/gpu", "replicas": 4}],
    }
}
MPS_TWO = {"name": "nvidia.com/gpu", "replicas": 2}
ALERTS = MANIFESTS / "monitoring" / "alerts.yaml"
# Settings compared by file name: the test moves the mounted files to a temporary directory.
MOVED = {"web_config_file", "config_file", "check_config"}


@dataclass(frozen=True)
class Combination:
    values: dict[str, Any]
    # What the agent's effective settings must show (a subset of --check-config's output).
    settings: dict[str, Any] = field(default_factory=dict)
    # The kustomize build (tests/deploy/test_manifests.py's names) that deploys the same.
    kustomize: str | None = None


COMBINATIONS = {
    "default": Combination({}, {"container_accounting": False}, "base"),
    "accounting": Combination(
        {"accounting": {"enabled": True}}, {"container_accounting": True}, "accounting"
    ),
    "mig-mixed": Combination({"migStrategy": "mixed"}, {"mig_strategy": "mixed"}, "mig-mixed"),
    "time-slicing": Combination(
        {"config": {"map": {"default": TIME_SLICING}}},
        {
            "sharing": {
                "timeSlicing": {
                    "renameByDefault": False,
                    "failRequestsGreaterThanOne": False,
                    "resources": [{"name": "nvidia.com/gpu", "replicas": 4}],
                }
            }
        },
        "time-slicing",
    ),
    "mps": Combination({"config": {"map": {"default": MPS}}}, {"sharing": MPS_SHARING}, "mps"),
    "mps-accounting": Combination(
        {"config": {"map": {"default": MPS}}, "accounting": {"enabled": True}},
        {"sharing": MPS_SHARING, "container_accounting": True},
        "mps+accounting",
    ),
    "cdi": Combination(
        {"deviceListStrategy": "cdi-cri"},
        {"device_list_strategy": ["cdi-cri"], "driver_root_ctr_path": "/driver-root"},
        "cdi",
    ),
    "prometheus-operator": Combination(
        {"serviceMonitor": {"enabled": True}, "prometheusRule": {"enabled": True}},
        kustomize="prometheus-operator",
    ),
    "dra": Combination({"dra": {"gpus": "all"}}, {"dra_gpus": "all"}, "dra"),
    "dra-mig-dynamic": Combination(
        {"dra": {"gpus": "all", "mig": "dynamic"}}, {"dra_mig": "dynamic"}, "dra+dra-mig-dynamic"
    ),
    "dra-accounting": Combination(
        {"dra": {"gpus": "all"}, "accounting": {"enabled": True}},
        {"dra_gpus": "all", "container_accounting": True},
        "dra+accounting",
    ),
    # DRA GPUs shared by claims through MPS: what MPS needs, on the DaemonSet serving DRA.
    "dra-shares": Combination(
        {"dra": {"gpus": "all", "sharing": "mps"}},
        {"dra_gpus": "all", "dra_sharing": "mps"},
        "dra+dra-shares",
    ),
    "cdi-accounting": Combination(
        {"deviceListStrategy": "cdi-cri", "accounting": {"enabled": True}},
        {"container_accounting": True},
        "cdi+accounting",
    ),
    "taint": Combination(
        {"nodeHealth": {"taintUnhealthyNode": True}},
        {"taint_unhealthy_node": True},
        "base+taint-unhealthy-node",
    ),
    # NVIDIA's values that no overlay has.
    "nvidia-flags": Combination(
        {
            "migStrategy": "single",
            "failOnInitError": True,
            "compatWithCPUManager": True,
            "deviceListStrategy": "envvar,volume-mounts",
            "deviceIDStrategy": "index",
            "nvidiaDriverRoot": "/run/nvidia/driver",
        },
        {
            "mig_strategy": "single",
            "fail_on_init_error": True,
            "pass_device_specs": True,
            "device_list_strategy": ["envvar", "volume-mounts"],
            "device_id_strategy": "index",
            "nvidia_driver_root": "/run/nvidia/driver",
        },
    ),
    "cdi-driver-container": Combination(
        {
            "deviceListStrategy": "cdi-annotations",
            "nvidiaDriverRoot": "/run/nvidia/driver",
            "cdi": {"nvidiaHookPath": "/usr/local/nvidia/toolkit/nvidia-ctk"},
        },
        {
            "device_list_strategy": ["cdi-annotations"],
            "nvidia_driver_root": "/run/nvidia/driver",
            "driver_root_ctr_path": "/driver-root",
            "nvidia_cdi_hook_path": "/usr/local/nvidia/toolkit/nvidia-ctk",
        },
    ),
    "mps-unchanged": Combination(
        {
            "config": {"map": {"default": MPS}},
            "mps": {"root": "/var/lib/gpuagent/mps", "computeMode": "unchanged"},
        },
        {"mps_root": "/var/lib/gpuagent/mps", "mps_compute_mode": "unchanged"},
    ),
    "mps-host-pid": Combination(
        {"config": {"map": {"default": MPS}}, "mps": {"enableHostPID": True}},
        {"sharing": MPS_SHARING},
    ),
    # MPS from agentConfig, as the agent's --sharing takes it (YAML text).
    "mps-agent-config": Combination(
        {"agentConfig": {"sharing": "{mps: {resources: [{name: nvidia.com/gpu, replicas: 2}]}}"}},
        {"sharing": {"mps": {**MPS_SHARING["mps"], "resources": [MPS_TWO]}}},
    ),
    "no-labels": Combination({"gfd": {"enabled": False}}, {"node_labels": False}),
    "no-node-health": Combination(
        {"nodeHealth": {"condition": False, "events": False}},
        {"node_condition": False, "events": False},
    ),
    "host-network": Combination({"devicePlugin": {"enableHostNetwork": True}}),
    "metrics-address": Combination(
        {"service": {"address": ":9500", "port": 9500}}, {"metrics_port": 9500}
    ),
    "basic-auth": Combination(
        {"web": {"config": {"basic_auth_users": {"prometheus": PASSWORD_HASH}}}},
        {"web_config_file": "web-config.yml"},
    ),
    "tls": Combination(
        {
            "web": {
                "config": {
                    "tls_server_config": {"cert_file": "tls.crt", "key_file": "tls.key"},
                    "basic_auth_users": {"prometheus": PASSWORD_HASH},
                },
                "tlsSecret": "gpuagent-tls",
            },
            "serviceMonitor": {"enabled": True},
        },
        {"web_config_file": "web-config.yml"},
    ),
    "agent-config": Combination(
        {"agentConfig": {"poll-interval": 10, "log-level": "debug"}},
        {"poll_interval": 10.0, "log_level": "debug"},
    ),
    "names": Combination(
        {
            "fullnameOverride": "gpu-agent",
            "namespaceOverride": "gpus",
            "image": {"repository": "registry.example.com/gpuagent", "tag": "1.2.3"},
            "imagePullSecrets": [{"name": "pull"}],
            "runtimeClassName": "nvidia",
            "podAnnotations": {"example.com/team": "gpus"},
            "nodeSelector": {"pool": "gpu"},
        },
    ),
}


def daemonset_name(name: str) -> str:
    return str(COMBINATIONS[name].values.get("fullnameOverride", "gpuagent"))


Settings = Callable[[str], Doc]


@pytest.fixture(scope="module")
def settings_of(tmp_path_factory: pytest.TempPathFactory) -> Settings:
    """The agent's effective settings for a combination (or, ``kustomize:NAME``, for a kustomize
    build), each found once per module. The tls combination's Secret is made here, as an operator
    would make it (a kubernetes.io/tls Secret)."""
    root = tmp_path_factory.mktemp("settings")
    pki = make_pki(root / "pki")
    files = {"tls.crt": pki.server_cert, "tls.key": pki.server_key, "ca.crt": pki.ca_cert}
    secrets = {"gpuagent-tls": {name: path.read_text() for name, path in files.items()}}
    found: dict[str, Doc] = {}

    def settings(name: str) -> Doc:
        if name not in found:
            where = root / name.replace(":", "-").replace("+", "-")
            if name.startswith("kustomize:"):
                found[name] = check_config(build(name.partition(":")[2]), where)
            else:
                docs = render(COMBINATIONS[name].values)
                found[name] = check_config(
                    docs, where, daemonset=daemonset_name(name), secrets=secrets
                )
        return found[name]

    return settings


def same(expected: Any, found: Any, key: str) -> bool:
    return Path(str(found)).name == expected if key in MOVED else bool(found == expected)


# ----- every combination --------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(COMBINATIONS))
def test_every_object_passes_the_kubernetes_schemas(name: str) -> None:
    docs = render(COMBINATIONS[name].values)
    assert of_kind(docs, "DaemonSet")
    for doc in docs:
        validate(doc)
        namespace = None if doc["kind"] in CLUSTER_SCOPED else doc["metadata"]["namespace"]
        assert doc["metadata"].get("namespace") == namespace, doc["metadata"]
        assert doc["metadata"]["labels"]["app.kubernetes.io/part-of"] == "gpuagent"


@pytest.mark.parametrize("name", sorted(COMBINATIONS))
def test_every_value_reaches_the_agents_settings(name: str, settings_of: Settings) -> None:
    """The agent accepts what the DaemonSet hands it, and its effective settings show each
    value of the combination; each of those differs from the default rendering's."""
    found, default = settings_of(name), settings_of("default")
    for key, expected in COMBINATIONS[name].settings.items():
        assert same(expected, found[key], key), f"{key}: {found[key]!r}, not {expected!r}"
        if name != "default":
            assert not same(expected, default[key], key), f"{key} is {expected!r} anyway"


@pytest.mark.parametrize("name", sorted(COMBINATIONS))
def test_references_inside_the_rendering_resolve(name: str) -> None:
    docs = render(COMBINATIONS[name].values)
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    services = of_kind(docs, "Service")
    for ds in of_kind(docs, "DaemonSet"):
        pod, ctr = ds["spec"]["template"]["spec"], agent_container(ds)
        labels = ds["spec"]["template"]["metadata"]["labels"]
        assert ds["spec"]["selector"]["matchLabels"].items() <= labels.items()
        assert ("ServiceAccount", pod["serviceAccountName"]) in names
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert {m["name"] for m in ctr["volumeMounts"]} == set(volumes)
        for volume in volumes.values():
            if "configMap" in volume:
                assert ("ConfigMap", volume["configMap"]["name"]) in names
        for service in services:
            assert service["spec"]["selector"].items() <= labels.items()
        ports = {p["name"] for p in ctr["ports"]}
        for probe in ("livenessProbe", "readinessProbe"):
            assert ctr[probe]["httpGet"]["port"] in ports
    for binding in of_kind(docs, "ClusterRoleBinding"):
        assert ("ClusterRole", binding["roleRef"]["name"]) in names
        (subject,) = binding["subjects"]
        assert ("ServiceAccount", subject["name"]) in names
    for binding in of_kind(docs, "ValidatingAdmissionPolicyBinding"):
        assert ("ValidatingAdmissionPolicy", binding["spec"]["policyName"]) in names
    for monitor in of_kind(docs, "ServiceMonitor"):
        (service,) = services
        assert monitor["spec"]["selector"]["matchLabels"].items() <= (
            service["metadata"]["labels"].items()
        )


# ----- the same as the kustomize manifests --------------------------------------------------------

# Labels Helm's conventions add (the release, its manager, versions); kustomize's are kept.
HELM_LABELS = {
    "app.kubernetes.io/instance", "app.kubernetes.io/managed-by", "app.kubernetes.io/version",
    "helm.sh/chart",
}  # fmt: skip


def _strip(labels: dict[str, str] | None) -> None:
    for label in HELM_LABELS & set(labels or {}):
        del labels[label]  # type: ignore[union-attr]


def comparable(docs: list[Doc]) -> dict[tuple[str, str], Doc]:
    """The objects by kind and name, as far as both tools must agree: without Helm's labels, the
    ConfigMap's content (compared as the agent's settings) and name hash, the config checksum,
    and with lists whose order means nothing (environment, volumes, mounts) sorted by name."""
    out: dict[tuple[str, str], Doc] = {}
    for doc in docs:
        _strip(doc["metadata"].get("labels"))
        spec = doc.get("spec", {})
        _strip(spec.get("selector", {}).get("matchLabels"))
        if doc["kind"] == "ServiceAccount" or doc["kind"] == "Service":
            _strip(spec.get("selector"))
        if doc["kind"] == "ConfigMap":
            doc["metadata"]["name"] = "gpuagent-config"
            doc.pop("data")
        if doc["kind"] == "DaemonSet":
            template = spec["template"]
            _strip(template["metadata"]["labels"])
            template["metadata"]["annotations"].pop("checksum/config", None)
            pod = template["spec"]
            for volume in pod["volumes"]:
                if "configMap" in volume:
                    volume["configMap"]["name"] = "gpuagent-config"
            pod["volumes"].sort(key=lambda v: v["name"])
            for ctr in pod["containers"]:
                ctr.pop("env")
                ctr["volumeMounts"].sort(key=lambda m: m["name"])
        out[(doc["kind"], doc["metadata"]["name"])] = doc
    return out


KUSTOMIZED = sorted(n for n, c in COMBINATIONS.items() if c.kustomize)


@pytest.mark.parametrize("name", KUSTOMIZED)
def test_the_rendering_is_the_kustomize_build(name: str) -> None:
    """The default values render manifests/base (``kubectl kustomize manifests/base``): the same
    objects, host paths, privileges, probes, RBAC and admission policies; the other combinations
    render their overlay (with its component)."""
    overlay = COMBINATIONS[name].kustomize
    assert overlay is not None
    helm, kustomize = comparable(render(COMBINATIONS[name].values)), comparable(build(overlay))
    assert sorted(helm) == sorted(kustomize)
    # The alert rules as the source has them: kustomize re-folds a folded expression's lines
    # (PromQL reads both the same), Helm's copy keeps them.
    for rule in [key for key in helm if key[0] == "PrometheusRule"]:
        assert helm[rule].pop("spec") == yaml.safe_load(ALERTS.read_text(encoding="utf-8"))
        kustomize[rule].pop("spec")
    for key, expected in kustomize.items():
        assert helm[key] == expected, key


@pytest.mark.parametrize("name", KUSTOMIZED)
def test_the_agent_gets_the_kustomize_builds_settings(name: str, settings_of: Settings) -> None:
    helm = settings_of(name)
    kustomize = settings_of(f"kustomize:{COMBINATIONS[name].kustomize}")
    differ = {key for key in helm if key not in MOVED and helm[key] != kustomize[key]}
    assert not differ, {key: (helm[key], kustomize[key]) for key in differ}


def test_the_comparison_sees_a_changed_object() -> None:
    """The comparison above can fail: a probe, a host path or a rule that differs is seen."""
    kustomize = comparable(build("base"))
    changes: list[dict[str, Any]] = [
        {
            "resources": {
                "requests": {"cpu": "20m", "memory": "64Mi"},
                "limits": {"memory": "256Mi"},
            }
        },
        {"tolerations": []},
        {"nodeHealth": {"events": False}},
        {"gfd": {"enabled": False}},
    ]
    for change in changes:
        assert comparable(render(change)) != kustomize, change


# ----- what the combinations without an overlay grant ---------------------------------------------

NVIDIA_GRANTS = {
    "nvidia-flags": Grants(capabilities=frozenset({"SYS_ADMIN"}), escalation=True),
    "cdi-driver-container": Grants(host_paths=frozenset({
        ("/var/run/cdi", "/var/run/cdi", False),
        ("/run/nvidia/driver", "/driver-root", True)})),
    "no-labels": Grants(),
    "host-network": Grants(host_namespaces=frozenset({"network"})),
    "metrics-address": Grants(),
    "basic-auth": Grants(volume_kinds=frozenset({"projected"})),
    "tls": Grants(volume_kinds=frozenset({"projected"})),
    "agent-config": Grants(),
    # The overlay's MPS grants without the capability: the compute modes are left alone.
    "mps-unchanged": Grants(host_paths=frozenset({
        ("/var/lib/gpuagent/mps", "/var/lib/gpuagent/mps", False),
        ("/var/lib/gpuagent/mps/shm", "/dev/shm", False)})),
    "mps-host-pid": OVERLAY_GRANTS["mps"].plus(Grants(host_namespaces=frozenset({"pid"}))),
    "mps-agent-config": OVERLAY_GRANTS["mps"],
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(NVIDIA_GRANTS))
def test_each_combination_grants_exactly_its_row(name: str) -> None:
    docs = render(COMBINATIONS[name].values)
    expected = BASE_GRANTS.plus(NVIDIA_GRANTS[name])
    if name == "no-labels":
        features = "/etc/kubernetes/node-feature-discovery/features.d"
        expected = Grants(**{**expected.__dict__, "host_paths": frozenset(
            p for p in expected.host_paths if p[0] != features)})  # fmt: skip
    assert grants_of(docs) == expected


def test_without_node_health_the_agent_gets_no_token_and_no_rbac() -> None:
    docs = render({"nodeHealth": {"condition": False, "events": False}})
    grants = grants_of(docs)
    assert (grants.token, grants.rbac) == (False, frozenset())
    assert not of_kind(docs, "ValidatingAdmissionPolicy")
    events_only = grants_of(render({"nodeHealth": {"condition": False}}))
    assert {r for _, r, _ in events_only.rbac} == {"events", "nodes"}
    assert grants_of(render({})) == expected_grants("base")


def test_names_and_namespace_follow_the_overrides() -> None:
    docs = render(COMBINATIONS["names"].values)
    ds = named(docs, "DaemonSet", "gpu-agent")
    pod = ds["spec"]["template"]["spec"]
    assert ds["metadata"]["namespace"] == "gpus"
    assert pod["serviceAccountName"] == "gpu-agent"
    assert agent_container(ds)["image"] == "registry.example.com/gpuagent:1.2.3"
    assert (pod["runtimeClassName"], pod["imagePullSecrets"]) == ("nvidia", [{"name": "pull"}])
    assert pod["nodeSelector"] == {"pool": "gpu"}
    assert ds["spec"]["template"]["metadata"]["annotations"]["example.com/team"] == "gpus"
    user = "system:serviceaccount:gpus:gpu-agent"
    for policy in of_kind(docs, "ValidatingAdmissionPolicy"):
        (condition,) = policy["spec"]["matchConditions"]
        assert user in condition["expression"]
    for binding in of_kind(docs, "ClusterRoleBinding"):
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": "gpu-agent", "namespace": "gpus"}
        ]
    assert {d["metadata"]["name"] for d in docs} == {
        n.replace("gpuagent", "gpu-agent") for n in {d["metadata"]["name"] for d in render()}
    }
    release = render(release="other", namespace=NAMESPACE)
    assert {d["metadata"]["name"] for d in of_kind(release, "DaemonSet")} == {"other-gpuagent"}


def test_tls_makes_the_probes_and_the_scrape_https() -> None:
    docs = render(COMBINATIONS["tls"].values)
    ctr = agent_container(named(docs, "DaemonSet", "gpuagent"))
    for probe in ("livenessProbe", "readinessProbe"):
        assert ctr[probe]["httpGet"]["scheme"] == "HTTPS"
    (endpoint,) = of_kind(docs, "ServiceMonitor")[0]["spec"]["endpoints"]
    assert endpoint["scheme"] == "https"
    (secret,) = of_kind(docs, "Secret")
    assert secret["metadata"]["name"] == "gpuagent-web-config"
    assert PASSWORD_HASH in secret["stringData"]["web-config.yml"]
    plain = agent_container(
        named(render(COMBINATIONS["basic-auth"].values), "DaemonSet", "gpuagent")
    )
    assert "scheme" not in plain["livenessProbe"]["httpGet"]


# ----- MPS: its mounts and capability only where a config shares through it -----------------------


def _shares_through_mps(settings: Doc) -> bool:
    """As the agent decides it: the device plugin's MPS replicas, or DRA GPUs shared by claims."""
    dra_shares = settings["dra_sharing"] == "mps" and settings["dra_gpus"] != "none"
    return dra_shares or bool(settings["sharing"].get("mps", {}).get("resources"))


@pytest.mark.parametrize("name", sorted(COMBINATIONS))
def test_mps_mounts_and_capabilities_only_where_the_agent_shares_through_mps(
    name: str, settings_of: Settings
) -> None:
    """What MPS needs (the MPS root and its shm, the driver's compute capability, the mps keys
    in the config) is in a DaemonSet exactly when the agent's settings share through MPS."""
    mps = _shares_through_mps(settings_of(name))
    docs = render(COMBINATIONS[name].values)
    ds = named(docs, "DaemonSet", daemonset_name(name))
    pod, ctr = ds["spec"]["template"]["spec"], agent_container(ds)
    parts = {"mps-root", "mps-shm"}
    assert parts & {v["name"] for v in pod["volumes"]} == (parts if mps else set())
    assert parts & {m["name"] for m in ctr["volumeMounts"]} == (parts if mps else set())
    capabilities = container_env(ctr)["NVIDIA_DRIVER_CAPABILITIES"]
    assert capabilities == ("compute,utility" if mps else "utility")
    (cm,) = of_kind(docs, "ConfigMap")
    assert ("mps-root" in yaml.safe_load(cm["data"]["config.yaml"])) is mps


@pytest.mark.parametrize(
    "name", ["mps", "mps-unchanged", "mps-host-pid", "mps-agent-config", "dra-shares"]
)
def test_the_mps_root_is_mounted_where_the_agent_makes_its_directories(
    name: str, settings_of: Settings
) -> None:
    """The MPS root is a host path at the same path in the container (the containers' mounts
    name it); its shm, the agent's /dev/shm, is where the agent makes it; the capability comes
    with compute-mode changes only."""
    settings = settings_of(name)
    dirs = MpsDirs(str(settings["mps_root"]))
    ds = named(render(COMBINATIONS[name].values), "DaemonSet", "gpuagent")
    pod, ctr = ds["spec"]["template"]["spec"], agent_container(ds)
    host = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    mounts = {m["name"]: m for m in ctr["volumeMounts"]}
    assert host["mps-root"] == mounts["mps-root"]["mountPath"] == dirs.root
    assert (host["mps-shm"], mounts["mps-shm"]["mountPath"]) == (dirs.shm, "/dev/shm")
    assert not any(m.get("readOnly") for n, m in mounts.items() if n.startswith("mps-"))
    changes = settings["mps_compute_mode"] == "exclusive-process"
    assert ("SYS_ADMIN" in ctr["securityContext"]["capabilities"].get("add", [])) is changes
    assert ("allowPrivilegeEscalation" not in ctr["securityContext"]) is changes
