"""Values files of NVIDIA's charts, as NVIDIA's documentation writes them (tests/deploy/helm/data),
render unchanged and the agent takes what they ask for; NVIDIA's config files are translated key
by key; the keys that do not apply are ignored (docs/migration.md lists them) or refused with the
reason, never silently dropped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from deploy.helm.rendering import (
    Doc,
    agent_container,
    check_config,
    container_env,
    data,
    named,
    of_kind,
    render,
    render_error,
)
from deploy.kustomize import validate

EXAMPLES = sorted(p.name for p in (Path(__file__).parent / "data").glob("*.yaml"))
LABEL = "nvidia.com/device-plugin.config"
GPU_NODE = {"feature.node.kubernetes.io/pci-10de.present": "true"}


def daemonsets(docs: list[Doc]) -> dict[str, Doc]:
    return {ds["metadata"]["name"]: ds for ds in of_kind(docs, "DaemonSet")}


def config_file(text: str, **flags: Any) -> str:
    """An NVIDIA config file (version v1) with ``flags``."""
    return yaml.safe_dump({"version": "v1", "flags": flags})


def config_map(**files: str) -> dict[str, Any]:
    return {"config": {"map": files}}


@pytest.mark.parametrize("example", EXAMPLES)
def test_each_documented_values_file_renders_and_the_agent_takes_it(
    example: str, tmp_path: Path
) -> None:
    docs = render(data(example))
    for doc in docs:
        validate(doc)
    for name in daemonsets(docs):
        check_config(docs, tmp_path / name, daemonset=name)


def test_the_single_config_example(tmp_path: Path) -> None:
    settings = check_config(render(data("nvidia-single-config.yaml")), tmp_path)
    assert settings["fail_on_init_error"] is True  # the chart's own default is false
    assert (settings["mig_strategy"], settings["nvidia_driver_root"]) == ("none", "/")
    assert settings["device_list_strategy"] == ["envvar"]


def test_the_time_slicing_examples(tmp_path: Path) -> None:
    for example, renamed, fail in (
        ("nvidia-time-slicing.yaml", False, False),
        ("nvidia-time-slicing-renamed.yaml", True, True),
    ):
        settings = check_config(render(data(example)), tmp_path / example)
        sharing = settings["sharing"]["timeSlicing"]
        assert sharing["resources"] == [{"name": "nvidia.com/gpu", "replicas": 10}]
        assert (sharing["renameByDefault"], sharing["failRequestsGreaterThanOne"]) == (
            renamed, fail,
        )  # fmt: skip


def test_the_mps_examples(tmp_path: Path) -> None:
    """NVIDIA's MPS files reach the agent as they are, with the MPS root NVIDIA's chart uses
    mounted where the agent makes the daemons' directories, and the compute mode set as NVIDIA's
    does; no second DaemonSet (NVIDIA's mps-control-daemon: the agent keeps the daemons)."""
    for example, renamed in (("nvidia-mps.yaml", False), ("nvidia-mps-renamed.yaml", True)):
        docs = render(data(example))
        assert set(daemonsets(docs)) == {"gpuagent"}
        settings = check_config(docs, tmp_path / example)
        sharing = settings["sharing"]["mps"]
        assert sharing["resources"] == [{"name": "nvidia.com/gpu", "replicas": 10}]
        # NVIDIA's default for MPS: one replica per container.
        assert (sharing["renameByDefault"], sharing["failRequestsGreaterThanOne"]) == (
            renamed, True,
        )  # fmt: skip
        assert "timeSlicing" not in settings["sharing"]
        assert (settings["mps_root"], settings["mps_compute_mode"]) == (
            "/run/nvidia/mps", "exclusive-process",
        )  # fmt: skip
        ds = named(docs, "DaemonSet", "gpuagent")
        mounts = {m["name"]: m["mountPath"] for m in agent_container(ds)["volumeMounts"]}
        assert (mounts["mps-root"], mounts["mps-shm"]) == ("/run/nvidia/mps", "/dev/shm")
        assert "hostPID" not in ds["spec"]["template"]["spec"]


def test_the_cpu_manager_and_mixed_mig_example(tmp_path: Path) -> None:
    docs = render(data("nvidia-cpu-manager-mig.yaml"))
    settings = check_config(docs, tmp_path)
    assert (settings["pass_device_specs"], settings["mig_strategy"]) == (True, "mixed")
    ctr = agent_container(named(docs, "DaemonSet", "gpuagent"))
    # Helm merges maps: the chart's memory request stays.
    assert ctr["resources"] == {
        "requests": {"cpu": "100m", "memory": "64Mi"},
        "limits": {"memory": "512Mi"},
    }
    # Seeing every MIG device: the runtime's monitor capability, for CAP_SYS_ADMIN only.
    assert container_env(ctr)["NVIDIA_MIG_MONITOR_DEVICES"] == "all"
    assert ctr["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["SYS_ADMIN"]}
    assert "allowPrivilegeEscalation" not in ctr["securityContext"]
    assert not ctr["securityContext"]["privileged"], "PASS_DEVICE_SPECS needs no privilege here"


def test_the_dcgm_exporter_monitoring_values() -> None:
    docs = render(data("dcgm-exporter-monitoring.yaml"))
    (service,) = of_kind(docs, "Service")
    assert "clusterIP" not in service["spec"], "dcgm-exporter's clusterIP '' lets Kubernetes pick"
    assert service["metadata"]["annotations"] == {"prometheus.io/scrape": "true"}
    (monitor,) = of_kind(docs, "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    (endpoint,) = monitor["spec"]["endpoints"]
    assert (endpoint["interval"], endpoint["honorLabels"]) == ("30s", True)
    assert endpoint["relabelings"][0]["targetLabel"] == "nodename"


def test_the_gfd_example_writes_labels_and_nvidias_defaults_turn_them_off(tmp_path: Path) -> None:
    assert check_config(render(data("nvidia-gfd.yaml")), tmp_path / "on")["node_labels"] is True
    off = render(data("nvidia-chart-defaults.yaml"))
    assert check_config(off, tmp_path / "off")["node_labels"] is False
    pod = named(off, "DaemonSet", "gpuagent")["spec"]["template"]["spec"]
    assert "nfd-features" not in {v["name"] for v in pod["volumes"]}
    # An empty map merges with the chart's (Helm's way): the chart's resources stay.
    assert agent_container(named(off, "DaemonSet", "gpuagent"))["resources"]


# ----- several config files: a DaemonSet each, chosen by the node label ---------------------------


def _matches(term: Doc, labels: dict[str, str]) -> bool:
    for expression in term.get("matchExpressions", []):
        value = labels.get(expression["key"])
        operator = expression["operator"]
        if operator == "In" and value not in expression["values"]:
            return False
        if operator == "NotIn" and value in expression["values"]:
            return False
    return True


def runs_on(ds: Doc, labels: dict[str, str]) -> bool:
    """Whether the DaemonSet's required node affinity admits a node with ``labels``."""
    affinity = ds["spec"]["template"]["spec"]["affinity"]["nodeAffinity"]
    terms = affinity["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    return any(_matches(term, labels) for term in terms)


@pytest.mark.parametrize(
    ("label", "runs"),
    [
        (None, "gpuagent"),
        ("config0", "gpuagent"),  # the default's own name
        ("config1", "gpuagent-config1"),
        ("unknown", "gpuagent"),
    ],
)
def test_each_gpu_node_runs_one_agent_with_the_file_its_label_names(
    label: str | None, runs: str, tmp_path: Path
) -> None:
    docs = render(data("nvidia-multiple-config.yaml"))
    found = daemonsets(docs)
    assert set(found) == {"gpuagent", "gpuagent-config1"}
    node = {**GPU_NODE, **({LABEL: label} if label else {})}
    assert [name for name, ds in found.items() if runs_on(ds, node)] == [runs]
    assert not any(runs_on(ds, {LABEL: "config1"}) for ds in found.values()), "GPU nodes only"
    mig = {"gpuagent": "none", "gpuagent-config1": "mixed"}[runs]
    assert check_config(docs, tmp_path, daemonset=runs)["mig_strategy"] == mig
    selectors = [ds["spec"]["selector"]["matchLabels"] for ds in found.values()]
    assert selectors[0] != selectors[1]


def test_the_mig_configs_example_has_a_daemonset_per_strategy(tmp_path: Path) -> None:
    docs = render(data("nvidia-mig-configs.yaml"))
    found = daemonsets(docs)
    assert set(found) == {"gpuagent", "gpuagent-mig-mixed", "gpuagent-mig-single"}
    for name, strategy in (("gpuagent", "none"), ("gpuagent-mig-mixed", "mixed"),
                           ("gpuagent-mig-single", "single")):  # fmt: skip
        assert check_config(docs, tmp_path / name, daemonset=name)["mig_strategy"] == strategy
        sc = agent_container(found[name])["securityContext"]
        assert ("add" in sc["capabilities"]) is (strategy != "none"), name


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"map": {"a": "version: v1\n", "b": "version: v1\n"}}, "config.default: no default"),
        ({"map": {"a": "version: v1\n"}, "default": "b"}, 'config.default: "b" is not one'),
        ({"map": {"Big_One": "version: v1\n", "default": "version: v1\n"}}, "config.map.Big_One"),
        ({"name": "nvidia-plugin-configs"}, "ConfigMap kube-system/nvidia-plugin-configs was not"),
        ({"name": "x", "map": {"a": "version: v1\n"}}, "config.name and config.map"),
    ],
)
def test_config_files_nvidias_chart_refuses_are_refused(config: Doc, message: str) -> None:
    assert message in render_error({"config": config})


