"""Each setting's values: the valid ones parsed, an invalid one refused naming its key and where."""

from __future__ import annotations

from pathlib import Path

import pytest

from config.loading import config_error, load, write_config
from gpuagent.config import ConfigError
from gpuagent.config.planning import make_plan


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
