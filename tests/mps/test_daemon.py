"""One MPS control daemon kept by the agent, on the stand-in binary: started and configured,
watched (its status in the store), started again after the backoff, stopped and its GPUs' compute
modes set back. The backoff is injected short (tens of milliseconds), so a restart follows by
itself; the tests wait for its effects, never for a time."""

from __future__ import annotations

import asyncio
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from support.mpsdaemon import installed_control, running_daemon
from support.tasks import running
from support.waiting import eventually

from gpuagent.domain.backoff import Backoff
from gpuagent.domain.mps import MpsDaemon, MpsDirs, MpsGpu, MpsStatus
from gpuagent.gpu.sim.mpscontrol import ask
from gpuagent.mps.daemon import DaemonKeeper, Timing
from gpuagent.state.store import DeviceStore

NAME = "nvidia.com/gpu"
DAEMON = MpsDaemon(
    NAME, (MpsGpu(0, "GPU-a", 81559, 4), MpsGpu(1, "GPU-b", 40960, 4)), thread_percentage=25
)
DEFAULT, EXCLUSIVE = 0, 3


@dataclass
class Modes:
    """GPUs' compute modes, as the driver would keep them."""

    modes: dict[int, int] = field(default_factory=lambda: {0: DEFAULT, 1: 2})
    failing: bool = False

    async def exclusive(self, index: int) -> int | None:
        if self.failing:
            raise RuntimeError("Insufficient Permissions (NVML 4)")
        had, self.modes[index] = self.modes[index], EXCLUSIVE
        return had

    async def restore(self, index: int, mode: int) -> None:
        self.modes[index] = mode

    def close(self) -> None:
        pass


@dataclass
class Kept:
    store: DeviceStore
    keeper: DaemonKeeper
    modes: Modes
    pipe: Path

    def status(self) -> MpsStatus | None:
        return self.store.snapshot.mps.status(NAME)

    async def up(self, starts: int) -> None:
        await eventually(
            lambda: self.status() == MpsStatus(up=True, error="", starts=starts, daemon=DAEMON),
            what=f"up after {starts} starts (status: {self.status()})",
        )


SHORT = Backoff(initial=0.02, maximum=0.05)
# The bound on a stop (quit, then terminate, then kill) where a test wants the daemon to quit
# and clean up: a deadline for a broken build. The product's 0.6 s gives the quit's client
# 0.3 s to start and answer, which a loaded machine can miss; the daemon, killed, then leaves
# its control socket behind.
GRACEFUL = 10.0


def keeper_for(
    tmp_path: Path,
    modes: Modes | None = None,
    backoff: Backoff = SHORT,
    stop: float = GRACEFUL,
) -> Kept:
    store = DeviceStore()
    modes = modes or Modes()
    keeper = DaemonKeeper(
        DAEMON,
        store,
        dirs=MpsDirs(str(tmp_path / "mps")),
        driver_root=tmp_path / "driver",
        compute_modes=modes,
        timing=Timing(backoff=backoff, stop=stop),
    )
    return Kept(store, keeper, modes, tmp_path / "mps" / NAME / "pipe")


@pytest.fixture
def kept(tmp_path: Path) -> Kept:
    installed_control(tmp_path / "driver")
    return keeper_for(tmp_path)


async def test_started_configured_restarted_and_stopped(kept: Kept) -> None:
    async with running(kept.keeper.run()):
        await kept.up(starts=1)
        assert ask(kept.pipe, "get_default_device_pinned_mem_limit 0") == (True, "20389M")
        assert ask(kept.pipe, "get_default_device_pinned_mem_limit 1") == (True, "10240M")
        assert ask(kept.pipe, "get_default_active_thread_percentage") == (True, "25.0")
        assert kept.modes.modes == {0: EXCLUSIVE, 1: EXCLUSIVE}
        (kept.pipe.parent.parent.parent / "shm").stat()  # the shared-memory directory is there
        first = kept.keeper.pid
        assert first is not None
        seen: list[MpsStatus | None] = []
        watching = asyncio.create_task(_record(kept, seen))
        os.kill(first, signal.SIGKILL)
        await kept.up(starts=2)
        watching.cancel()
        assert MpsStatus(error="was killed by signal 9", starts=1, daemon=DAEMON) in seen
        assert kept.keeper.pid not in (None, first)
        last = kept.keeper.pid
    assert kept.status() is None  # forgotten once stopped
    assert last is not None
    with pytest.raises(ProcessLookupError):
        os.kill(last, 0)
    assert kept.modes.modes == {0: DEFAULT, 1: 2}  # as they were, not DEFAULT for all
    assert not (kept.pipe / "control").exists()


async def test_a_missing_binary_is_said_and_looked_for_again(tmp_path: Path) -> None:
    kept = keeper_for(tmp_path)
    async with running(kept.keeper.run()):
        await eventually(lambda: kept.status() is not None)
        status = kept.status()
        assert status is not None
        assert not status.up
        assert status.error == f"nvidia-cuda-mps-control not found under {tmp_path / 'driver'}"
        installed_control(tmp_path / "driver")
        await kept.up(starts=1)


