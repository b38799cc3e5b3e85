"""A private containerd (Debian's ``containerd`` package) that runs pods offline, for tests.

:class:`PrivateContainerd` starts containerd as a child process with its own root, state
directory, socket and runc root under a temporary directory, its CRI plugin on the native
snapshotter and without CNI (pods use the node's network namespace, as ``hostNetwork`` pods do).
The sandbox ("pause") image is a local one: :func:`busybox_image` writes an OCI image archive of
a static busybox (Debian's ``busybox-static``), imported with ``ctr -n k8s.io images import`` and
named in the CRI plugin's ``sandbox_image``, so nothing is pulled from a registry. The same image
runs the test's containers.

:class:`CriRuntime` runs a pod the way the kubelet does, through the CRI (``RunPodSandbox``,
``CreateContainer`` with the kubelet's labels, ``StartContainer``), with the tests' grpcio stubs
(:mod:`support.grpcstubs`), and tells a container's host PID (``ContainerStatus`` verbose).

Pods get the cgroupfs layout the kubelet gives them (``…/kubepods/<qos>/pod<uid>/<container
id>``) under a parent unique to the test, on cgroup v1 and v2 alike, with runc's cgroupfs driver
(which also works on a systemd host). Leaving is thorough, a failure included: containers and
pods removed through the CRI, containerd stopped, any process still in the test's cgroups or
running a shim of this containerd killed (by PID), mounts under the directory unmounted, the
test's cgroups and the shims' sockets removed.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import platform
import shutil
import signal
import subprocess
import tarfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import grpc

from .grpcstubs import CriStubs

__all__ = [
    "IMAGE",
    "ContainerdUnavailable",
    "CriRuntime",
    "PrivateContainerd",
    "RunningContainer",
    "busybox_image",
]

IMAGE = "localhost/gpuagent-test/busybox:1"
BUSYBOX_CANDIDATES = (Path("/bin/busybox"), Path("/usr/bin/busybox"))
START_TIMEOUT_S = 20.0
CALL_TIMEOUT_S = 30.0
CGROUP_ROOT = Path("/sys/fs/cgroup")
SHIM_SOCKETS = Path("/run/containerd/s")
_ARCH = {"x86_64": "amd64", "aarch64": "arm64", "armv7l": "arm", "ppc64le": "ppc64le"}
_SERVICE = "/runtime.v1.RuntimeService/"


class ContainerdUnavailable(Exception):
    """containerd, runc or a static busybox is missing, or containerd cannot start here."""


def static_busybox() -> Path:
    """A statically linked busybox (it must run in an empty root file system)."""
    for candidate in BUSYBOX_CANDIDATES:
        if candidate.is_file():
            head = candidate.read_bytes()[:4096]
            result = subprocess.run(
                ["ldd", str(candidate)], capture_output=True, text=True, check=False
            )
            if head.startswith(b"\x7fELF") and result.returncode != 0:
                return candidate
    raise ContainerdUnavailable("no static busybox (Debian package busybox-static)")


def _tar_bytes(busybox: Path) -> bytes:
    """The image's one layer: /bin/busybox and nothing else (commands name it absolutely)."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        directory = tarfile.TarInfo("bin")
        directory.type, directory.mode = tarfile.DIRTYPE, 0o755
        tar.addfile(directory)
        data = busybox.read_bytes()
        member = tarfile.TarInfo("bin/busybox")
        member.size, member.mode = len(data), 0o755
        tar.addfile(member, io.BytesIO(data))
    return out.getvalue()


