"""What the agent imports before it registers with the kubelet: what registration needs, and none of
the rest (HTTP, metrics, pod-resources, accounting, node files, DRA, the API client), started as the
DaemonSet starts it (its config file and environment) on simulated GPUs, as a plain node and as a
DRA node (``--dra-gpus all``: its credentials are checked before anything starts without the
client, :mod:`gpuagent.kube.credentials`; the side and the client are imported after).

The process is run with ``PYTHONPROFILEIMPORTTIME=1``: the interpreter writes a line to stderr as
each import completes, on the same stream as the agent's log, so every module named before the log
line of the registration was imported before the kubelet had the device plugin.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
from support.fake_apiserver import FakeApiServer
from support.fake_kubelet import FakeKubelet

from e2e.agentprocess import T, free_port, reaped, spawn

pytestmark = pytest.mark.slow

DAEMONSET_CONFIG = Path(__file__).parents[2] / "manifests" / "base" / "config.yaml"
# What the kubelet does not need (the imports of the parts that start with the rest, app/parts/, and
# what is imported only with their options on): none of it may be imported before the
# registration.
NOT_BEFORE_REGISTRATION = (
    "aiohttp",
    "gpuagent.web.server",
    "gpuagent.web.metrics",
    "gpuagent.kubelet.podresources",
    "gpuagent.runtime",
    "gpuagent.nodefiles.cdikeeper",
    "gpuagent.nodefiles.labelkeeper",
    "gpuagent.dra",
    "gpuagent.mps",  # (MPS sharing's daemons: only once the plan shares through MPS)
    "gpuagent.kube.client",
    "gpuagent.kube.nodehealth",
    "lightkube",
    "httpx2",
    "bcrypt",
    "importlib.metadata",  # (betterproto2's version is read without it: overrides.protoversion)
)
# What registration needs: imported before it (a check that the imports are read as they should).
# (A module imported with importlib.import_module, as the agent imports a list of modules off the
# loop, has no line of its own; the modules it imports do.)
BEFORE_REGISTRATION = ("grpclib.server", "gpuagent.kubelet.plugin", "pynvml")


def _imports_before_registration(stderr: str) -> list[str]:
    modules = []
    for line in stderr.splitlines():
        if line.startswith("import time:"):
            name = line.rsplit("|", 1)[1].strip()
            if name != "imported package":  # (the header line)
                modules.append(name)
            continue
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("event") == "registered with kubelet":
            return modules
    raise AssertionError(f"no registration in the agent's log:\n{stderr[-3000:]}")


def _dra_node(root: Path) -> tuple[str, ...]:
    """A DRA node's options: its directories under ``root``, the kubeconfig of an API server
    that is not there (registration with the kubelet needs none)."""
    kubeconfig = FakeApiServer(node="test-node", port=free_port()).kubeconfig(root / "kc")
    return (
        "--dra-gpus=all",
        f"--kubeconfig={kubeconfig}",
        f"--plugins-dir={root / 'plugins'}",
        f"--plugins-registry-dir={root / 'registry'}",
        f"--cdi-spec-dir={root / 'cdi'}",
    )


@pytest.mark.parametrize("dra", [False, True], ids=["plain", "dra"])
def test_the_daemonsets_agent_imports_only_what_registration_needs_before_it(
    fake_kubelet: FakeKubelet, device_plugin_dir: Path, short_tmp_path: Path, dra: bool
) -> None:
    args = (
        f"--config={DAEMONSET_CONFIG}",
        "--simulate=2",
        f"--socket-dir={device_plugin_dir}",
        f"--pod-resources-socket={short_tmp_path / 'pod-resources' / 'kubelet.sock'}",
        f"--metrics-address=127.0.0.1:{free_port()}",
        *(_dra_node(short_tmp_path) if dra else ()),
    )
    env = {
        "NODE_NAME": "test-node",
        "GPUAGENT_CONTAINER_ACCOUNTING": "false",
        "PYTHONPROFILEIMPORTTIME": "1",
    }
    with reaped(spawn(*args, env=env)) as proc:
        fake_kubelet.wait_for_registrations(1, T)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=T)
    assert proc.returncode == 0, stderr[-3000:]
    before = _imports_before_registration(stderr)
    early = [
        m for m in before if any(m == d or m.startswith(f"{d}.") for d in NOT_BEFORE_REGISTRATION)
    ]
    assert early == []
    assert set(BEFORE_REGISTRATION) <= set(before)
