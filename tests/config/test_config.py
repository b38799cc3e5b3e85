"""Tests for gpuagent.config: sources, precedence and validation of every setting."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from gpuagent.config import ConfigError, Settings, load_settings
from gpuagent.config.planning import make_plan
from gpuagent.domain.sharing import Sharing
from gpuagent.domain.timeslicing import ReplicaRule, TimeSlicing


def write_config(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "gpuagent.yaml"
    path.write_text(body, encoding="utf-8")
    return path


def load(argv: list[str] | None = None, env: dict[str, str] | None = None) -> Settings:
    return load_settings(argv or [], env or {})


def config_error(argv: list[str] | None = None, env: dict[str, str] | None = None) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load(argv, env)
    return info.value


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


# option, flag value, env value, file value (YAML), attribute, expected for flag/env/file
PRECEDENCE_CASES = [
    pytest.param(
        "socket-dir",
        ("/flag", "/env", "/file"),
        "socket_dir",
        (Path("/flag"), Path("/env"), Path("/file")),
        id="socket-dir",
    ),
    pytest.param(
        "mig-strategy",
        ("mixed", "single", "mixed"),
        "mig_strategy",
        ("mixed", "single", "mixed"),
        id="mig-strategy",
    ),
    pytest.param(
        "metrics-address",
        ("127.0.0.1:1", "127.0.0.1:2", "'127.0.0.1:3'"),
        "metrics_port",
        (1, 2, 3),
        id="metrics-address",
    ),
    pytest.param(
        "poll-interval",
        ("1.5", "2", "3"),
        "poll_interval",
        (1.5, 2.0, 3.0),
        id="poll-interval",
    ),
    pytest.param(
        "nvml-timeout",
        ("30", "60", "90"),
        "nvml_timeout",
        (30.0, 60.0, 90.0),
        id="nvml-timeout",
    ),
    pytest.param(
        "resource-name",
        ("a.com/flag", "b.com/env", "c.com/file"),
        "resource_name",
        ("a.com/flag", "b.com/env", "c.com/file"),
        id="resource-name",
    ),
    pytest.param(
        "log-level",
        ("debug", "warning", "error"),
        "log_level",
        ("debug", "warning", "error"),
        id="log-level",
    ),
    pytest.param(
        "web-config-file",
        ("/flag.yml", "/env.yml", "/file.yml"),
        "web_config_file",
        (Path("/flag.yml"), Path("/env.yml"), Path("/file.yml")),
        id="web-config-file",
    ),
    pytest.param(
        "hostname-label",
        ("hostname", "Hostname", "hostname"),
        "hostname_label",
        ("hostname", "Hostname", "hostname"),
        id="hostname-label",
    ),
    pytest.param(
        "pod-resources-interval",
        ("5", "10", "60"),
        "pod_resources_interval",
        (5.0, 10.0, 60.0),
        id="pod-resources-interval",
    ),
]


@pytest.mark.parametrize(("option", "values", "attr", "expected"), PRECEDENCE_CASES)
def test_precedence_flag_env_file_default(
    tmp_path: Path,
    option: str,
    values: tuple[str, str, str],
    attr: str,
    expected: tuple[object, object, object],
) -> None:
    flag_value, env_value, file_value = values
    env_name = "GPUAGENT_" + option.upper().replace("-", "_")
    cfg = write_config(tmp_path, f"version: v1\n{option}: {file_value}\n")
    config_flag = ["--config", str(cfg)]

    assert (
        getattr(load([*config_flag, f"--{option}", flag_value], {env_name: env_value}), attr)
        == (expected[0])
    )
    assert getattr(load(config_flag, {env_name: env_value}), attr) == expected[1]
    assert getattr(load(config_flag), attr) == expected[2]
    assert getattr(load(), attr) == getattr(load_settings([], {}), attr)


def test_empty_env_value_counts_as_unset(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, "version: v1\nmig-strategy: mixed\n")
    settings = load(["--config", str(cfg)], {"GPUAGENT_MIG_STRATEGY": "", "MIG_STRATEGY": ""})
    assert settings.mig_strategy == "mixed"


@pytest.mark.parametrize(
    ("env_name", "value", "attr", "expected"),
    [
        pytest.param("MIG_STRATEGY", "single", "mig_strategy", "single", id="MIG_STRATEGY"),
        pytest.param(
            "FAIL_ON_INIT_ERROR", "false", "fail_on_init_error", False, id="FAIL_ON_INIT_ERROR"
        ),
        pytest.param(
            "DEVICE_LIST_STRATEGY",
            "volume-mounts",
            "device_list_strategy",
            ("volume-mounts",),
            id="DEVICE_LIST_STRATEGY",
        ),
        pytest.param(
            "DEVICE_ID_STRATEGY", "index", "device_id_strategy", "index", id="DEVICE_ID_STRATEGY"
        ),
        pytest.param(
            "PASS_DEVICE_SPECS", "true", "pass_device_specs", True, id="PASS_DEVICE_SPECS"
        ),
        pytest.param(
            "NVIDIA_DRIVER_ROOT",
            "/run/nvidia/driver",
            "nvidia_driver_root",
            Path("/run/nvidia/driver"),
            id="NVIDIA_DRIVER_ROOT",
        ),
        pytest.param(
            "DP_DISABLE_HEALTHCHECKS",
            "xids,48",
            "disable_healthchecks",
            "xids,48",
            id="DP_DISABLE_HEALTHCHECKS",
        ),
        pytest.param(
            "DP_ENABLE_HEALTHCHECKS",
            "all",
            "enable_healthchecks",
            "all",
            id="DP_ENABLE_HEALTHCHECKS",
        ),
        pytest.param(
            "KUBELET_SOCKET",
            "/k/kubelet.sock",
            "kubelet_socket",
            Path("/k/kubelet.sock"),
            id="KUBELET_SOCKET",
        ),
        pytest.param(  # dcgm-exporter's: a series per pod sharing a GPU, with its own use
            "KUBERNETES_VIRTUAL_GPUS",
            "true",
            "dcgm_container_shares",
            True,
            id="KUBERNETES_VIRTUAL_GPUS",
        ),
    ],
)
def test_nvidia_env_alias(env_name: str, value: str, attr: str, expected: object) -> None:
    assert getattr(load(env={env_name: value}), attr) == expected


def test_config_file_env_alias(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, "version: v1\nmig-strategy: single\n")
    settings = load(env={"CONFIG_FILE": str(cfg)})
    assert settings.config_file == cfg
    assert settings.mig_strategy == "single"


@pytest.mark.parametrize(
    ("ours", "alias", "attr", "expected"),
    [
        pytest.param(
            ("GPUAGENT_MIG_STRATEGY", "mixed"),
            ("MIG_STRATEGY", "single"),
            "mig_strategy",
            "mixed",
            id="mig-strategy",
        ),
        pytest.param(
            ("GPUAGENT_FAIL_ON_INIT_ERROR", "true"),
            ("FAIL_ON_INIT_ERROR", "false"),
            "fail_on_init_error",
            True,
            id="fail-on-init-error",
        ),
        pytest.param(
            ("GPUAGENT_DISABLE_HEALTHCHECKS", "48"),
            ("DP_DISABLE_HEALTHCHECKS", "all"),
            "disable_healthchecks",
            "48",
            id="disable-healthchecks",
        ),
        pytest.param(
            ("GPUAGENT_NVIDIA_DRIVER_ROOT", "/ours"),
            ("NVIDIA_DRIVER_ROOT", "/theirs"),
            "nvidia_driver_root",
            Path("/ours"),
            id="nvidia-driver-root",
        ),
    ],
)
def test_gpuagent_env_beats_alias(
    ours: tuple[str, str], alias: tuple[str, str], attr: str, expected: object
) -> None:
    assert getattr(load(env=dict([ours, alias])), attr) == expected


def test_alias_error_names_alias() -> None:
    err = config_error(env={"MIG_STRATEGY": "bogus"})
    assert err.key == "MIG_STRATEGY"
    assert str(err) == "MIG_STRATEGY: must be one of none, single, mixed, got 'bogus'"


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        pytest.param(["--nvidia-driver-root", "/d"], Path("/d"), id="canonical"),
        pytest.param(["--driver-root", "/d"], Path("/d"), id="nvidia-flag-alias"),
    ],
)
def test_driver_root_flags(argv: list[str], expected: Path) -> None:
    assert load(argv).nvidia_driver_root == expected


def test_config_file_flag_alias_names_its_spelling() -> None:
    err = config_error(["--config-file="])
    assert err.key == "--config-file"


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        pytest.param(["--fail-on-init-error"], True, id="bare"),
        pytest.param(["--fail-on-init-error=true"], True, id="eq-true"),
        pytest.param(["--fail-on-init-error=false"], False, id="eq-false"),
        pytest.param(["--fail-on-init-error=FALSE"], False, id="eq-FALSE"),
        pytest.param(["--fail-on-init-error=0"], False, id="eq-0"),
        pytest.param(["--fail-on-init-error=no"], False, id="eq-no"),
        pytest.param(
            ["--fail-on-init-error=false", "--fail-on-init-error"], True, id="last-wins-bare"
        ),
        pytest.param(
            ["--fail-on-init-error", "--fail-on-init-error=false"], False, id="last-wins-eq"
        ),
    ],
)
def test_bool_flag_forms(argv: list[str], expected: bool) -> None:
    assert load(argv).fail_on_init_error is expected


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        pytest.param("true", True, id="true"),
        pytest.param("True", True, id="True"),
        pytest.param("false", False, id="false"),
        pytest.param("1", True, id="1"),
        pytest.param("0", False, id="0"),
        pytest.param("yes", True, id="yes"),
        pytest.param("NO", False, id="NO"),
    ],
)
def test_bool_env_forms(value: str, expected: bool) -> None:
    assert load(env={"GPUAGENT_PASS_DEVICE_SPECS": value}).pass_device_specs is expected


@pytest.mark.parametrize(
    ("argv", "env", "key"),
    [
        pytest.param(["--pass-device-specs=maybe"], {}, "--pass-device-specs", id="flag"),
        pytest.param(["--pass-device-specs="], {}, "--pass-device-specs", id="flag-empty"),
        pytest.param([], {"PASS_DEVICE_SPECS": "2"}, "PASS_DEVICE_SPECS", id="env-alias"),
        pytest.param(
            [], {"GPUAGENT_FAIL_ON_INIT_ERROR": "on"}, "GPUAGENT_FAIL_ON_INIT_ERROR", id="env"
        ),
    ],
)
def test_bad_bool_names_source(argv: list[str], env: dict[str, str], key: str) -> None:
    err = config_error(argv, env)
    assert err.key == key
    assert "expected true or false" in str(err)


def test_bool_flag_does_not_take_separate_value(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        load(["--fail-on-init-error", "false"])
    assert info.value.code == 2
    assert "unrecognized arguments: false" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        pytest.param("fail-on-init-error: false", False, id="yaml-false"),
        pytest.param("fail-on-init-error: true", True, id="yaml-true"),
        pytest.param("fail-on-init-error: 'false'", False, id="yaml-string-false"),
    ],
)
def test_bool_in_file(tmp_path: Path, body: str, expected: bool) -> None:
    cfg = write_config(tmp_path, f"version: v1\n{body}\n")
    assert load(["--config", str(cfg)]).fail_on_init_error is expected


@pytest.mark.parametrize(
    ("address", "host", "port"),
    [
        pytest.param(":9400", "", 9400, id="all-interfaces"),
        pytest.param("127.0.0.1:0", "127.0.0.1", 0, id="ipv4-any-port"),
        pytest.param("[::1]:9400", "::1", 9400, id="ipv6"),
        pytest.param("[::]:65535", "::", 65535, id="ipv6-any-max-port"),
        pytest.param("localhost:8080", "localhost", 8080, id="hostname"),
    ],
)
def test_metrics_address_valid(address: str, host: str, port: int) -> None:
    settings = load(["--metrics-address", address])
    assert (settings.metrics_host, settings.metrics_port) == (host, port)


@pytest.mark.parametrize(
    "address",
    [
        pytest.param("9400", id="no-colon"),
        pytest.param("host:", id="no-port"),
        pytest.param("host:99999", id="port-too-big"),
        pytest.param("host:-1", id="negative-port"),
        pytest.param("host:http", id="named-port"),
        pytest.param("::1:9400", id="ipv6-without-brackets"),
        pytest.param("[nope]:9400", id="brackets-not-ipv6"),
        pytest.param("bad host:9400", id="space-in-host"),
        pytest.param("", id="empty"),
    ],
)
def test_metrics_address_invalid(address: str) -> None:
    err = config_error([f"--metrics-address={address}"])
    assert err.key == "--metrics-address"


def test_metrics_address_invalid_from_env() -> None:
    err = config_error(env={"GPUAGENT_METRICS_ADDRESS": "9400"})
    assert err.key == "GPUAGENT_METRICS_ADDRESS"
    assert str(err) == "GPUAGENT_METRICS_ADDRESS: expected HOST:PORT (e.g. ':9400'), got '9400'"


@pytest.mark.parametrize(
    "name",
    [
        pytest.param("nvidia.com/gpu", id="default"),
        pytest.param("example.com/mig-1g.5gb", id="mig-profile"),
        pytest.param("example.com/" + "a" * 51, id="63-chars"),
    ],
)
def test_resource_name_valid(name: str) -> None:
    settings = load(["--resource-name", name])
    assert settings.resource_name == name
    # What the flag accepts, the plan serves: one validator (NVIDIA's rules) for both.
    assert make_plan(settings).serving.resources.resource_name == name


def test_resource_name_without_a_domain_is_nvidias() -> None:
    assert load(["--resource-name", "gpu"]).resource_name == "nvidia.com/gpu"


@pytest.mark.parametrize(
    "name",
    [
        pytest.param("a.b-c.io/G_P.U", id="mixed-case-name"),
        pytest.param("example.com/" + "a" * 52, id="64-chars-in-all"),
        pytest.param("kubernetes.io/gpu", id="kubernetes-io"),
        pytest.param("foo.kubernetes.io/gpu", id="kubernetes-io-subdomain"),
        pytest.param("requests.nvidia.com/gpu", id="requests-prefix"),
        pytest.param("nvidia.com/", id="empty-name"),
        pytest.param("nvidia.com/" + "a" * 64, id="64-chars"),
        pytest.param("/gpu", id="empty-prefix"),
        pytest.param("Nvidia.com/gpu", id="upper-case-prefix"),
        pytest.param("nvidia.com/gpu/x", id="two-slashes"),
        pytest.param("nvidia.com/-gpu", id="leading-dash"),
        pytest.param("nvidia.com/gpu.", id="trailing-dot"),
    ],
)
def test_resource_name_invalid(name: str) -> None:
    err = config_error(["--resource-name", name])
    assert err.key == "--resource-name"


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        pytest.param("envvar", ("envvar",), id="envvar"),
        pytest.param("volume-mounts,envvar", ("volume-mounts", "envvar"), id="keeps-order"),
        pytest.param("envvar, cdi-cri", ("envvar", "cdi-cri"), id="spaces"),
        pytest.param("envvar,envvar,cdi-cri,envvar", ("envvar", "cdi-cri"), id="dedupe"),
        pytest.param("cdi-annotations", ("cdi-annotations",), id="cdi-annotations"),
        pytest.param(
            "cdi-annotations,volume-mounts",
            ("cdi-annotations", "volume-mounts"),
            id="cdi-annotations-with-mounts",
        ),
    ],
)
def test_device_list_strategy_valid(value: str, expected: tuple[str, ...]) -> None:
    assert load(["--device-list-strategy", value]).device_list_strategy == expected


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        pytest.param("cdi-annotations,cdi-cri", "cannot be combined", id="both-cdi"),
        pytest.param("envvar,nope", "unknown strategy 'nope'", id="unknown"),
        pytest.param("", "empty entries", id="empty"),
        pytest.param("envvar,", "empty entries", id="trailing-comma"),
        pytest.param("ENVVAR", "unknown strategy", id="case-sensitive"),
    ],
)
def test_device_list_strategy_invalid(value: str, reason: str) -> None:
    err = config_error([f"--device-list-strategy={value}"])
    assert err.key == "--device-list-strategy"
    assert reason in err.reason


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        pytest.param("device-list-strategy: envvar,cdi-cri", ("envvar", "cdi-cri"), id="string"),
        pytest.param(
            "device-list-strategy: [volume-mounts, envvar]", ("volume-mounts", "envvar"), id="list"
        ),
    ],
)
def test_device_list_strategy_in_file(tmp_path: Path, body: str, expected: tuple[str, ...]) -> None:
    cfg = write_config(tmp_path, f"version: v1\n{body}\n")
    assert load(["--config", str(cfg)]).device_list_strategy == expected


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        pytest.param(["--device-id-strategy", "index"], ("index", "none"), id="index"),
        pytest.param(["--mig-strategy", "single"], ("uuid", "single"), id="mig-single"),
    ],
)
def test_strategies(argv: list[str], expected: tuple[str, str]) -> None:
    settings = load(argv)
    assert (settings.device_id_strategy, settings.mig_strategy) == expected


def test_device_id_strategy_error_message() -> None:
    err = config_error(["--device-id-strategy", "foo"])
    assert err.key == "--device-id-strategy"
    assert str(err) == "--device-id-strategy: must be one of uuid, index, got 'foo'"


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        pytest.param("1", 1, id="min"),
        pytest.param("8", 8, id="eight"),
        pytest.param("64", 64, id="max"),
    ],
)
def test_simulate_valid(value: str, expected: int) -> None:
    assert load(["--simulate", value]).simulate == expected


@pytest.mark.parametrize(
    "value",
    [
        pytest.param("0", id="zero"),
        pytest.param("65", id="too-many"),
        pytest.param("-1", id="negative"),
        pytest.param("2.5", id="fraction"),
        pytest.param("two", id="word"),
    ],
)
def test_simulate_invalid(value: str) -> None:
    err = config_error([f"--simulate={value}"])
    assert err.key == "--simulate"


@pytest.mark.parametrize(
    ("argv", "env", "key"),
    [
        pytest.param(["--simulate", "2", "--sim-config", "n.yaml"], {}, "--sim-config", id="flags"),
        pytest.param(
            ["--simulate", "2"],
            {"GPUAGENT_SIM_CONFIG": "n.yaml"},
            "GPUAGENT_SIM_CONFIG",
            id="mixed",
        ),
    ],
)
def test_simulate_excludes_sim_config(argv: list[str], env: dict[str, str], key: str) -> None:
    err = config_error(argv, env)
    assert err.key == key
    assert "cannot be combined with" in err.reason


@pytest.mark.parametrize("dra", ["all", "0", "GPU-abc"])
def test_dra_needs_kubernetes(dra: str) -> None:
    err = config_error(["--kubernetes=false", "--dra-gpus", dra])
    assert err.key == "--dra-gpus"
    assert "cannot be combined with --kubernetes false" in err.reason


def test_no_dra_without_kubernetes_is_fine() -> None:
    settings = load(["--kubernetes=false", "--dra-gpus", "none"])
    assert (settings.kubernetes, settings.dra_gpus) == (False, "none")


def test_sim_config_alone() -> None:
    settings = load(["--sim-config", "node.yaml"])
    assert (settings.sim_config, settings.simulate) == (Path("node.yaml"), None)


@pytest.mark.parametrize(
    ("value", "ok"),
    [
        pytest.param("0.5", True, id="half-second"),
        pytest.param("3600", True, id="max"),
        pytest.param("0", False, id="zero"),
        pytest.param("-1", False, id="negative"),
        pytest.param("3601", False, id="too-long"),
        pytest.param("nan", False, id="nan"),
        pytest.param("inf", False, id="inf"),
        pytest.param("soon", False, id="word"),
    ],
)
def test_poll_interval(value: str, ok: bool) -> None:
    if ok:
        assert load(["--poll-interval", value]).poll_interval == float(value)
    else:
        assert config_error(["--poll-interval", value]).key == "--poll-interval"


@pytest.mark.parametrize(
    ("value", "ok"),
    [("1", True), ("90.5", True), ("0.5", False), ("0", False), ("-3", False), ("inf", False),
     ("x", False), ("3601", False)],
)  # fmt: skip
def test_nvml_timeout(value: str, ok: bool) -> None:
    """--nvml-timeout: seconds from 1 to an hour; unset, it scales with the GPU count."""
    if ok:
        assert load(["--nvml-timeout", value]).nvml_timeout == float(value)
    else:
        with pytest.raises(ConfigError) as caught:
            load(["--nvml-timeout", value])
        assert caught.value.key == "--nvml-timeout"


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        pytest.param("debug", "debug", id="debug"),
        pytest.param("WARNING", "warning", id="upper-case"),
    ],
)
def test_log_level(value: str, expected: str) -> None:
    assert load(["--log-level", value]).log_level == expected


@pytest.mark.parametrize(
    ("argv", "key"),
    [
        pytest.param(["--log-level", "verbose"], "--log-level", id="log-level"),
        pytest.param(["--log-format", "text"], "--log-format", id="log-format"),
        pytest.param(["--socket-dir="], "--socket-dir", id="empty-path"),
        pytest.param(["--mig-strategy", "Mixed"], "--mig-strategy", id="mig-case-sensitive"),
    ],
)
def test_invalid_flag_names_flag(argv: list[str], key: str) -> None:
    assert config_error(argv).key == key


@pytest.mark.parametrize(
    ("argv", "env", "file_body", "expected"),
    [
        pytest.param(
            [], {}, "", Path("/var/lib/kubelet/device-plugins/kubelet.sock"), id="default"
        ),
        pytest.param(["--socket-dir", "/flag"], {}, "", Path("/flag/kubelet.sock"), id="flag-dir"),
        pytest.param(
            [], {"GPUAGENT_SOCKET_DIR": "/env"}, "", Path("/env/kubelet.sock"), id="env-dir"
        ),
        pytest.param([], {}, "socket-dir: /file", Path("/file/kubelet.sock"), id="file-dir"),
        pytest.param(
            ["--socket-dir", "/flag"],
            {"GPUAGENT_SOCKET_DIR": "/env"},
            "socket-dir: /file",
            Path("/flag/kubelet.sock"),
            id="flag-dir-wins",
        ),
        pytest.param(
            ["--socket-dir", "/flag"],
            {},
            "kubelet-socket: /file/k.sock",
            Path("/file/k.sock"),
            id="explicit-file-socket",
        ),
        pytest.param(
            ["--kubelet-socket", "/k.sock"],
            {"GPUAGENT_SOCKET_DIR": "/env"},
            "",
            Path("/k.sock"),
            id="explicit-flag-socket",
        ),
    ],
)
def test_kubelet_socket_follows_effective_socket_dir(
    tmp_path: Path, argv: list[str], env: dict[str, str], file_body: str, expected: Path
) -> None:
    cfg = write_config(tmp_path, f"version: v1\n{file_body}\n")
    assert load(["--config", str(cfg), *argv], env).kubelet_socket == expected


def test_full_config_file(tmp_path: Path) -> None:
    cfg = write_config(
        tmp_path,
        """\
