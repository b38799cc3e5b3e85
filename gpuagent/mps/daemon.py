"""One MPS control daemon, kept: started, configured, watched, started again, stopped.

A start makes the daemon's directories under the MPS root (pipe and log, and the shared-memory
directory all daemons share), asks a daemon left on the same pipe directory by an earlier agent
to quit, sets the GPUs to EXCLUSIVE_PROCESS (unless told to leave them), starts the daemon in the
foreground, waits for its control socket, then gives it each GPU's default pinned memory limit
and the active thread percentage, one control command each (:class:`MpsDaemon.commands`); a
server a client started before them (the defaults reach only servers started after them) is
given the same limits by its pid. Only then is it up: its devices may be allocated.

The daemon is the agent's child: when it exits, its devices turn unhealthy at once (the status
goes into the store; ListAndWatch follows) and it is started again after the backoff
(:class:`~gpuagent.domain.backoff.Backoff`'s ceiling: 0.5 s, doubling up to 30 s, the count
forgiven once a daemon has stayed up ten seconds). The daemon is the node's own, so the wait has
no jitter: there is no herd of nodes to spread, and a wait drawn near zero would start a daemon
that just failed again at once. When the keeper is cancelled (shutdown, or the
plan no longer wants the daemon) the daemon is told to ``quit`` — within :attr:`Timing.stop`
in all: then terminated, then killed — and the GPUs' compute modes are set back as they were.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol

import structlog

from gpuagent.domain.backoff import Backoff
from gpuagent.domain.mps import MpsDaemon, MpsDirs, MpsStatus, server_pids
from gpuagent.logs import ProblemLog
from gpuagent.mps.control import ControlBinary, MpsCommandError, find_control_binary
from gpuagent.state.clock import Clock, LoopClock
from gpuagent.state.store import DeviceStore

__all__ = ["ComputeModeControl", "DaemonKeeper", "Timing"]

log = structlog.get_logger("gpuagent.mps")

CONTROL_SOCKET = "control"
PID_FILE = "nvidia-cuda-mps-control.pid"


class ComputeModeControl(Protocol):
    """GPUs' compute modes (:class:`gpuagent.gpu.computemode.ComputeModes`)."""

    async def exclusive(self, index: int) -> int | None: ...
    async def restore(self, index: int, mode: int) -> None: ...
    def close(self) -> None: ...


class DaemonError(Exception):
    """The daemon could not be started or configured; the message says why."""


@dataclass(frozen=True, slots=True)
class Timing:
    """``ready``: how long a started daemon has to open its control socket; ``stable``: a daemon
    up this long has its failures forgiven; ``stop``: quit, terminate and kill, in all."""

    ready: float = 10.0
    poll: float = 0.005
    stable: float = 10.0
    stop: float = 0.6
    backoff: Backoff = field(default_factory=lambda: Backoff(initial=0.5, maximum=30.0))