def test_the_empty_fallback_runs_the_chart_default_on_unlabelled_nodes(tmp_path: Path) -> None:
    values = {"config": {"map": {"a": "version: v1\nflags:\n  migStrategy: single\n",
                                 "b": "version: v1\n"},
                         "fallbackStrategies": ["named", "empty"]}}  # fmt: skip
    docs = render(values)
    assert set(daemonsets(docs)) == {"gpuagent", "gpuagent-a", "gpuagent-b"}
    assert check_config(docs, tmp_path / "d")["mig_strategy"] == "none"
    assert check_config(docs, tmp_path / "a", daemonset="gpuagent-a")["mig_strategy"] == "single"


# ----- NVIDIA's config file, key by key -----------------------------------------------------------

EVERY_FLAG = """version: v1
flags:
  migStrategy: single
  failOnInitError: true
  nvidiaDriverRoot: /run/nvidia/driver
  mpsRoot: /run/nvidia/mps
  nvidiaDevRoot: /
  gdrcopyEnabled: false
  gdsEnabled: false
  mofedEnabled: false
  useNodeFeatureAPI: false
  deviceDiscoveryStrategy: auto
  plugin:
    passDeviceSpecs: true
    deviceListStrategy: [cdi-cri]
    deviceIDStrategy: index
    cdiAnnotationPrefix: cdi.example.com/
    nvidiaCTKPath: /usr/local/nvidia/toolkit/nvidia-ctk
    containerDriverRoot: /driver-root
    sharedDevicesAllocationPolicy: packed
  gfd:
    oneshot: false
    noTimestamp: true
    sleepInterval: 60s
    outputFile: /etc/kubernetes/node-feature-discovery/features.d/gfd
    machineTypeFile: /sys/class/dmi/id/product_name
sharing:
  timeSlicing:
    resources:
      - name: nvidia.com/gpu
        replicas: 2
resources:
  gpus:
    - pattern: "*"
      name: gpu
imex:
  channelIDs: []
"""
EVERY_FLAG_SETTINGS = {
    "mig_strategy": "single", "fail_on_init_error": True,
    "nvidia_driver_root": "/run/nvidia/driver", "pass_device_specs": True,
    "device_list_strategy": ["cdi-cri"], "device_id_strategy": "index",
    "cdi_annotation_prefix": "cdi.example.com/",
    "nvidia_cdi_hook_path": "/usr/local/nvidia/toolkit/nvidia-ctk",
    "driver_root_ctr_path": "/driver-root", "shared_devices_allocation_policy": "packed",
    "node_labels_file": "/etc/kubernetes/node-feature-discovery/features.d/gfd",
    "machine_type_file": "/sys/class/dmi/id/product_name",
}  # fmt: skip