version: v1
socket-dir: /dp
pod-resources-socket: /pr.sock
metrics-address: "[::1]:9500"
sim-config: node.yaml
resource-name: example.com/gpu
device-list-strategy: [cdi-cri]
device-id-strategy: index
mig-strategy: mixed
fail-on-init-error: false
pass-device-specs: true
nvidia-driver-root: /run/nvidia/driver
disable-healthchecks: [48, 63]
enable-healthchecks: all
poll-interval: 2
log-format: console
log-level: debug
web-config-file: /etc/gpuagent/web.yml
hostname-label: hostname
no-hostname: true
pod-resources-interval: 12.5
sharing:
  timeSlicing:
    renameByDefault: true
    resources: [{name: nvidia.com/gpu, replicas: 4}]
shared-devices-allocation-policy: packed
mps-root: /var/run/mps
mps-compute-mode: unchanged
cdi-annotation-prefix: example.com/
cdi-spec-dir: /etc/cdi
cdi-spec: toolkit
nvidia-cdi-hook-path: /usr/local/nvidia/toolkit/nvidia-cdi-hook
driver-root-ctr-path: /driver-root
node-labels: false
node-labels-file: /tmp/features
machine-type-file: /host/product_name
dra-gpus: [0, GPU-abc]
dra-driver-name: gpu.example.com
dra-mig: dynamic
plugins-registry-dir: /pr
plugins-dir: /p
kubeconfig: /etc/kube.conf
node-condition: false
events: true
taint-unhealthy-node: true
node-condition-heartbeat: 3600
container-accounting: false
proc-root: /host/proc
container-logs-dir: /host/var/log/containers
cri-socket: /run/k3s/containerd/containerd.sock
dcgm-series-per-container: true
dcgm-container-shares: true
detailed-agent-metrics: true
nvml-timeout: 120
""",
    )
    assert load(["--config", str(cfg)], {"NODE_NAME": "node-7"}).as_dict() == {
        "socket_dir": "/dp",
        "kubelet_socket": "/dp/kubelet.sock",
        "pod_resources_socket": "/pr.sock",
        "metrics_host": "::1",
        "metrics_port": 9500,
        "config_file": str(cfg),
        "simulate": None,
        "sim_config": "node.yaml",
        "resource_name": "example.com/gpu",
        "device_list_strategy": ["cdi-cri"],
        "device_id_strategy": "index",
        "mig_strategy": "mixed",
        "fail_on_init_error": False,
        "pass_device_specs": True,
        "nvidia_driver_root": "/run/nvidia/driver",
        "disable_healthchecks": "48,63",
        "enable_healthchecks": "all",
        "poll_interval": 2.0,
        "log_format": "console",
        "log_level": "debug",
        "web_config_file": "/etc/gpuagent/web.yml",
        "hostname_label": "hostname",
        "no_hostname": True,
        "pod_resources_interval": 12.5,
        "sharing": {
            "timeSlicing": {
                "renameByDefault": True,
                "failRequestsGreaterThanOne": False,
                "resources": [{"name": "nvidia.com/gpu", "replicas": 4}],
            }
        },
        "shared_devices_allocation_policy": "packed",
        "cdi_annotation_prefix": "example.com/",
        "cdi_spec_dir": "/etc/cdi",
        "cdi_spec": "toolkit",
        "nvidia_cdi_hook_path": "/usr/local/nvidia/toolkit/nvidia-cdi-hook",
        "driver_root_ctr_path": "/driver-root",
        "node_labels": False,
        "node_labels_file": "/tmp/features",
        "machine_type_file": "/host/product_name",
        "dra_gpus": "0,GPU-abc",
        "dra_driver_name": "gpu.example.com",
        "dra_mig": "dynamic",
        "dra_sharing": "none",
        "plugins_registry_dir": "/pr",
        "plugins_dir": "/p",
        "kubeconfig": "/etc/kube.conf",
        "node_condition": False,
        "events": True,
        "taint_unhealthy_node": True,
        "node_condition_heartbeat": 3600.0,
        "container_accounting": False,
        "proc_root": "/host/proc",
        "container_logs_dir": "/host/var/log/containers",
        "cri_socket": "/run/k3s/containerd/containerd.sock",
        "dcgm_series_per_container": True,
        "dcgm_container_shares": True,
        "detailed_agent_metrics": True,
        "kubernetes": True,
        "node_name": "node-7",
        "check_config": None,
        "nvml_timeout": 120.0,
        "mps_root": "/var/run/mps",
        "mps_compute_mode": "unchanged",
    }


@pytest.mark.parametrize(
    ("body", "key", "reason"),
    [
        pytest.param(
            "mig-strategy: none\n", "--config", "must declare 'version: v1'", id="no-version"
        ),
        pytest.param(
            "version: v2\n",
            "config file key 'version'",
            "unsupported version 'v2'",
            id="wrong-version",
        ),
        pytest.param(
            "version: 1\n",
            "config file key 'version'",
            "unsupported version 1",
            id="version-not-string",
        ),
        pytest.param(
            "version: v1\nsokcet-dir: /x\n",
            "config file key 'sokcet-dir'",
            "gpuagent.yaml (did you mean 'socket-dir'?)",
            id="unknown-key",
        ),
        pytest.param(
            "version: v1\nconfig: other.yaml\n",
            "config file key 'config'",
            "not a setting of the file (the file is chosen by --config or GPUAGENT_CONFIG)",
            id="config-key",
        ),
        pytest.param(
            "version: v1\nmig-strategy: [none]\n",
            "config file key 'mig-strategy'",
            "expected a string, got list",
            id="bad-type-string",
        ),
        pytest.param(
            "version: v1\nfail-on-init-error: 3\n",
            "config file key 'fail-on-init-error'",
            "expected true or false",
            id="bad-type-bool",
        ),
        pytest.param(
            "version: v1\nsimulate: true\n",
            "config file key 'simulate'",
            "expected a whole number",
            id="bad-type-int",
        ),
        pytest.param(
            "version: v1\nsocket-dir: 5\n",
            "config file key 'socket-dir'",
            "expected a string, got int",
            id="bad-type-path",
        ),
        pytest.param(
            "version: v1\npoll-interval: fast\n",
            "config file key 'poll-interval'",
            "expected a number of seconds",
            id="bad-type-float",
        ),
        pytest.param(
            "version: v1\nmig-strategy: sometimes\n",
            "config file key 'mig-strategy'",
            "must be one of none, single, mixed, got 'sometimes'",
            id="bad-value",
        ),
        pytest.param(
            "version: v1\nsocket-dir:\n",
            "config file key 'socket-dir'",
            "expected a string, got null",
            id="null-value",
        ),
        pytest.param(
            "version: v1\nsocket-dir: [\n",
            "--config",
            "gpuagent.yaml:3:1: expected the node content, but found '<stream end>' "
            "(while parsing a flow node)",
            id="yaml-syntax",
        ),
        pytest.param("- version: v1\n", "--config", "must hold a mapping", id="not-a-mapping"),
        pytest.param("", "--config", "must hold a mapping of settings, got null", id="empty-file"),
        pytest.param(
            "version: v1\nsocket-dir: /a\nsocket-dir: /b\n",
            "--config",
            "gpuagent.yaml:3:1: duplicate key 'socket-dir'",
            id="duplicate-key",
        ),
    ],
)
def test_config_file_errors(tmp_path: Path, body: str, key: str, reason: str) -> None:
    cfg = write_config(tmp_path, body)
    err = config_error(["--config", str(cfg)])
    assert err.key == key
    assert reason in err.reason
    assert str(err) == f"{key}: {err.reason}"


def test_missing_config_file(tmp_path: Path) -> None:
    missing = tmp_path / "absent.yaml"
    err = config_error(env={"GPUAGENT_CONFIG": str(missing)})
    assert err.key == "GPUAGENT_CONFIG"
    assert str(err) == f"GPUAGENT_CONFIG: cannot read {missing}: No such file or directory"


def test_config_file_not_read_when_flag_overrides_env(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, "version: v1\nmig-strategy: mixed\n")
    settings = load(["--config", str(cfg)], {"GPUAGENT_CONFIG": str(tmp_path / "absent.yaml")})
    assert (settings.config_file, settings.mig_strategy) == (cfg, "mixed")


def test_flag_value_beats_bad_file_value(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, "version: v1\nmig-strategy: sometimes\n")
    assert load(["--config", str(cfg), "--mig-strategy", "single"]).mig_strategy == "single"


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
