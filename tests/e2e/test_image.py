"""The container image, built as CI builds it and run as the DaemonSet runs it.

``scripts/build-image --debian-base`` builds the Containerfile on a base made from Debian's
packages (neither this machine nor CI reaches a container registry) from wheels made on the host,
with no network in the build. The image then runs under rootful podman as the DaemonSet's
securityContext asks: a read-only root (without the tmpfs podman adds by default), every
capability dropped, no-new-privileges, the runtime's default seccomp profile, and the image's own
user running ``--simulate 2``. The host's network carries ``/healthz`` and ``/metrics``; the
device-plugin directory is bind-mounted and a kubelet stand-in (grpcio, on the host) registers
the plugin through it. What the process really runs with is read from the host's ``/proc``.

Needs root, podman, runc and mmdebstrap (``.ci/run`` installs them): skipped without them,
failed under ``CI``. The first build makes the Debian base (about a minute here), later ones
reuse it by its tag.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.fake_kubelet import FakeKubelet
from support.grpcstubs import StubModules
from support.podman import PODMAN, RUN_LIMITS
from support.required import unavailable
from support.waiting import eventually

BUILD_TIMEOUT = 1200
# The first test builds the image (the Debian base too, on a clean machine): pyproject's limit
# is for everything else.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(BUILD_TIMEOUT + 600)]

ROOT = Path(__file__).resolve().parent.parent.parent
# One tag per test session (two sessions on one machine must not test each other's image),
# removed afterwards; the layers stay cached for the next build.
TAG = f"localhost/gpuagent-test:e2e-{os.getpid()}"
USER = 65532
# What the agent's layers may add to the base (issue 20: at most 60 MB).
ADDED_BUDGET = 60_000_000
# How far docs/install.md's sizes may be from the image's (a dependency's patch release moves them).
DOCS_TOLERANCE_MB = 0.5
T = 30.0


def podman(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*PODMAN, *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def inspect(ref: str) -> dict[str, Any]:
    result = podman("image", "inspect", ref)
    assert result.returncode == 0, result.stderr
    (found,) = json.loads(result.stdout)
    return dict(found)


@pytest.fixture(scope="module")
def image() -> Iterator[str]:
    """The image's ID, built by ``scripts/build-image --debian-base`` from this tree."""
    if os.geteuid() != 0:
        unavailable("the image test runs rootful podman: root only")
    missing = [t for t in ("podman", "runc", "mmdebstrap") if shutil.which(t) is None]
    if missing:
        unavailable(f"not installed: {', '.join(missing)} (apt-get install {' '.join(missing)})")
    result = build_image("--debian-base", TAG, timeout=BUILD_TIMEOUT)
    assert result.returncode == 0, result.stderr[-6000:]
    try:
        yield str(inspect(TAG)["Id"])
    finally:
        podman("untag", TAG)


def build_image(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(ROOT / "scripts" / "build-image"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={**os.environ, "PYTHON": sys.executable},
    )


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        ((), 2, "give either TAG or --context-only DIR"),
        (("--platform", "linux/s390x", "x"), 1, "--platform linux/s390x: not one of linux/amd64"),
        (("--context-only", "/tmp/x", "--debian-base"), 2, "drop --debian-base"),
    ],
)
def test_build_image_refuses_bad_input_in_one_line(
    args: tuple[str, ...], code: int, message: str
) -> None:
    result = build_image(*args)
    assert result.returncode == code, result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_the_image_is_labelled_non_root_and_small(image: str) -> None:
    found = inspect(image)
    config = found["Config"]
    assert config["User"] == f"{USER}:{USER}"
    assert config["Entrypoint"] == ["gpuagent"]
    labels = config["Labels"]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert labels["org.opencontainers.image.version"] == project["version"]
    head = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, check=False
    )
    assert labels["org.opencontainers.image.revision"] == (head.stdout.strip() or "unknown")
    assert re.fullmatch(
        r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", labels["org.opencontainers.image.created"]
    )
    base = labels["org.opencontainers.image.base.name"]
    assert base.startswith("localhost/gpuagent-debian-base:bookworm-"), base
    added = int(found["Size"]) - int(inspect(base)["Size"])
    assert 0 < added <= ADDED_BUDGET, f"the agent's layers add {added / 1e6:.1f} MB"
    measured = (int(inspect(base)["Size"]) / 1e6, added / 1e6, int(found["Size"]) / 1e6)
    assert _documented_sizes() == pytest.approx(measured, abs=DOCS_TOLERANCE_MB), (
        "docs/install.md: the Debian base is {:.1f} MB and the agent's layers add {:.1f} MB, "
        "{:.1f} MB in all".format(*measured)
    )


def _documented_sizes() -> tuple[float, float, float]:
    """The base's, the agent's layers' and the image's size docs/install.md gives, in MB."""
    text = " ".join((ROOT / "docs" / "install.md").read_text(encoding="utf-8").split())
    said = re.search(
        r"the Debian base is ([\d.]+) MB and the agent's layers add ([\d.]+) MB, "
        r"([\d.]+) MB in all",
        text,
    )
    assert said, "docs/install.md no longer gives the image's size"
    base, added, total = (float(v) for v in said.groups())
    return base, added, total