def busybox_image(archive: Path, name: str = IMAGE) -> Path:
    """Write an OCI image archive (image layout in a tar) of a static busybox named ``name``."""
    layer = _tar_bytes(static_busybox())
    arch = _ARCH.get(platform.machine(), platform.machine())
    config = json.dumps(
        {
            "architecture": arch,
            "os": "linux",
            "config": {"Env": ["PATH=/bin"], "Cmd": ["/bin/busybox", "sleep", "2147483647"]},
            "rootfs": {"type": "layers", "diff_ids": [_digest(layer)]},
        }
    ).encode()
    manifest = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": _descriptor("application/vnd.oci.image.config.v1+json", config),
            "layers": [_descriptor("application/vnd.oci.image.layer.v1.tar", layer)],
        }
    ).encode()
    index = {
        "schemaVersion": 2,
        "manifests": [
            {
                **_descriptor("application/vnd.oci.image.manifest.v1+json", manifest),
                "annotations": {"io.containerd.image.name": name},
                "platform": {"architecture": arch, "os": "linux"},
            }
        ],
    }
    files = {
        "oci-layout": json.dumps({"imageLayoutVersion": "1.0.0"}).encode(),
        "index.json": json.dumps(index).encode(),
        **{f"blobs/sha256/{_digest(b)[7:]}": b for b in (layer, config, manifest)},
    }
    with tarfile.open(archive, mode="w") as tar:
        for path, data in files.items():
            member = tarfile.TarInfo(path)
            member.size = len(data)
            tar.addfile(member, io.BytesIO(data))
    return archive


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _descriptor(media_type: str, data: bytes) -> dict[str, Any]:
    return {"mediaType": media_type, "digest": _digest(data), "size": len(data)}


def _config(root: Path, socket: Path, image: str) -> str:
    cri = 'plugins."io.containerd.grpc.v1.cri"'
    return f"""version = 2
root = "{root}/root"
state = "{root}/state"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.zfs"]
[grpc]
  address = "{socket}"
[ttrpc]
  address = "{socket}.ttrpc"
[{cri}]
  sandbox_image = "{image}"
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  # Sandboxes ask for oom_score_adj -998; without CAP_SYS_RESOURCE (a restricted test machine)
  # no lower than containerd's own.
  restrict_oom_score_adj = true
[{cri}.containerd]
  snapshotter = "native"
  default_runtime_name = "runc"
[{cri}.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"
[{cri}.containerd.runtimes.runc.options]
  Root = "{root}/runc"
  SystemdCgroup = false
[{cri}.cni]
  bin_dir = "{root}/cni/bin"
  conf_dir = "{root}/cni/conf"
"""


class PrivateContainerd:
    """containerd with a private root under ``root`` (a short path: sockets live there)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.socket = root / "containerd.sock"
        self.log = root / "containerd.log"
        self.cgroup_parent = f"/gpuagent-test-{uuid.uuid4().hex[:12]}"
        self._proc: subprocess.Popen[bytes] | None = None
        self._shim_sockets: set[str] = set()
        self._made_shim_dir = False

    def __enter__(self) -> Self:
        self.start()
        return self

    def start(self) -> None:
        """Start containerd and import the busybox image; :class:`ContainerdUnavailable` when
        this machine cannot (nothing is left behind then either)."""
        binary = shutil.which("containerd")
        ctr = shutil.which("ctr")
        if binary is None or ctr is None or shutil.which("runc") is None:
            raise ContainerdUnavailable("containerd, ctr or runc is not installed")
        if os.geteuid() != 0:
            raise ContainerdUnavailable("containerd needs root to start")
        archive = busybox_image(self.root / "busybox.tar")
        config = self.root / "config.toml"
        config.write_text(_config(self.root, self.socket, IMAGE), encoding="utf-8")
        self._made_shim_dir = not SHIM_SOCKETS.parent.exists()
        self._shim_sockets = _entries(SHIM_SOCKETS)
        with self.log.open("wb") as out:
            self._proc = subprocess.Popen(
                [binary, "--config", str(config)], stdout=out, stderr=subprocess.STDOUT
            )
        try:
            self._wait_serving()
            result = subprocess.run(
                [ctr, "--address", str(self.socket), "-n", "k8s.io", "images", "import",
                 "--snapshotter", "native", str(archive)],
                capture_output=True, text=True, timeout=60, check=False,
            )  # fmt: skip
            if result.returncode != 0:
                raise RuntimeError(f"ctr images import failed: {result.stdout}{result.stderr}")
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def log_tail(self, size: int = 3000) -> str:
        with contextlib.suppress(OSError):
            return self.log.read_text(errors="replace")[-size:]
        return ""

    def _wait_serving(self) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.socket.exists() or b"serving..." not in self.log.read_bytes():
            if self._proc.poll() is not None or time.monotonic() > deadline:
                raise ContainerdUnavailable(
                    f"containerd did not start here (exit {self._proc.poll()}):\n" + self.log_tail()
                )
            time.sleep(0.05)

    def close(self) -> None:
        """Stop containerd and remove every trace of it (idempotent)."""
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.terminate()
                try:
                    self._proc.wait(10)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
                    self._proc.wait()
            self._proc = None
        for pid in self._leftover_processes():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        # A killed task leaves its cgroup as it exits; only an empty cgroup can be removed.
        deadline = time.monotonic() + START_TIMEOUT_S
        while _cgroup_pids(self.cgroup_parent) and time.monotonic() < deadline:
            time.sleep(0.01)
        _unmount_under(self.root)
        _remove_cgroups(self.cgroup_parent)
        for entry in _entries(SHIM_SOCKETS) - self._shim_sockets:
            with contextlib.suppress(OSError):
                (SHIM_SOCKETS / entry).unlink()
        if self._made_shim_dir:
            with contextlib.suppress(OSError):
                SHIM_SOCKETS.rmdir()
                SHIM_SOCKETS.parent.rmdir()

    def leftovers(self) -> list[str]:
        """What :meth:`close` should have removed and did not (empty after a clean close)."""
        found = [f"process {pid}" for pid in sorted(self._leftover_processes())]
        found += [f"cgroup {d}" for d in _cgroup_dirs(self.cgroup_parent) if d.exists()]
        found += [f"mount {m}" for m in _mounts_under(self.root)]
        found += [f"shim socket {e}" for e in sorted(_entries(SHIM_SOCKETS) - self._shim_sockets)]
        return found

    def _leftover_processes(self) -> set[int]:
        """Processes this containerd left: in the test's cgroups, or a shim bound to its socket."""
        pids = set(_cgroup_pids(self.cgroup_parent))
        needle = str(self.socket).encode()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            with contextlib.suppress(OSError):
                argv = (entry / "cmdline").read_bytes().split(b"\0")
                if argv and argv[0].endswith(b"containerd-shim-runc-v2") and needle in argv:
                    pids.add(int(entry.name))
        pids.discard(os.getpid())
        return pids