class DaemonKeeper:
    """Keeps one control daemon (``daemon``) up, for as long as :meth:`run` runs.

    ``compute_modes`` is ``None`` when the GPUs' compute modes are to be left as they are.
    """

    def __init__(
        self,
        daemon: MpsDaemon,
        store: DeviceStore,
        *,
        dirs: MpsDirs,
        driver_root: Path,
        compute_modes: ComputeModeControl | None,
        timing: Timing = Timing(),
        clock: Clock | None = None,
    ) -> None:
        self.daemon = daemon
        self._store = store
        self._dirs = dirs
        self._driver_root = driver_root
        self._modes = compute_modes
        self._timing = timing
        self._clock = clock or LoopClock()
        self._process: asyncio.subprocess.Process | None = None
        self._relay: asyncio.Task[None] | None = None
        self._control: ControlBinary | None = None
        self._had: dict[int, int] = {}  # the compute modes set, as they were before
        self._starts = 0
        self._problem = ProblemLog(log)
        self._never = asyncio.Event()

    @property
    def pid(self) -> int | None:
        """The running daemon's process ID."""
        process = self._process
        return process.pid if process is not None and process.returncode is None else None

    async def run(self) -> None:
        """Keep the daemon up until cancelled; then stop it (bounded) and forget its status."""
        failures = 0
        try:
            while True:
                began = self._clock.now()
                reason = await self._run_once()
                lasted = self._clock.now() - began
                failures = 1 if lasted >= self._timing.stable else failures + 1
                delay = self._timing.backoff.ceiling(failures)
                self._report(up=False, error=reason)
                self._problem.failed(
                    "MPS control daemon down; starting it again",
                    daemon=self.daemon.name,
                    reason=reason,
                    in_seconds=round(delay, 2),
                )
                await self._clock.wait(self._never, delay)
        finally:
            await self._stop()
            self._store.update(lambda s: replace(s, mps=s.mps.with_status(self.daemon.name, None)))

    async def _run_once(self) -> str:
        """Start and configure the daemon, then wait for it to exit; returns why it is down."""
        try:
            control = await self._start()
        except DaemonError as exc:
            await self._kill()
            return str(exc)
        process = self._process
        assert process is not None
        self._report(up=True, error="")
        self._problem.recovered("MPS control daemon up", daemon=self.daemon.name)
        log.info("MPS control daemon up", daemon=self.daemon.name, pid=process.pid,
                 pipe=str(control.pipe_dir), commands=list(self.daemon.commands()))  # fmt: skip
        status = await process.wait()
        return _exit_reason(status)

    async def _start(self) -> ControlBinary:
        name = self.daemon.name
        control = self._control
        if control is None:
            found = await asyncio.to_thread(find_control_binary, self._driver_root)
            if found is None:
                raise DaemonError(f"nvidia-cuda-mps-control not found under {self._driver_root}")
            control = ControlBinary(found, Path(self._dirs.pipe(name)), Path(self._dirs.log(name)))
            await asyncio.to_thread(self._make_dirs, control)
            await self._quit_stale(control)
            self._control = control
        await self._set_compute_modes()
        # A socket left by a daemon that was killed would pass for the new one's.
        await asyncio.to_thread((control.pipe_dir / CONTROL_SOCKET).unlink, missing_ok=True)
        self._starts += 1
        try:
            self._process = await control.start_daemon()
        except OSError as exc:
            raise DaemonError(f"cannot start {control.path}: {exc}") from exc
        self._relay = asyncio.create_task(
            _relay(self._process, name), name=f"mps-daemon-output:{name}"
        )
        await self._until_ready(control)
        try:
            for command in self.daemon.commands():
                await control.send(command)
            await self._limit_early_servers(control)
        except MpsCommandError as exc:
            raise DaemonError(f"configuring it failed: {exc}") from exc
        return control

    async def _limit_early_servers(self, control: ControlBinary) -> None:
        """A client that connected between the daemon's start and its configuration (a
        container left from before a restart, which has the pipe directory) got a server
        without the limits, and the defaults reach only servers started after them: such a
        server is given the limits itself, so that the clients it serves from now on get them."""
        servers = server_pids(await control.send("get_server_list"))
        for pid in servers:
            for command in self.daemon.commands(server=pid):
                await control.send(command)
        if servers:
            log.warning(
                "an MPS server started before the daemon's limits were set; they are set on "
                "it now (clients it served before run without them)",
                daemon=self.daemon.name,
                servers=list(servers),
            )

    def _make_dirs(self, control: ControlBinary) -> None:
        try:
            control.pipe_dir.mkdir(parents=True, exist_ok=True)
            control.log_dir.mkdir(parents=True, exist_ok=True)
            shm = Path(self._dirs.shm)
            shm.mkdir(parents=True, exist_ok=True)
            shm.chmod(0o1777)  # clients of any user share it, as /dev/shm
        except OSError as exc:
            raise DaemonError(
                f"cannot make its directories under {self._dirs.root}: {exc}"
            ) from exc

    async def _quit_stale(self, control: ControlBinary) -> None:
        """Ask a daemon an earlier agent left on this pipe directory to quit (its clients'
        server goes with it; a new one starts for them)."""
        if not await asyncio.to_thread((control.pipe_dir / PID_FILE).exists):
            return
        with contextlib.suppress(MpsCommandError):
            await control.send("quit", within=self._timing.stop)
            log.info("quit an MPS control daemon left running", pipe=str(control.pipe_dir))

    async def _set_compute_modes(self) -> None:
        if self._modes is None:
            return
        for gpu in self.daemon.gpus:
            if gpu.index in self._had:
                continue
            try:
                had = await self._modes.exclusive(gpu.index)
            except Exception as exc:
                raise DaemonError(
                    f"cannot set GPU {gpu.index} to EXCLUSIVE_PROCESS: {exc}"
                ) from exc
            if had is not None:
                self._had[gpu.index] = had

    async def _until_ready(self, control: ControlBinary) -> None:
        """Until the daemon's control socket is there; a daemon that exits first failed."""
        process = self._process
        assert process is not None
        socket = control.pipe_dir / CONTROL_SOCKET
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._timing.ready
        while not await asyncio.to_thread(socket.is_socket):
            if process.returncode is not None:
                raise DaemonError(f"it {_exit_reason(process.returncode)} while starting")
            if loop.time() > deadline:
                raise DaemonError(f"no control socket {socket} after {self._timing.ready:g} s")
            await asyncio.sleep(self._timing.poll)

    async def _stop(self) -> None:
        """Quit the daemon (then terminate, then kill), and set the compute modes back."""
        process, control = self._process, self._control
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._timing.stop
        try:
            if process is not None and process.returncode is None and control is not None:
                with contextlib.suppress(MpsCommandError):
                    await control.send("quit", within=self._timing.stop / 2)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(max(0.0, deadline - loop.time() - 0.1)):
                        await process.wait()
        finally:
            await self._kill()  # whatever happened to the quit
        if self._relay is not None:
            self._relay.cancel()
        for index, mode in sorted(self._had.items()):
            try:
                async with asyncio.timeout(max(0.05, deadline - loop.time())):
                    if self._modes is not None:
                        await self._modes.restore(index, mode)
            except Exception as exc:
                log.warning("could not set the compute mode back", gpu=index, error=str(exc))
        self._had.clear()
        if process is not None:
            log.info("MPS control daemon stopped", daemon=self.daemon.name)

    async def _kill(self) -> None:
        process = self._process
        if process is None or process.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            process.terminate()
        try:
            async with asyncio.timeout(0.1):
                await process.wait()
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()

    def _report(self, *, up: bool, error: str) -> None:
        status = MpsStatus(up=up, error=error, starts=self._starts, daemon=self.daemon)
        self._store.update(lambda s: replace(s, mps=s.mps.with_status(self.daemon.name, status)))


async def _relay(process: asyncio.subprocess.Process, name: str) -> None:
    """The daemon's output lines into the agent's log, until it closes them."""
    stream = process.stdout
    if stream is None:
        return
    with contextlib.suppress(ValueError, ConnectionError):
        async for line in stream:
            text = line.decode(errors="replace").rstrip()
            if text:
                log.info("mps-control", daemon=name, line=text[:1000])


def _exit_reason(status: int) -> str:
    if status < 0:
        return f"was killed by signal {-status}"
    return f"exited with status {status}"