def test_python_loads_the_agent_from_bytecode(image: str) -> None:
    """The read-only root cannot take bytecode: every module the agent imports at start is
    loaded from the .pyc the build compiled (none is stale or missing), stdlib and venv alike."""
    result = podman(
        "run", "--rm", "--network", "none", "--read-only", "--read-only-tmpfs=false",
        *RUN_LIMITS, "--entrypoint", "python3", image,
        "-v", "-c", "import gpuagent.__main__, gpuagent.app.agent",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    loaded = re.findall(r"^# code object from '([^']+)'$", result.stderr, re.MULTILINE)
    assert any(path.startswith("/opt/gpuagent/") for path in loaded)
    compiled = [path for path in loaded if not path.endswith(".pyc")]
    assert not compiled, f"compiled from source at start: {compiled}"


def proc_status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text(encoding="utf-8").splitlines()
    return {key: value.strip() for key, _, value in (line.partition(":") for line in lines)}


def root_mount_options(pid: int) -> list[str]:
    for line in Path(f"/proc/{pid}/mountinfo").read_text(encoding="utf-8").splitlines():
        fields = line.split()
        if fields[4] == "/":
            return fields[5].split(",")
    raise AssertionError(f"no root mount in /proc/{pid}/mountinfo")


@contextlib.contextmanager
def container(image: str, socket_dir: Path, name: str) -> Iterator[str]:
    """The agent's container, as the DaemonSet's securityContext runs it; removed afterwards."""
    result = podman(
        "run", "--detach", "--name", name, "--network", "host",
        "--read-only", "--read-only-tmpfs=false", "--cap-drop", "ALL",
        "--security-opt", "no-new-privileges", *RUN_LIMITS,
        "--volume", f"{socket_dir}:/var/lib/kubelet/device-plugins",
        "--env", "NODE_NAME=test-node",
        image, "--simulate", "2", "--metrics-address", "127.0.0.1:0",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    try:
        yield name
    finally:
        podman("rm", "--force", "--time", "0", name)


def logged_events(name: str) -> list[dict[str, Any]]:
    """The agent's JSON log lines so far (it logs JSON when not on a terminal)."""
    result = podman("logs", name)
    events = []
    for line in (result.stdout + result.stderr).splitlines():
        with contextlib.suppress(ValueError):
            events.append(json.loads(line))
    return events


def http_port(name: str) -> int | None:
    for event in logged_events(name):
        if event.get("event") == "http listening":
            return int(event["port"])
    return None


def http_get(url: str) -> tuple[int | None, str]:
    """The status and body of a GET (no status: nothing answered yet)."""
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return int(response.status), response.read().decode()
    except urllib.error.HTTPError as error:
        return int(error.code), error.read().decode()
    except OSError:
        return None, ""


async def answers(url: str, status: int) -> str:
    """The body of ``url`` once it answers ``status``."""

    def body() -> str | None:
        got, text = http_get(url)
        return text if got == status else None

    text = await eventually(body, within=T, what=f"{url} answering {status}")
    assert text is not None
    return text


@pytest.mark.asyncio(loop_factories=["asyncio"])  # one container run is enough
async def test_the_image_runs_as_the_daemonset_runs_it(
    image: str, short_tmp_path: Path, grpc_stubs: StubModules
) -> None:
    socket_dir = short_tmp_path / "device-plugins"
    socket_dir.mkdir()
    os.chown(socket_dir, USER, USER)
    name = f"gpuagent-test-{os.getpid()}"
    with FakeKubelet(socket_dir, grpc_stubs) as kubelet:
        # The kubelet's socket is root's on a node (the DaemonSet runs the agent as uid 0 for
        # that); here the image's own user is tested, so the stand-in's socket is handed to it.
        os.chown(kubelet.kubelet_socket, USER, USER)
        with container(image, socket_dir, name):
            state = json.loads(podman("inspect", "--format", "{{json .State}}", name).stdout)
            assert state["Running"], state
            pid = int(state["Pid"])
            status = proc_status(pid)
            assert status["Uid"].split() == [str(USER)] * 4, status["Uid"]
            assert status["Gid"].split() == [str(USER)] * 4, status["Gid"]
            for caps in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
                assert int(status[caps], 16) == 0, f"{caps} {status[caps]}"
            assert status["NoNewPrivs"] == "1"
            assert status["Seccomp"] == "2", "the runtime's default seccomp filter"
            assert "ro" in root_mount_options(pid)

            port = await eventually(lambda: http_port(name), within=T, what="http listening")
            url = f"http://127.0.0.1:{port}"
            await answers(url + "/healthz", 200)
            (registration,) = await asyncio.to_thread(kubelet.wait_for_registrations, 1, T)
            assert registration.resource_name == "nvidia.com/gpu"
            update = await asyncio.to_thread(registration.next_update, T)
            assert [d.health for d in update.devices] == ["Healthy", "Healthy"]
            await answers(url + "/readyz", 200)
            temperatures = {
                sample.labels["gpu"]: sample.labels["Hostname"]
                for family in text_string_to_metric_families(await answers(url + "/metrics", 200))
                if family.name == "DCGM_FI_DEV_GPU_TEMP"
                for sample in family.samples
            }
            assert temperatures == {"0": "test-node", "1": "test-node"}
            # Stopped as the kubelet stops it: SIGTERM, exit 0 within the grace period.
            stopped = podman("stop", "--time", "10", name)
            assert stopped.returncode == 0, stopped.stderr
            state = json.loads(podman("inspect", "--format", "{{json .State}}", name).stdout)
            assert state["ExitCode"] == 0, logged_events(name)[-5:]
