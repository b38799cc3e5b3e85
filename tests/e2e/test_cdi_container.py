"""A real CDI consumer runs a container from the spec the agent writes.

The agent runs on simulated GPUs with ``--device-list-strategy cdi-cri`` and a fake driver root
(libraries named by the simulated driver's version, tools, a socket, firmware and — created with
``mknod`` — device nodes that are ``/dev/null`` underneath). The name ``Allocate`` hands the
kubelet is given to Debian's podman, which applies the spec: device nodes, read-only mounts,
environment and ``createContainer`` hooks. The hook binary is a stand-in for the toolkit's
``nvidia-cdi-hook`` (a small Python script implementing ``create-symlinks`` and writing the
folders ``update-ldcache`` would pass to ``ldconfig``), so the run shows the hooks' arguments
take effect inside the container.

podman 4.3 reads specs only from ``/etc/cdi`` and ``/var/run/cdi``: the agent's spec is copied to
``/var/run/cdi`` under a unique name for the run, with a lock so that two test runs on one machine
never define the same kind twice. Needs root, podman, runc and busybox-static (``.ci/run``
installs them): skipped without them, failed under ``CI``.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.driverroot import LIBDIR, make_driver_root
from support.fake_kubelet import FakeKubelet
from support.podman import PODMAN, RUN_LIMITS
from support.required import unavailable
from support.waiting import eventually

from e2e.agentrun import registered_agent
from gpuagent.gpu.sim.spec import DRIVER_VERSION, node_from_count
from gpuagent.nodefiles.driverfiles import sysfs_address

T = 10.0
CDI_DIR = Path("/var/run/cdi")
LOCK = Path("/run/lock/gpuagent-cdi-container-test.lock")
PODMAN_RUN = (*PODMAN, "run", "--rm", "--network", "none", *RUN_LIMITS)
HOOK = """\
#!{python}
# Stand-in for the container toolkit's nvidia-cdi-hook: runs in the container's mount namespace
# before pivot_root, with the OCI state on stdin.
import json, os, sys
state = json.load(sys.stdin)
with open(os.path.join(state["bundle"], "config.json")) as f:
    root = json.load(f)["root"]["path"]
