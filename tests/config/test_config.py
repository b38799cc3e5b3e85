"""gpuagent.config's settings as a whole: the defaults and their types, the settings as a dict,
the command line's own exits, and the settings decided from others (node name, Kubernetes).
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from config.loading import config_error, load, write_config
from gpuagent.config import ConfigError, load_settings
from gpuagent.domain.sharing import Sharing
from gpuagent.domain.timeslicing import ReplicaRule, TimeSlicing


def test_defaults() -> None:
    assert load().as_dict() == {
        "socket_dir": "/var/lib/kubelet/device-plugins",
        "kubelet_socket": "/var/lib/kubelet/device-plugins/kubelet.sock",
        "pod_resources_socket": "/var/lib/kubelet/pod-resources/kubelet.sock",
        "metrics_host": "",
        "metrics_port": 9400,
        "config_file": None,
        "simulate": None,
        "sim_config": None,
        "resource_name": "nvidia.com/gpu",
        "device_list_strategy": ["envvar"],
        "device_id_strategy": "uuid",
        "mig_strategy": "none",
        "fail_on_init_error": True,
        "pass_device_specs": False,
        "nvidia_driver_root": "/",
        "disable_healthchecks": "",
        "enable_healthchecks": "",
        "poll_interval": 5.0,
        "log_format": "json",
        "log_level": "info",
        "web_config_file": None,
        "hostname_label": "Hostname",
        "no_hostname": False,
        "pod_resources_interval": 30.0,
        "sharing": {},
        "shared_devices_allocation_policy": "distributed",
        "cdi_annotation_prefix": "cdi.k8s.io/",
        "cdi_spec_dir": "/var/run/cdi",
        "cdi_spec": "write",
        "nvidia_cdi_hook_path": "/usr/bin/nvidia-ctk",
        "driver_root_ctr_path": None,
        "node_labels": True,
        "node_labels_file": "/etc/kubernetes/node-feature-discovery/features.d/gpuagent",
        "machine_type_file": "/sys/class/dmi/id/product_name",
        "dra_gpus": "none",
        "dra_driver_name": "gpu.nvidia.com",
        "dra_mig": "static",
        "dra_sharing": "none",
        "plugins_registry_dir": "/var/lib/kubelet/plugins_registry",
        "plugins_dir": "/var/lib/kubelet/plugins",
        "kubeconfig": None,
        "node_condition": None,
        "events": None,
        "taint_unhealthy_node": False,
        "node_condition_heartbeat": 1800.0,
        "container_accounting": True,
        "proc_root": "/proc",
        "container_logs_dir": "/var/log/containers",
        "cri_socket": None,
        "dcgm_series_per_container": False,
        "dcgm_container_shares": False,
        "detailed_agent_metrics": False,
        "kubernetes": True,
        "node_name": socket.gethostname(),
        "check_config": None,
        "nvml_timeout": None,
        "mps_root": "/run/nvidia/mps",
        "mps_compute_mode": "exclusive-process",
    }


def test_default_types() -> None:
    settings = load()
    assert settings.socket_dir == Path("/var/lib/kubelet/device-plugins")
    assert settings.device_list_strategy == ("envvar",)
    assert settings.nvidia_driver_root == Path("/")


def test_as_dict_is_json_serializable(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, "version: v1\n")
    settings = load(["--config", str(cfg), "--simulate", "2"])
    decoded = json.loads(json.dumps(settings.as_dict()))
    assert decoded["config_file"] == str(cfg)
    assert decoded["simulate"] == 2


@pytest.mark.parametrize(
    ("isatty", "expected"),
    [pytest.param(True, "console", id="tty"), pytest.param(False, "json", id="not-tty")],
)
def test_log_format_default_follows_tty(isatty: bool, expected: str) -> None:
    assert load_settings([], {}, stderr_isatty=isatty).log_format == expected


@pytest.mark.parametrize("isatty", [True, False], ids=["tty", "not-tty"])
def test_log_format_explicit_beats_tty(isatty: bool) -> None:
    settings = load_settings(["--log-format", "json"], {}, stderr_isatty=isatty)
    assert settings.log_format == "json"


@pytest.mark.parametrize(
    ("argv", "code"),
    [
        pytest.param(["--help"], 0, id="help"),
        pytest.param(["--version"], 0, id="version"),
        pytest.param(["--no-such-flag"], 2, id="unknown-flag"),
        pytest.param(["--socket"], 2, id="no-abbreviations"),
        pytest.param(["--simulate"], 2, id="missing-value"),
    ],
)
def test_argparse_exits(argv: list[str], code: int, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        load(argv)
    assert info.value.code == code
    capsys.readouterr()


def test_version_output(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        load(["--version"])
    out = capsys.readouterr().out.strip()
    assert out.startswith("gpuagent ")
    assert out != "gpuagent "


def test_settings_is_frozen() -> None:
    settings = load()
    with pytest.raises(AttributeError):
        settings.pass_device_specs = True  # type: ignore[misc]


@pytest.mark.parametrize(
    ("value", "ok"),
    [
        pytest.param("1", True, id="one-second"),
        pytest.param("30", True, id="default"),
        pytest.param("3600", True, id="max"),
        pytest.param("0.5", False, id="too-often"),
        pytest.param("0", False, id="zero"),
        pytest.param("3601", False, id="too-long"),
        pytest.param("nan", False, id="nan"),
        pytest.param("often", False, id="word"),
    ],
)
def test_pod_resources_interval(value: str, ok: bool) -> None:
    if ok:
        settings = load(["--pod-resources-interval", value])
        assert settings.pod_resources_interval == float(value)
    else:
        error = config_error([], {"GPUAGENT_POD_RESOURCES_INTERVAL": value})
        assert error.key == "GPUAGENT_POD_RESOURCES_INTERVAL"


@pytest.mark.parametrize("value", ["HOSTNAME", "host", ""])
def test_hostname_label_invalid(value: str) -> None:
    error = config_error(["--hostname-label", value])
    assert error.key == "--hostname-label"
    assert "Hostname, hostname" in error.reason


def test_no_hostname_sources(tmp_path: Path) -> None:
    assert load(["--no-hostname"]).no_hostname is True
    assert load(["--no-hostname=false"], {"GPUAGENT_NO_HOSTNAME": "true"}).no_hostname is False
    cfg = write_config(tmp_path, "version: v1\nno-hostname: true\n")
    assert load(["--config", str(cfg)]).no_hostname is True
    assert load(["--config", str(cfg)], {"GPUAGENT_NO_HOSTNAME": "false"}).no_hostname is False


def test_web_config_file_in_file_must_be_a_path(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, "version: v1\nweb-config-file: [a, b]\n")
    error = config_error(["--config", str(cfg)])
    assert error.key == "config file key 'web-config-file'"


@pytest.mark.parametrize(
    ("value", "message"),
    [
        pytest.param("[1, 2]", "expected a mapping", id="not-a-mapping"),
        pytest.param("{mig: {}}", "unknown keys", id="unknown-block"),
        pytest.param(
            "{mps: {resources: [{name: gpu, replicas: 4}]},"
            " timeSlicing: {resources: [{name: gpu, replicas: 2}]}}",
            "timeSlicing and mps both share devices",
            id="mps-and-time-slicing",
        ),
        pytest.param("{timeSlicing: [", "not valid YAML", id="bad-yaml"),
    ],
)
def test_bad_sharing_flag(value: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        load(["--sharing", value])
    assert info.value.key == "--sharing"


def test_mps_with_mig_strategy_mixed_names_both_as_given() -> None:
    mps = "{mps: {resources: [{name: gpu, replicas: 2}]}}"
    error = config_error(["--sharing", mps], {"MIG_STRATEGY": "mixed"})
    assert str(error) == (
        "--sharing mps: cannot be combined with MIG_STRATEGY mixed: MIG devices cannot be "
        "shared through MPS (NVIDIA's plugin refuses it too)"
    )
    assert load(["--sharing", mps], {"MIG_STRATEGY": "single"}).sharing.mps.enabled


def test_sharing_from_env_json() -> None:
    settings = load([], {"GPUAGENT_SHARING": '{"timeSlicing": {"resources": []}}'})
    assert settings.sharing == Sharing()
    shared = load(
        [], {"GPUAGENT_SHARING": '{"timeSlicing": {"resources": [{"name": "gpu", "replicas": 2}]}}'}
    )
    assert shared.sharing.time_slicing == TimeSlicing((ReplicaRule("nvidia.com/gpu", 2),))


def test_node_name_comes_from_node_name_else_the_host_name() -> None:
    assert load([], {"NODE_NAME": "gpu-node-3"}).node_name == "gpu-node-3"
    assert load([], {"NODE_NAME": " "}).node_name == socket.gethostname()
    assert load().node_name == socket.gethostname()


@pytest.mark.parametrize(
    ("name", "hint"),
    [
        pytest.param("GPUAGENT_MIG_STRATEGIES", "GPUAGENT_MIG_STRATEGY", id="typo"),
        pytest.param("GPUAGENT_NO_SUCH_THING", "", id="unknown"),
    ],
)
def test_unknown_gpuagent_variable_is_an_error(name: str, hint: str) -> None:
    err = config_error(env={name: "mixed"})
    assert err.key == name
    assert "no such setting" in err.reason
    assert hint in err.reason


@pytest.mark.parametrize(
    "name",
    ["GPUAGENT_SERVICE_HOST", "GPUAGENT_SERVICE_PORT", "GPUAGENT_SERVICE_PORT_METRICS",
     "GPUAGENT_PORT", "GPUAGENT_PORT_9400_TCP", "GPUAGENT_PORT_9400_TCP_ADDR"],
)  # fmt: skip
def test_kubernetes_service_links_are_not_settings(name: str) -> None:
    assert load([], {name: "10.0.0.1"}).kubernetes is True


def test_kubernetes_switch() -> None:
    assert load(["--kubernetes=false"]).kubernetes is False
    assert load([], {"GPUAGENT_KUBERNETES": "false"}).kubernetes is False


def test_node_condition_and_events_are_decided_at_start_unless_set() -> None:
    settings = load()
    assert (settings.node_condition, settings.events, settings.taint_unhealthy_node) == (
        None, None, False,
    )  # fmt: skip
    settings = load(["--node-condition=false", "--events", "--taint-unhealthy-node"])
    assert (settings.node_condition, settings.events, settings.taint_unhealthy_node) == (
        False, True, True,
    )  # fmt: skip
    settings = load([], {"GPUAGENT_NODE_CONDITION": "true", "GPUAGENT_EVENTS": "false"})
    assert (settings.node_condition, settings.events) == (True, False)


def test_kubernetes_false_turns_the_node_condition_and_events_off() -> None:
    settings = load(["--kubernetes=false", "--events=true"])
    assert (settings.node_condition, settings.events) == (False, False)
    error = config_error(["--kubernetes=false", "--taint-unhealthy-node"])
    assert error.key == "--taint-unhealthy-node"
    assert "--kubernetes false" in str(error)


@pytest.mark.parametrize("value", ["59", "86401", "0", "soon", "nan"])
def test_the_heartbeat_is_a_minute_to_a_day(value: str) -> None:
    error = config_error(["--node-condition-heartbeat", value])
    assert error.key == "--node-condition-heartbeat"
    assert "60 to 86400 seconds" in str(error) or "number of seconds" in str(error)
    assert load(["--node-condition-heartbeat", "60"]).node_condition_heartbeat == 60.0


def test_check_config_reads_its_file_as_the_config(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, "version: v1\nmig-strategy: mixed\n")
    settings = load(["--check-config", str(cfg)])
    assert settings.check_config == cfg
    assert settings.config_file == cfg
    assert settings.mig_strategy == "mixed"