def test_every_flag_of_nvidias_config_file_reaches_the_agent(tmp_path: Path) -> None:
    docs = render(config_map(default=EVERY_FLAG))
    settings = check_config(docs, tmp_path)
    assert {key: settings[key] for key in EVERY_FLAG_SETTINGS} == EVERY_FLAG_SETTINGS
    assert settings["sharing"]["timeSlicing"]["resources"] == [
        {"name": "nvidia.com/gpu", "replicas": 2}
    ]
    # The CDI strategy mounts the host's driver root (the file's) where the agent reads it.
    pod = named(docs, "DaemonSet", "gpuagent")["spec"]["template"]["spec"]
    (root,) = [v for v in pod["volumes"] if v["name"] == "driver-root"]
    assert root["hostPath"]["path"] == "/run/nvidia/driver"


def test_nvidias_values_override_its_config_file(tmp_path: Path) -> None:
    values = {**config_map(default=EVERY_FLAG), "migStrategy": "mixed", "failOnInitError": False}
    settings = check_config(render(values), tmp_path)
    assert (settings["mig_strategy"], settings["fail_on_init_error"]) == ("mixed", False)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"gdsEnabled": True}, "flags.gdsEnabled: gpuagent injects no GPUDirect Storage"),
        ({"gdrcopyEnabled": True}, "flags.gdrcopyEnabled: gpuagent injects no GDRCopy"),
        ({"mofedEnabled": True}, "flags.mofedEnabled: gpuagent injects no MOFED"),
        ({"deviceDiscoveryStrategy": "tegra"}, "deviceDiscoveryStrategy: tegra: gpuagent finds"),
        ({"migStrategyy": "none"}, "config.map.default.flags.migStrategyy: unknown key"),
        ({"plugin": {"deviceListStrategyy": "envvar"}}, "flags.plugin.deviceListStrategyy"),
        ({"gfd": {"outputFile": "/tmp/gfd"}}, "flags.gfd.outputFile: /tmp/gfd is outside"),
    ],
)
def test_flags_that_do_not_apply_are_refused_with_the_reason(flags: Doc, message: str) -> None:
    assert message in render_error(config_map(default=config_file("", **flags)))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("version: v2\n", "config.map.default.version: v2"),
        ("version: v1\nsharingg: {}\n", "config.map.default.sharingg: unknown key"),
        ("version: v1\nimex:\n  channelIDs: [0]\n", "imex.channelIDs: gpuagent injects no IMEX"),
        ("[not, a, mapping]\n", "config.map.default: not a YAML mapping"),
    ],
)
def test_config_files_that_are_not_nvidias_format_are_refused(text: str, message: str) -> None:
    assert message in render_error(config_map(default=text))


