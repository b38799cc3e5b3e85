"""The config file: every key it may set, its errors naming the key, and a flag beating it."""

from __future__ import annotations

from pathlib import Path

import pytest

from config.loading import config_error, load, write_config


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
