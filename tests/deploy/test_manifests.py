"""What a platform team installs with kustomize: every overlay is built with ``kubectl kustomize``
and validated offline against the Kubernetes schemas (kubernetes-validate, strict: unknown fields
fail) and, for the Prometheus Operator kinds, against the operator's CRD schemas
(tests/deploy/schemas). Rules the API server enforces beyond the schemas, the agent's own config
schema, and the paths the agent uses by default are checked here too.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.nodes import gpu, node

from deploy.kustomize import (
    ACCOUNTING_HOST_PATHS,
    ADDED_CAPABILITIES,
    ALL_BUILDS,
    API_CLIENTS,
    CDI_HOST_DIR,
    CDI_HOST_PATHS,
    CLUSTER_SCOPED,
    COMPONENTS,
    DRA_HOST_PATHS,
    EXPECTED_OVERLAYS,
    EXTRA_HOST_DIRS,
    KUSTOMIZATIONS,
    MANIFESTS,
    MPS_HOST_PATHS,
    NOT_HOST_PATHS,
    ROOT,
    build,
    config_text,
    container,
    daemonset,
    effective_settings,
    manifest_env,
    module,
    only,
    overlay_of,
    run,
    tool,
    validate,
)
from gpuagent.config import ConfigError, load_settings
from gpuagent.config.planning import make_plan
from gpuagent.domain.mpsplan import mps_daemons
from gpuagent.domain.resources import build_resources
from gpuagent.runtime.cri import DEFAULT_SOCKETS

# ----- the overlays exist and build ---------------------------------------------------------------


def test_every_overlay_is_there() -> None:
    assert set(KUSTOMIZATIONS) >= EXPECTED_OVERLAYS
    assert set(COMPONENTS) == {
        "accounting",
        "taint-unhealthy-node",
        "dra-mig-dynamic",
        "dra-shares",
    }


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


# ----- YAML ---------------------------------------------------------------------------------------


def test_yaml_lint() -> None:
    result = run(tool("yamllint"), "--strict", "--format", "parsable", ".")
    assert result.returncode == 0, result.stdout + result.stderr


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