def _entries(directory: Path) -> set[str]:
    with contextlib.suppress(OSError):
        return {entry.name for entry in directory.iterdir()}
    return set()


def _cgroup_dirs(parent: str) -> list[Path]:
    """The test's cgroup directory in every hierarchy (v2: one; v1: one per controller)."""
    relative = parent.strip("/")
    if (CGROUP_ROOT / "cgroup.controllers").exists():
        return [CGROUP_ROOT / relative]
    return [h / relative for h in sorted(CGROUP_ROOT.iterdir()) if h.is_dir()]


def _cgroup_pids(parent: str) -> list[int]:
    pids: list[int] = []
    for top in _cgroup_dirs(parent):
        for procs in top.rglob("cgroup.procs") if top.is_dir() else ():
            with contextlib.suppress(OSError, ValueError):
                pids.extend(int(line) for line in procs.read_text().split())
    return pids


def _remove_cgroups(parent: str) -> None:
    for top in _cgroup_dirs(parent):
        if not top.is_dir():
            continue
        for directory in sorted((p for p in top.rglob("*") if p.is_dir()), reverse=True):
            with contextlib.suppress(OSError):
                directory.rmdir()
        with contextlib.suppress(OSError):
            top.rmdir()


def _mounts_under(root: Path) -> list[str]:
    """The mount points at or below ``root``."""
    prefix = str(root.resolve())
    points: list[str] = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            point = line.split()[4].encode().decode("unicode_escape")
            if point == prefix or point.startswith(prefix + "/"):
                points.append(point)
    return points


def _unmount_under(root: Path) -> None:
    """Unmount (lazily, deepest first) every mount point at or below ``root``."""
    for point in sorted(_mounts_under(root), key=len, reverse=True):
        subprocess.run(["umount", "-l", point], capture_output=True, check=False)


@dataclass(frozen=True)
class RunningContainer:
    """A started container: its CRI ID, its pod's sandbox ID and UID, and its process's PID."""

    id: str
    sandbox_id: str
    pod_uid: str
    pid: int


