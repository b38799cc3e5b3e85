"""The stand-in ``nvidia-cuda-mps-control`` (gpuagent.gpu.sim.mpscontrol) for tests: installed
under a driver root, a daemon of it started on a pipe directory, its commands sent as a client;
and a container's MPS client as a claim's CDI spec makes it (:func:`cdi_client`)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuagent.gpu.sim import SimDriver
from gpuagent.gpu.sim.mps import SERVER_NAME
from gpuagent.gpu.sim.mpscontrol import ask, install, value_mib

__all__ = [
    "StandIn",
    "cdi_client",
    "control_env",
    "installed_control",
    "running_daemon",
    "server_pid",
    "wait_until",
]


def wait_until(check: Callable[[], object], within: float = 10.0, what: str = "it") -> None:
    """Poll ``check`` until it is truthy (``within``: a deadline for a broken build)."""
    deadline = time.monotonic() + within
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {within} s")
        time.sleep(0.005)


def installed_control(driver_root: Path) -> Path:
    """The stand-in's launcher at ``<driver_root>/usr/bin/nvidia-cuda-mps-control``."""
    return install(driver_root)


def control_env(pipe: Path, log: Path) -> dict[str, str]:
    return {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(pipe), "CUDA_MPS_LOG_DIRECTORY": str(log)}


@dataclass
class StandIn:
    binary: Path
    pipe: Path
    log: Path
    process: subprocess.Popen[bytes]

    def client(self, **own: float) -> dict[str, object]:
        """The ``mps`` of a simulated client of this daemon (``own``: its own limits)."""
        return {"pipe_directory": str(self.pipe), **own}

    def send(self, *commands: str) -> subprocess.CompletedProcess[bytes]:
        """The commands on a client's standard input, one a line, no trailing newline."""
        return subprocess.run(
            [str(self.binary)],
            input="\n".join(commands).encode(),
            env=control_env(self.pipe, self.log),
            capture_output=True,
            check=False,
            timeout=10,
        )

    def ask(self, command: str) -> str:
        accepted, answer = ask(self.pipe, command)
        assert accepted, answer
        return answer


@contextmanager
def running_daemon(driver_root: Path, pipe: Path, log: Path) -> Iterator[StandIn]:
    """A stand-in daemon in the foreground on ``pipe`` for the ``with`` block; stopped after."""
    binary = installed_control(driver_root)
    process = subprocess.Popen(
        [str(binary), "-f"],
        env=control_env(pipe, log),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_until((pipe / "control").is_socket, what="the daemon's control socket")
        yield StandIn(binary, pipe, log, process)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            process.wait(10)


def cdi_client(spec: Mapping[str, Any], ordinal: int = 0) -> dict[str, object]:
    """The ``mps`` of a simulated process started in a container given ``spec``'s (a claim's
    CDI spec's) one device, as CUDA in that container reads its environment: the daemon's pipe
    directory as the node sees it (the mount at the container's ``CUDA_MPS_PIPE_DIRECTORY``),
    its pinned memory limit for device ``ordinal`` (``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``,
    ``"0=4096M,1=2G"``) and its active thread percentage."""
    (device,) = spec["devices"]
    edits = device["containerEdits"]
    env = dict(item.split("=", 1) for item in edits.get("env", []))
    mounts = {m["containerPath"]: m["hostPath"] for m in edits.get("mounts", [])}
    client: dict[str, object] = {"pipe_directory": mounts[env["CUDA_MPS_PIPE_DIRECTORY"]]}
    for entry in filter(None, env.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "").split(",")):
        where, _, value = entry.partition("=")
        mib = value_mib(value)
        assert mib is not None, f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT: not a limit: {entry!r}"
        if int(where) == ordinal:
            client["pinned_mem_limit_mib"] = mib
    if "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" in env:
        client["active_thread_percentage"] = float(env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"])
    return client


def server_pid(driver: SimDriver) -> int:
    """The pid of the one MPS server on the simulated node ``driver``."""
    (pid,) = {p["pid"] for p in driver.processes() if p["name"] == SERVER_NAME}
    assert isinstance(pid, int)
    return pid
