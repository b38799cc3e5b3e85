"""``nvidia-cuda-mps-control``, driven as NVIDIA's MPS control daemon drives it.

The binary is the driver's (``<driver root>/usr/bin/``). Each control command is one client
invocation: the binary started without arguments, with the daemon's ``CUDA_MPS_PIPE_DIRECTORY``
and ``CUDA_MPS_LOG_DIRECTORY``, the command written on its standard input without a trailing
newline, the input closed, and its exit status read — as NVIDIA's ``EchoPipeToControl`` does.
The daemon itself is started in the foreground (``-f``), a child of the agent whose exit the
agent sees at once (NVIDIA's starts it with ``-d``, which detaches it and leaves nothing to
watch); its output goes to the agent's log.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Mapping
from pathlib import Path

from gpuagent.domain.mps import CONTROL_BINARY, LOG_ENV, PIPE_ENV

__all__ = ["ControlBinary", "MpsCommandError", "find_control_binary"]

#: Where a driver root keeps the binary: the driver container's and a host install's place first.
SEARCHED = ("usr/bin", "bin", "usr/local/bin")
COMMAND_SECONDS = 5.0
MAX_OUTPUT = 4096


class MpsCommandError(Exception):
    """A control command failed: not started, timed out, or a non-zero exit (with its output)."""


def find_control_binary(driver_root: Path) -> Path | None:
    """``nvidia-cuda-mps-control`` under ``driver_root``, or ``None`` (blocking: a thread)."""
    for folder in SEARCHED:
        path = driver_root / folder / CONTROL_BINARY
        if path.is_file() and os.access(path, os.X_OK):
            return path
    return None


class ControlBinary:
    """One control binary, for the daemon whose directories are ``pipe_dir`` and ``log_dir``."""

    def __init__(self, path: Path, pipe_dir: Path, log_dir: Path) -> None:
        self.path = path
        self.pipe_dir = pipe_dir
        self.log_dir = log_dir

    @property
    def env(self) -> Mapping[str, str]:
        """The agent's environment with the daemon's directories, and the binary's own folder
        first on ``PATH`` (the daemon starts ``nvidia-cuda-mps-server`` from there)."""
        path = f"{self.path.parent}{os.pathsep}{os.environ.get('PATH', '')}"
        return {
            **os.environ,
            "PATH": path.rstrip(os.pathsep),
            PIPE_ENV: str(self.pipe_dir),
            LOG_ENV: str(self.log_dir),
        }

    async def start_daemon(self) -> asyncio.subprocess.Process:
        """The control daemon, started in the foreground, its output piped to the caller. In
        a session of its own, so a signal meant for the agent reaches it only through the
        agent (which quits it)."""
        return await asyncio.create_subprocess_exec(
            str(self.path),
            "-f",
            env=dict(self.env),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
        )

    async def send(self, command: str, *, within: float = COMMAND_SECONDS) -> str:
        """Run one control command; returns its output. Raises :class:`MpsCommandError`."""
        try:
            process = await asyncio.create_subprocess_exec(
                str(self.path),
                env=dict(self.env),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,
            )
        except OSError as exc:
            raise MpsCommandError(f"{command!r}: cannot run {self.path}: {exc}") from exc
        try:
            async with asyncio.timeout(within):
                output = await _exchange(process, command.encode())
        except TimeoutError:
            process.kill()
            await process.wait()
            raise MpsCommandError(f"{command!r}: no answer in {within:g} s") from None
        except BaseException:
            if process.returncode is None:
                process.kill()
                await process.wait()
            raise
        text = output[:MAX_OUTPUT].decode(errors="replace").strip()
        if process.returncode != 0:
            said = f": {text}" if text else ""
            raise MpsCommandError(f"{command!r}: exit status {process.returncode}{said}")
        return text


async def _exchange(process: asyncio.subprocess.Process, command: bytes) -> bytes:
    """Write ``command`` to the client's standard input and close it, then read its output until
    it exits. A client that exits before reading (no daemon to talk to) has closed its end: what
    it said and its exit status tell why (asyncio raises BrokenPipeError then, uvloop
    RuntimeError; ``communicate`` lets the second through)."""
    assert process.stdin is not None
    assert process.stdout is not None
    with contextlib.suppress(BrokenPipeError, ConnectionResetError, RuntimeError):
        process.stdin.write(command)
        await process.stdin.drain()
    with contextlib.suppress(BrokenPipeError, ConnectionResetError, RuntimeError):
        process.stdin.close()
    output = await process.stdout.read()
    await process.wait()
    return output
