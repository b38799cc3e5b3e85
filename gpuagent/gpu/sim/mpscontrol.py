"""A stand-in for the driver's ``nvidia-cuda-mps-control``, for simulated nodes and tests.

Run as a program (:func:`install` puts a launcher at
``<driver root>/usr/bin/nvidia-cuda-mps-control``) it behaves as the real binary does where the
agent and the simulated driver can see it:

* ``-f``: the control daemon in the foreground. It reads ``CUDA_MPS_PIPE_DIRECTORY`` (default
  ``/tmp/nvidia-mps``) and ``CUDA_MPS_LOG_DIRECTORY`` (default ``/var/log/nvidia-mps``), refuses
  to start while another daemon's pid file names a live process, and makes what the real daemon
  makes in the pipe directory (the ``control`` and ``control_privileged`` sockets,
  ``control_lock``, the ``log`` FIFO, ``nvidia-cuda-mps-control.pid``); it writes its start to
  standard output and ``control.log``, serves control commands on ``control`` until ``quit``,
  SIGTERM or SIGINT, and removes those files as it exits.
* ``-d``: the same daemon, detached; returns once it is up.
* no argument: a client. It reads control commands from standard input (one a line; the last may
  lack its newline, as NVIDIA's plugin writes them), sends each to the daemon, prints the answers
  and exits 0 — or 1 when there is no daemon or a command was refused.

Commands: ``set_default_device_pinned_mem_limit <dev> <value>`` (value ``<n>``, ``<n>K``,
``<n>M`` or ``<n>G``, bytes without a unit), ``get_default_device_pinned_mem_limit <dev>``
(``<n>M``, or ``none``), ``set_default_active_thread_percentage <p>``,
``get_default_active_thread_percentage`` (``100.0`` until set), ``get_server_list`` (the pid of
its server, when one runs), ``set_device_pinned_mem_limit <PID> <dev> <value>``,
``get_device_pinned_mem_limit <PID> <dev>``, ``set_active_thread_percentage <PID> <p>``,
``get_active_thread_percentage <PID>`` (of the running server ``PID``; another pid is refused)
and ``quit``.

As NVIDIA's MPS documentation says of the real daemon ("Legacy MPS v2 Interface"): the defaults
are what a server gets when it starts — set while a server runs, they "only affect the next
server" — and the per-PID commands change a running server's limits for the clients created
with it afterwards ("existing clients are not affected"). The server is started for the first
client and outlives its clients: it goes with the daemon (``quit``, a signal). Kinder than
the real daemon, knowingly: its ``quit`` "stops accepting new clients while waiting for current
MPS servers and MPS clients to finish" (the nvidia-cuda-mps-control man page), while this one
exits at once — the stand-in does not see the clients, the simulated driver does (it keeps a
quit daemon's server until its last client there ends). Where the agent's keeper stops a
daemon whose clients still run, this one has exited by itself; a real one is still waiting
when the keeper's bound runs out, and is terminated.

The simulated driver connects a client over the same socket (:func:`ask`), as a CUDA client
connects to the real daemon: ``sim_client_connect <pid>`` (not a command of the real daemon)
starts the daemon's server with pid ``<pid>`` (the simulated driver names the processes) if it
has none, and answers its pid, the daemon's pid, its active thread percentage and its pinned
memory limits (``<server pid> <daemon pid> <percentage> [<dev>=<MiB> …]``).

The standard library only: the program starts in tens of milliseconds, and never imports the
agent.
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["PID_FILE", "ask", "install", "main", "running_pid", "value_mib"]

BINARY = "nvidia-cuda-mps-control"
PID_FILE = "nvidia-cuda-mps-control.pid"
DEFAULT_PIPE = "/tmp/nvidia-mps"
DEFAULT_LOG = "/var/log/nvidia-mps"
_VALUE = re.compile(r"(\d+)([KMG]?)", re.IGNORECASE)
_UNIT_MIB = {"": 1 / (1024 * 1024), "K": 1 / 1024, "M": 1.0, "G": 1024.0}
_MAX_COMMAND = 4096
PIPE_ENV = "CUDA_MPS_PIPE_DIRECTORY"


def install(driver_root: Path) -> Path:
    """Put a launcher of this program at ``<driver_root>/usr/bin/nvidia-cuda-mps-control``."""
    folder = driver_root / "usr" / "bin"
    folder.mkdir(parents=True, exist_ok=True)
    launcher = folder / BINARY
    launcher.write_text(
        f"#!/bin/sh\nexec '{sys.executable}' -I '{Path(__file__).resolve()}' \"$@\"\n"
    )
    launcher.chmod(0o755)
    return launcher


def value_mib(text: str) -> float | None:
    """A memory limit as the control commands and ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` write it
    (``<n>``: bytes, ``<n>K``, ``<n>M``, ``<n>G``) in MiB; ``None`` when it is not one."""
    found = _VALUE.fullmatch(text)
    return None if found is None else int(found[1]) * _UNIT_MIB[found[2].upper()]


def ask(pipe_dir: str | Path, command: str, timeout: float = 2.0) -> tuple[bool, str]:
    """Send one command to the daemon on ``pipe_dir``; ``(accepted, answer)``. Raises
    :class:`OSError` when no daemon listens there."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
        client.settimeout(timeout)
        client.connect(str(Path(pipe_dir) / "control"))
        client.sendall(command.encode()[:_MAX_COMMAND])
        client.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := client.recv(65536):
            data += chunk
    status, _, answer = data.decode(errors="replace").partition("\n")
    return status == "ok", answer.rstrip("\n")


class _Server:
    """The daemon's server: the limits it started with, or was given since."""

    def __init__(self, pid: int, limits_mib: dict[int, int], percentage: float) -> None:
        self.pid, self.limits_mib, self.percentage = pid, limits_mib, percentage

    def describe(self) -> str:
        limits = " ".join(f"{dev}={mib}" for dev, mib in sorted(self.limits_mib.items()))
        return f"{self.pid} {os.getpid()} {self.percentage:g} {limits}".rstrip()


class _Daemon:
    """The control daemon's state: the defaults a new server gets, and its server."""

    def __init__(self, pipe: Path, log: Path) -> None:
        self.pipe, self.log = pipe, log
        self.limits_mib: dict[int, int] = {}
        self.percentage = 100.0
        self.server: _Server | None = None
        self.quitting = False

    def handle(self, command: str) -> tuple[bool, str]:
        words = command.split()
        if not words:
            return True, ""
        verb, args = words[0], words[1:]
        known = _COMMANDS.get(verb)
        if known is None or len(args) != known[0]:
            return False, f"Unrecognized command: {command.strip()[:200]}"
        return known[1](self, *args)

    def quit(self) -> tuple[bool, str]:
        self.quitting = True
        return True, ""

    def server_list(self) -> tuple[bool, str]:
        return True, "" if self.server is None else str(self.server.pid)

    def connect(self, pid: str) -> tuple[bool, str]:
        """A client connects: the running server, or one started now with the defaults."""
        if self.server is None:
            if not pid.isdecimal():
                return False, f"invalid pid: {pid}"
            self.server = _Server(int(pid), dict(self.limits_mib), self.percentage)
        return True, self.server.describe()

    def default_percentage(self) -> tuple[bool, str]:
        return True, f"{self.percentage:.1f}"

    def set_default_percentage(self, text: str) -> tuple[bool, str]:
        value = _percentage(text)
        if value is None:
            return False, f"invalid percentage: {text}"
        self.percentage = value
        return True, ""

    def default_limit(self, device: str) -> tuple[bool, str]:
        if not device.isdecimal():
            return False, f"invalid device: {device}"
        limit = self.limits_mib.get(int(device))
        return True, "none" if limit is None else f"{limit}M"

    def set_default_limit(self, device: str, value: str) -> tuple[bool, str]:
        mib = value_mib(value)
        if not device.isdecimal() or mib is None:
            return False, f"invalid arguments: {device} {value}"
        self.limits_mib[int(device)] = int(mib)
        return True, ""

    def _running(self, pid: str) -> _Server | None:
        server = self.server
        return server if server is not None and pid == str(server.pid) else None

    def percentage_of(self, pid: str) -> tuple[bool, str]:
        server = self._running(pid)
        if server is None:
            return False, f"no server with pid {pid}"
        return True, f"{server.percentage:.1f}"

    def set_percentage_of(self, pid: str, text: str) -> tuple[bool, str]:
        server, value = self._running(pid), _percentage(text)
        if server is None or value is None:
            return False, f"invalid arguments: {pid} {text}"
        server.percentage = value
        return True, ""

    def limit_of(self, pid: str, device: str) -> tuple[bool, str]:
        server = self._running(pid)
        if server is None or not device.isdecimal():
            return False, f"invalid arguments: {pid} {device}"
        limit = server.limits_mib.get(int(device))
        return True, "none" if limit is None else f"{limit}M"

    def set_limit_of(self, pid: str, device: str, value: str) -> tuple[bool, str]:
        server, mib = self._running(pid), value_mib(value)
        if server is None or not device.isdecimal() or mib is None:
            return False, f"invalid arguments: {pid} {device} {value}"
        server.limits_mib[int(device)] = int(mib)
        return True, ""


_Handler = Callable[..., tuple[bool, str]]
#: Each command: how many arguments it takes, and what answers it.
_COMMANDS: dict[str, tuple[int, _Handler]] = {
    "quit": (0, _Daemon.quit),
    "get_server_list": (0, _Daemon.server_list),
    "sim_client_connect": (1, _Daemon.connect),
    "get_default_active_thread_percentage": (0, _Daemon.default_percentage),
    "set_default_active_thread_percentage": (1, _Daemon.set_default_percentage),
    "get_default_device_pinned_mem_limit": (1, _Daemon.default_limit),
    "set_default_device_pinned_mem_limit": (2, _Daemon.set_default_limit),
    "get_active_thread_percentage": (1, _Daemon.percentage_of),
    "set_active_thread_percentage": (2, _Daemon.set_percentage_of),
    "get_device_pinned_mem_limit": (2, _Daemon.limit_of),
    "set_device_pinned_mem_limit": (3, _Daemon.set_limit_of),
}


def _percentage(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if 0 < value <= 100 else None


def _say(daemon: _Daemon, text: str) -> None:
    line = f"[{time.strftime('%Y-%m-%d %H:%M:%S')} Control {os.getpid():6d}] {text}\n"
    sys.stdout.write(line)
    sys.stdout.flush()
    with contextlib.suppress(OSError), open(daemon.log / "control.log", "a") as log:
        log.write(line)


def running_pid(pid_file: Path) -> int | None:
    """The pid ``pid_file`` names, if that process lives (one of another user's counts)."""
    try:
        pid = int(pid_file.read_text().strip())
    except (OSError, ValueError):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        return pid
    return pid


def _already_running(pid_file: Path) -> bool:
    pid = running_pid(pid_file)
    return pid is not None and pid != os.getpid()


def _run_daemon(pipe: Path, log: Path) -> int:
    pipe.mkdir(parents=True, exist_ok=True)
    log.mkdir(parents=True, exist_ok=True)
    pid_file = pipe / PID_FILE
    if _already_running(pid_file):
        sys.stderr.write(f"An instance of this daemon is already running on {pipe}\n")
        return 1
    daemon = _Daemon(pipe, log)
    made = [
        pipe / name
        for name in ("control", ".control.binding", "control_privileged", "control_lock", "log")
    ]
    for path in made:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    privileged = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        privileged.bind(str(pipe / "control_privileged"))
        (pipe / "control_lock").touch()
        os.mkfifo(pipe / "log")
        pid_file.write_text(f"{os.getpid()}\n")
        # Bound and listening before it appears: a socket file seen between bind and listen
        # refuses connections, and whoever waits for the file would take the daemon for absent.
        server.bind(str(pipe / ".control.binding"))
        server.listen(16)
        os.replace(pipe / ".control.binding", pipe / "control")
        _say(daemon, f"Starting control daemon using socket {pipe / 'control'}")
        _say(
            daemon,
            f"To connect CUDA applications to this daemon, set env CUDA_MPS_PIPE_DIRECTORY={pipe}",
        )
        _serve(daemon, server)
        _say(daemon, "Exit")
        return 0
    finally:
        server.close()
        privileged.close()
        for path in (*made, pid_file):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


def _serve(daemon: _Daemon, server: socket.socket) -> None:
    stop = [False]

    def stopped(signum: int, frame: object) -> None:
        stop[0] = True

    # A signal wakes the wait at once (its byte on the pipe): a daemon told to stop exits and
    # removes its files within the moment its stopper waits before killing it.
    woken, wake = os.pipe()
    os.set_blocking(wake, False)
    signal.set_wakeup_fd(wake)
    signal.signal(signal.SIGTERM, stopped)
    signal.signal(signal.SIGINT, stopped)
    while not stop[0] and not daemon.quitting:
        with contextlib.suppress(InterruptedError):
            ready, _, _ = select.select([server.fileno(), woken], [], [], 1.0)
            if woken in ready:
                os.read(woken, 512)
            if server.fileno() not in ready:
                continue
        connection, _ = server.accept()
        with connection:
            connection.settimeout(2.0)
            data = b""
            with contextlib.suppress(OSError):
                while len(data) < _MAX_COMMAND and (chunk := connection.recv(4096)):
                    data += chunk
            command = data.decode(errors="replace")
            accepted, answer = daemon.handle(command)
            _say(daemon, f"{'Accepted' if accepted else 'Refused'}: {command.strip()[:200]}")
            with contextlib.suppress(OSError):
                connection.sendall(f"{'ok' if accepted else 'error'}\n{answer}\n".encode())


def _detach(pipe: Path) -> int:
    with open(os.devnull, "r+b") as null:
        subprocess.Popen(
            [sys.executable, "-I", str(Path(__file__).resolve()), "-f"],
            stdin=null, stdout=null, stderr=null, start_new_session=True,
        )  # fmt: skip
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            if stat.S_ISSOCK(os.stat(pipe / "control").st_mode):
                return 0
        time.sleep(0.01)
    sys.stderr.write("the control daemon did not start\n")
    return 1


def _client(pipe: Path) -> int:
    commands = [line for line in sys.stdin.read().splitlines() if line.strip()]
    status = 0
    for command in commands:
        try:
            accepted, answer = ask(pipe, command)
        except OSError:
            sys.stderr.write("Cannot find MPS control daemon process\n")
            return 1
        if answer:
            print(answer)
        if not accepted:
            status = 1
    return status


def main(argv: list[str]) -> int:
    pipe = Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or DEFAULT_PIPE)
    log = Path(os.environ.get("CUDA_MPS_LOG_DIRECTORY") or DEFAULT_LOG)
    if argv == ["-f"]:
        return _run_daemon(pipe, log)
    if argv == ["-d"]:
        return _detach(pipe)
    if not argv:
        return _client(pipe)
    sys.stderr.write(f"usage: {BINARY} [-d | -f]\n")
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