def test_mps_files_pass_unchanged() -> None:
    """The chart hands the agent NVIDIA's MPS block as it is."""
    values = data("nvidia-mps.yaml")
    (cm,) = of_kind(render(values), "ConfigMap")
    config = yaml.safe_load(cm["data"]["config.yaml"])
    expected = yaml.safe_load(values["config"]["map"]["config"])["sharing"]
    assert config["sharing"] == expected


MPS_FILE = "version: v1\nsharing:\n  mps:\n    resources: [{name: nvidia.com/gpu, replicas: 2}]\n"


def test_only_the_daemonset_whose_file_shares_through_mps_gets_what_mps_needs(
    tmp_path: Path,
) -> None:
    """Files on different nodes: the MPS root, its shm, the compute capability and
    CAP_SYS_ADMIN go to the DaemonSet of the MPS file only."""
    docs = render(config_map(default="version: v1\n", mps=MPS_FILE))
    found = daemonsets(docs)
    assert set(found) == {"gpuagent", "gpuagent-mps"}
    for name, mps in (("gpuagent", False), ("gpuagent-mps", True)):
        ds = found[name]
        ctr = agent_container(ds)
        volumes = {v["name"] for v in ds["spec"]["template"]["spec"]["volumes"]}
        assert ({"mps-root", "mps-shm"} <= volumes) is mps, name
        assert ("add" in ctr["securityContext"]["capabilities"]) is mps, name
        assert container_env(ctr)["NVIDIA_DRIVER_CAPABILITIES"] == (
            "compute,utility" if mps else "utility"
        )
        settings = check_config(docs, tmp_path / name, daemonset=name)
        assert bool(settings["sharing"].get("mps", {}).get("resources")) is mps, name