class CriRuntime:
    """The kubelet's side of the CRI against ``containerd``: runs pods, and removes them all."""

    def __init__(self, containerd: PrivateContainerd, stubs: CriStubs) -> None:
        self._containerd = containerd
        self._pb = stubs.lifecycle
        self._api = stubs.pb2
        self._channel = grpc.insecure_channel(f"unix://{containerd.socket}")
        self._sandboxes: list[str] = []
        self._containers: list[str] = []

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if exc is None:
            self.close()
            return
        # The test's own failure is the one to see; PrivateContainerd.close removes the rest.
        with contextlib.suppress(RuntimeError):
            self.close()

    def _call(self, method: str, request: Any, response_type: Any) -> Any:
        call = self._channel.unary_unary(
            _SERVICE + method,
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=response_type.FromString,
        )
        try:
            return call(request, timeout=CALL_TIMEOUT_S)
        except grpc.RpcError as error:
            raise RuntimeError(
                f"CRI {method} failed: {error}\ncontainerd's log:\n{self._containerd.log_tail()}"
            ) from error

    def run_pod(
        self, namespace: str, pod: str, container: str, *, qos: str = "besteffort"
    ) -> RunningContainer:
        """A pod with one container running ``sleep``, as the kubelet would create it."""
        pb = self._pb
        pod_uid = str(uuid.uuid4())
        qos_dir = "" if qos == "guaranteed" else f"/{qos}"
        parent = f"{self._containerd.cgroup_parent}/kubepods{qos_dir}/pod{pod_uid}"
        metadata = pb.PodSandboxMetadata(name=pod, uid=pod_uid, namespace=namespace, attempt=0)
        kubelet_labels = {
            "io.kubernetes.pod.name": pod,
            "io.kubernetes.pod.namespace": namespace,
            "io.kubernetes.pod.uid": pod_uid,
        }
        sandbox_config = pb.PodSandboxConfig(
            metadata=metadata,
            labels=kubelet_labels,
            linux=pb.LinuxPodSandboxConfig(
                cgroup_parent=parent,
                security_context=pb.LinuxSandboxSecurityContext(
                    namespace_options=pb.NamespaceOption(network=pb.NODE, pid=pb.CONTAINER)
                ),
            ),
        )
        sandbox = self._call(
            "RunPodSandbox",
            pb.RunPodSandboxRequest(config=sandbox_config),
            pb.RunPodSandboxResponse,
        ).pod_sandbox_id
        self._sandboxes.append(sandbox)
        config = pb.ContainerConfig(
            metadata=self._api.ContainerMetadata(name=container, attempt=0),
            image=self._api.ImageSpec(image=IMAGE),
            command=["/bin/busybox", "sleep", "2147483647"],
            labels={**kubelet_labels, "io.kubernetes.container.name": container},
        )
        created = self._call(
            "CreateContainer",
            pb.CreateContainerRequest(
                pod_sandbox_id=sandbox, config=config, sandbox_config=sandbox_config
            ),
            pb.CreateContainerResponse,
        ).container_id
        self._containers.append(created)
        self._call(
            "StartContainer",
            pb.StartContainerRequest(container_id=created),
            pb.StartContainerResponse,
        )
        status = self._call(
            "ContainerStatus",
            pb.ContainerStatusRequest(container_id=created, verbose=True),
            pb.ContainerStatusResponse,
        )
        pid = int(json.loads(status.info["info"])["pid"])
        return RunningContainer(id=created, sandbox_id=sandbox, pod_uid=pod_uid, pid=pid)

    def close(self) -> None:
        """Stop and remove every container and pod made here (each step tried, errors kept)."""
        pb = self._pb
        problems: list[str] = []
        steps: list[tuple[str, Any, Any]] = []
        for container in reversed(self._containers):
            steps += [
                ("StopContainer", pb.StopContainerRequest(container_id=container, timeout=0),
                 pb.StopContainerResponse),
                ("RemoveContainer", pb.RemoveContainerRequest(container_id=container),
                 pb.RemoveContainerResponse),
            ]  # fmt: skip
        for sandbox in reversed(self._sandboxes):
            steps += [
                ("StopPodSandbox", pb.StopPodSandboxRequest(pod_sandbox_id=sandbox),
                 pb.StopPodSandboxResponse),
                ("RemovePodSandbox", pb.RemovePodSandboxRequest(pod_sandbox_id=sandbox),
                 pb.RemovePodSandboxResponse),
            ]  # fmt: skip
        for method, request, response in steps:
            try:
                self._call(method, request, response)
            except RuntimeError as error:
                problems.append(str(error).splitlines()[0])
        self._containers.clear()
        self._sandboxes.clear()
        self._channel.close()
        if problems:
            raise RuntimeError("; ".join(problems))
