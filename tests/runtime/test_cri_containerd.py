"""Smoke test: the CRI client against a real containerd (Debian's ``containerd`` package).

containerd is started as a child process with a private root, state directory and socket (its CRI
plugin on the native snapshotter, no CNI). Pods cannot be created offline (the sandbox image is
pulled from a registry), so this checks the wire contract: ``Version`` names containerd, and
``ListContainers`` answers (with the node's containers, none here) through the cache.

Skipped, with the reason, where containerd is not installed (failed instead when ``CI`` is set:
``.ci/run`` installs it) or cannot start here (not root, no cgroups); containerd's log is shown.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuagent.runtime.cri import CriClient

START_TIMEOUT_S = 20.0


@pytest.fixture
def containerd(short_tmp_path: Path) -> Iterator[Path]:
    binary = shutil.which("containerd")
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail("containerd is not installed (Debian package containerd; .ci/run does it)")
        pytest.skip("containerd is not installed (Debian package containerd)")
    if os.geteuid() != 0:
        pytest.skip("containerd needs root to start")
    socket = short_tmp_path / "containerd.sock"
    config = short_tmp_path / "config.toml"
    config.write_text(
        f"""version = 2
root = "{short_tmp_path}/root"
state = "{short_tmp_path}/state"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.zfs"]
[grpc]
  address = "{socket}"
[ttrpc]
  address = "{socket}.ttrpc"
[plugins."io.containerd.grpc.v1.cri".containerd]
  snapshotter = "native"
[plugins."io.containerd.grpc.v1.cri".cni]
  bin_dir = "{short_tmp_path}/cni/bin"
  conf_dir = "{short_tmp_path}/cni/conf"
"""
    )
    log = short_tmp_path / "containerd.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [binary, "--config", str(config)], stdout=out, stderr=subprocess.STDOUT
        )
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not socket.exists() or b"serving..." not in log.read_bytes():
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = log.read_text(errors="replace")[-2000:]
                pytest.skip(f"containerd did not start here (exit {proc.poll()}):\n{tail}")
            time.sleep(0.05)
        yield socket
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.asyncio(loop_factories=["asyncio"])
async def test_containerd_answers_version_and_list_containers(containerd: Path) -> None:
    cri = CriClient(containerd, retry_interval=0.0, min_interval=0.0)
    try:
        name, version = await cri.version()
        assert name == "containerd"
        assert version
        names = await cri.resolve({"0" * 64})
        assert cri.requests == 1
        assert cri.errors == 0, "ListContainers failed against containerd"
        assert names == {}
    finally:
        cri.close()