async def test_a_daemon_left_by_an_earlier_agent_is_quit(tmp_path: Path) -> None:
    kept = keeper_for(tmp_path)
    with running_daemon(tmp_path / "driver", kept.pipe, kept.pipe.parent / "log") as stale:
        async with running(kept.keeper.run()):
            await kept.up(starts=1)
            assert await asyncio.to_thread(stale.process.wait, 10) == 0
            assert kept.keeper.pid != stale.process.pid


async def test_a_server_started_before_the_limits_is_given_them(tmp_path: Path) -> None:
    """A client that reaches the daemon between its start and its configuration (a container
    left from before a restart has the pipe directory) gets a server before the limits are set;
    the defaults reach only servers started after them, so that server is given them by its
    pid. The stand-in's client here lets such a client in just before the first limit."""
    real = installed_control(tmp_path / "real")
    binary = tmp_path / "driver" / "usr" / "bin" / "nvidia-cuda-mps-control"
    binary.parent.mkdir(parents=True)
    early = 4242
    binary.write_text(
        f'#!/bin/sh\n[ "$1" = -f ] && exec {real} -f\ninput=$(cat)\n'
        'case "$input" in set_default_device_pinned_mem_limit\\ 0\\ *)\n'
        f"  printf 'sim_client_connect {early}' | {real} >/dev/null || exit 1 ;;\nesac\n"
        f"printf '%s' \"$input\" | exec {real}\n"
    )
    binary.chmod(0o755)
    kept = keeper_for(tmp_path, backoff=Backoff(initial=3600.0, maximum=3600.0))
    async with running(kept.keeper.run()):
        await kept.up(starts=1)
        assert ask(kept.pipe, "get_server_list") == (True, str(early))
        # The defaults are set (for the next server), and the early server has them too.
        assert ask(kept.pipe, "get_default_device_pinned_mem_limit 0") == (True, "20389M")
        assert ask(kept.pipe, f"get_device_pinned_mem_limit {early} 0") == (True, "20389M")
        assert ask(kept.pipe, f"get_device_pinned_mem_limit {early} 1") == (True, "10240M")
        assert ask(kept.pipe, f"get_active_thread_percentage {early}") == (True, "25.0")


async def test_a_failed_configuration_is_a_failed_start(tmp_path: Path) -> None:
    real = installed_control(tmp_path / "real")
    binary = tmp_path / "driver" / "usr" / "bin" / "nvidia-cuda-mps-control"
    binary.parent.mkdir(parents=True)
    binary.write_text(
        f'#!/bin/sh\n[ "$1" = -f ] && exec {real} -f\ncat >/dev/null\necho refused\nexit 1\n'
    )
    binary.chmod(0o755)
    # Not started again while the test looks (the backoff's ceiling, never less: no jitter).
    kept = keeper_for(tmp_path, backoff=Backoff(initial=3600.0, maximum=3600.0))
    async with running(kept.keeper.run()):
        await eventually(lambda: kept.status() is not None and "configuring" in kept.status().error)  # type: ignore[union-attr]
        status = kept.status()
        assert status is not None
        assert not status.up
        assert "exit status 1: refused" in status.error
        assert kept.keeper.pid is None  # the daemon it started is gone again


async def test_a_daemon_that_exits_while_starting(tmp_path: Path) -> None:
    binary = tmp_path / "driver" / "usr" / "bin" / "nvidia-cuda-mps-control"
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\necho 'cannot open the device'\nexit 3\n")
    binary.chmod(0o755)
    kept = keeper_for(tmp_path)
    async with running(kept.keeper.run()):
        failed = MpsStatus(error="it exited with status 3 while starting", starts=3, daemon=DAEMON)
        await eventually(lambda: kept.status() == failed)  # tried again, and again


async def test_compute_modes_that_cannot_be_set_fail_the_start(tmp_path: Path) -> None:
    installed_control(tmp_path / "driver")
    kept = keeper_for(tmp_path, Modes(failing=True))
    async with running(kept.keeper.run()):
        await eventually(lambda: kept.status() is not None)
        status = kept.status()
        assert status is not None
        assert not status.up
        assert status.error.startswith("cannot set GPU 0 to EXCLUSIVE_PROCESS: Insufficient")
        assert kept.keeper.pid is None


async def test_a_daemon_deaf_to_quit_and_term_is_killed_in_time(tmp_path: Path) -> None:
    binary = tmp_path / "driver" / "usr" / "bin" / "nvidia-cuda-mps-control"
    binary.parent.mkdir(parents=True)
    # A daemon that never opens its socket and ignores SIGTERM; the client part answers nothing.
    binary.write_text("#!/bin/sh\ntrap '' TERM\n[ \"$1\" = -f ] && exec sleep 600\nexit 1\n")
    binary.chmod(0o755)
    kept = keeper_for(tmp_path, stop=Timing().stop)  # the product's bound
    async with running(kept.keeper.run()) as task:
        await eventually(lambda: kept.keeper.pid is not None)
        pid = kept.keeper.pid
    assert task.done()
    assert pid is not None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


async def _record(kept: Kept, seen: list[MpsStatus | None]) -> None:
    """Every status the store holds for the daemon, as it changes."""
    async for status in kept.store.watch(lambda s: s.mps.status(NAME)):
        seen.append(status)
