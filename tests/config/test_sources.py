"""Where a setting comes from: flag over environment over file over default, NVIDIA's variable
names beside gpuagent's, and the forms a boolean takes in each source.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from config.loading import config_error, load, write_config
from gpuagent.config import load_settings

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