def test_the_mps_root_of_nvidias_file_and_values(tmp_path: Path) -> None:
    """NVIDIA's chart sets MPS_ROOT from mps.root over a file's flags.mpsRoot: a file may repeat
    mps.root (NVIDIA's config dumps carry it), not name another directory."""
    file = MPS_FILE + "flags:\n  mpsRoot: /var/run/mps/\n"
    values = {**config_map(default=file), "mps": {"root": "/var/run/mps"}}
    docs = render(values)
    assert check_config(docs, tmp_path)["mps_root"] == "/var/run/mps"
    pod = named(docs, "DaemonSet", "gpuagent")["spec"]["template"]["spec"]
    paths = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    assert (paths["mps-root"], paths["mps-shm"]) == ("/var/run/mps", "/var/run/mps/shm")
    error = render_error(config_map(default=file))
    assert "config.map.default.flags.mpsRoot: /var/run/mps/ is not mps.root" in error


def test_mps_with_mixed_mig_is_refused_at_install() -> None:
    """The agent refuses it at start (MIG devices cannot be shared through MPS); the chart says
    so before a pod is made."""
    error = render_error({**config_map(default=MPS_FILE), "migStrategy": "mixed"})
    assert "sharing.mps (config file default) with migStrategy mixed" in error
    error = render_error({"agentConfig": {"mig-strategy": "mixed", "sharing": yaml.safe_load(
        MPS_FILE)["sharing"]}})  # fmt: skip
    assert "sharing.mps (agentConfig) with migStrategy mixed" in error


def test_nvidias_mps_daemon_values() -> None:
    """mps.enableHostPID puts the agent's pod, where the MPS server runs, in the host's PID
    namespace, with MPS only; mps.enableHostNetwork is ignored (no control-daemon pod)."""
    mps = config_map(default=MPS_FILE)
    pod = named(render({**mps, "mps": {"enableHostPID": True}}), "DaemonSet", "gpuagent")
    assert pod["spec"]["template"]["spec"]["hostPID"] is True
    assert render({"mps": {"enableHostPID": True}}) == render()
    assert render({**mps, "mps": {"enableHostNetwork": True}}) == render(mps)


# ----- NVIDIA's values that do not apply ----------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"gdsEnabled": True}, "gdsEnabled=true: gpuagent injects no GPUDirect Storage"),
        ({"gdrcopyEnabled": True}, "gdrcopyEnabled=true: gpuagent injects no GDRCopy"),
        ({"mofedEnabled": True}, "mofedEnabled=true: gpuagent injects no MOFED"),
        ({"deviceDiscoveryStrategy": "tegra"}, "deviceDiscoveryStrategy=tegra: gpuagent finds"),
        ({"devicePlugin": {"enabled": False}}, "devicePlugin.enabled=false: gpuagent is the"),
        ({"nfd": {"enabled": True}}, "nfd.enabled=true: this chart does not install"),
        ({"cdi": {"featureFlags": "x"}}, "cdi.featureFlags: gpuagent's CDI spec has no"),
        ({"image": {"repository": "nvcr.io/nvidia/k8s-device-plugin"}},
         "image.repository: nvcr.io/nvidia/k8s-device-plugin is NVIDIA's image"),
    ],
)  # fmt: skip
def test_values_that_ask_for_what_gpuagent_does_not_do_are_refused(
    values: Doc, message: str
) -> None:
    assert message in render_error(values)


def test_nvidias_values_that_ask_for_nothing_are_accepted() -> None:
    """false, null and NVIDIA's defaults of the keys that do not apply render as the defaults do
    (the nvidia-chart-defaults example has every key)."""
    values = {"gdsEnabled": False, "gdrcopyEnabled": False, "mofedEnabled": False,
              "deviceDiscoveryStrategy": "nvml", "nvidiaDevRoot": "/", "nfd": {"enabled": False},
              "allowDefaultNamespace": True, "gfd": {"enabled": True, "noTimestamp": True},
              "mps": {"root": "/run/nvidia/mps", "enableHostPID": True}}  # fmt: skip
    assert render(values) == render()