root = os.path.join(state["bundle"], root)
with open({log!r}, "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
name, args = sys.argv[1], sys.argv[2:]
pairs = list(zip(args[0::2], args[1::2]))
if name == "create-symlinks":
    for flag, value in pairs:
        assert flag == "--link", flag
        target, link = value.split("::")
        path = os.path.join(root, link.lstrip("/"))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        os.symlink(target, path)
elif name == "update-ldcache":
    folders = [value for flag, value in pairs if flag == "--folder"]
    os.makedirs(os.path.join(root, "etc/ld.so.conf.d"), exist_ok=True)
    with open(os.path.join(root, "etc/ld.so.conf.d/00-gpuagent-test.conf"), "w") as f:
        f.write("".join(d + "\\n" for d in folders))
else:
    sys.exit("unknown hook " + name)
"""


@pytest.fixture(scope="module")
def busybox() -> str:
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        unavailable("podman applies CDI specs here as root only")
    missing = [t for t in ("podman", "runc") if shutil.which(t) is None]
    path = shutil.which("busybox")
    if missing or path is None:
        unavailable(f"not installed: {', '.join(missing) or 'busybox'} (apt-get install "
                    "podman runc busybox-static)")  # fmt: skip
    assert path is not None
    return path


def rootfs(where: Path, busybox: str) -> Path:
    """A fresh root file system holding only busybox (podman leaves mount points behind)."""
    (where / "bin").mkdir(parents=True)
    shutil.copy(busybox, where / "bin" / "busybox")
    return where


@contextlib.contextmanager
def published(spec_file: Path) -> Iterator[Path]:
    """The spec copied into the runtime's CDI directory for the duration, one test at a time."""
    LOCK.parent.mkdir(parents=True, exist_ok=True)
    with LOCK.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        CDI_DIR.mkdir(parents=True, exist_ok=True)
        target = CDI_DIR / f"gpuagent-test-{os.getpid()}.json"
        shutil.copy(spec_file, target)
        try:
            yield target
        finally:
            target.unlink(missing_ok=True)


def podman(device: str, root: Path, script: str) -> subprocess.CompletedProcess[str]:
    command = [*PODMAN_RUN, "--device", device, "--rootfs", str(root), "/bin/busybox", "sh", "-c"]
    return subprocess.run(
        [*command, script],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def check_podman_runs(root: Path) -> None:
    """Whether podman can start any container here (else: skipped, or failed under CI)."""
    result = subprocess.run(
        [*PODMAN_RUN, "--rootfs", str(root), "/bin/busybox", "true"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if result.returncode != 0:
        unavailable(f"podman cannot run a container here: {result.stderr.strip()[-500:]}")


SCRIPT = f"""
set -e
echo "env=$NVIDIA_VISIBLE_DEVICES"
for n in /dev/nvidia*; do echo "node=$n"; done
for n in /dev/dri/card* /dev/dri/renderD*; do echo "node=$n"; done
for l in /dev/dri/by-path/*; do echo "link=$l->$(readlink $l)"; done
for l in {LIBDIR}/*.so*; do
  if [ -L "$l" ]; then echo "link=$l->$(readlink $l)"; else echo "file=$l"; fi
done
echo "cuda=$(cat {LIBDIR}/libcuda.so.1)"
echo "smi=$(/usr/bin/nvidia-smi)"
echo "persistenced=$(test -e /var/run/nvidia-persistenced/socket && echo yes)"
echo "firmware=$(ls /lib/firmware/nvidia/{DRIVER_VERSION} | tr '\\n' ' ')"
echo "ldconf=$(cat /etc/ld.so.conf.d/00-gpuagent-test.conf | tr '\\n' ' ')"
echo "writable=$(touch {LIBDIR}/libcuda.so.1 2>/dev/null && echo yes || echo no)"
"""


def lines(output: str, key: str) -> list[str]:
    return [line.split("=", 1)[1] for line in output.splitlines() if line.startswith(key + "=")]


async def test_a_container_started_from_the_spec_sees_the_driver(
    fake_kubelet: FakeKubelet, device_plugin_dir: Path, short_tmp_path: Path, busybox: str
) -> None:
    check_podman_runs(rootfs(short_tmp_path / "probe-rootfs", busybox))
    sim = node_from_count(2)
    driver = short_tmp_path / "driver-root"
    fake = make_driver_root(
        driver,
        version=DRIVER_VERSION,
        gpu_minors=tuple(g.minor for g in sim.gpus),
        bus_ids=tuple(g.pci_bus_id for g in sim.gpus),
    )
    assert fake.has_device_nodes
    (driver / "usr/bin/nvidia-smi").write_text("#!/bin/busybox sh\necho fake nvidia-smi\n")
    hook_log = short_tmp_path / "hook.log"
    hook = short_tmp_path / "toolkit" / "nvidia-cdi-hook"
    hook.parent.mkdir()
    hook.write_text(HOOK.format(python=sys.executable, log=str(hook_log)))
    hook.chmod(0o755)
    cdi_dir = short_tmp_path / "cdi"
    args = ("--simulate", "2", "--device-list-strategy", "cdi-cri",
            "--cdi-spec-dir", str(cdi_dir), "--nvidia-driver-root", str(driver),
            "--nvidia-cdi-hook-path", str(hook), "--node-labels=false")  # fmt: skip
    async with registered_agent(fake_kubelet, device_plugin_dir, args) as run:
        spec_file = cdi_dir / "k8s.device-plugin.nvidia.com-gpu.json"
        await eventually(spec_file.exists, what=f"{spec_file} written")
        spec = json.loads(spec_file.read_text())
        uuid = run.uuids[0]
        response = await asyncio.to_thread(fake_kubelet.allocate, [uuid])
        (name,) = [c.name for c in response.container_responses[0].cdi_devices]
    assert name == f"k8s.device-plugin.nvidia.com/gpu={uuid}"
    assert spec["cdiVersion"] == "0.5.0"

    with published(spec_file):
        one = podman(name, rootfs(short_tmp_path / "rootfs-1", busybox), SCRIPT)
        every = podman(
            "k8s.device-plugin.nvidia.com/gpu=all",
            rootfs(short_tmp_path / "rootfs-all", busybox),
            SCRIPT,
        )
    assert one.returncode == 0, one.stderr
    assert every.returncode == 0, every.stderr
    out = one.stdout
    assert lines(out, "env") == ["void"]
    # The device's own node and DRM nodes, the control nodes; not the other GPU's.
    assert lines(out, "node") == [
        "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia0", "/dev/nvidiactl",
        "/dev/dri/card1", "/dev/dri/renderD128",
    ]  # fmt: skip
    address = sysfs_address(sim.gpus[0].pci_bus_id)
    assert f"/dev/dri/by-path/pci-{address}-card->../card1" in lines(out, "link")
    assert "/dev/nvidia1" in lines(every.stdout, "node")
    # Libraries mounted from the driver root; links made by the create-symlinks hook.
    v = DRIVER_VERSION
    assert {f"{LIBDIR}/libcuda.so.{v}", f"{LIBDIR}/libnvidia-ml.so.{v}"} <= set(lines(out, "file"))
    assert f"{LIBDIR}/libcuda.so.535.104.05" not in lines(out, "file")  # another version's
    links = lines(out, "link")
    assert f"{LIBDIR}/libcuda.so.1->libcuda.so.{v}" in links
    assert f"{LIBDIR}/libcuda.so->libcuda.so.1" in links
    assert f"{LIBDIR}/libnvidia-ml.so.1->libnvidia-ml.so.{v}" in links
    assert lines(out, "cuda") == [f"fake {LIBDIR}/libcuda.so.{v}"]
    assert lines(out, "writable") == ["no"]  # read-only bind mounts
    assert lines(out, "smi") == ["fake nvidia-smi"]
    assert lines(out, "persistenced") == ["yes"]
    assert lines(out, "firmware") == ["gsp_ga10x.bin gsp_tu10x.bin "]
    assert lines(out, "ldconf") == [f"{LIBDIR} {LIBDIR}/vdpau "]
    # The hooks ran with the toolkit's arguments.
    calls = [json.loads(line) for line in hook_log.read_text().splitlines()]
    assert [c[0] for c in calls].count("update-ldcache") == 2  # once per container
