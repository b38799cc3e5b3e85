"""A client that reaches the MPS control daemon between its start and its configuration (a
container left from before a restart has the pipe directory) gets a server before the limits
are set; the defaults reach only servers started after them, so the keeper gives that server
the limits by its pid. The stand-in binary's client lets such a client in just before the first
limit is set."""

from __future__ import annotations

from pathlib import Path

from support.mpsdaemon import installed_control
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
EARLY = 4242  # the early client's server


def _control_letting_a_client_in_first(tmp_path: Path) -> None:
    real = installed_control(tmp_path / "real")
    binary = tmp_path / "driver" / "usr" / "bin" / "nvidia-cuda-mps-control"
    binary.parent.mkdir(parents=True)
    binary.write_text(
        "#!/bin/sh\n"
        f'[ "$1" = -f ] && exec {real} -f\n'
        "input=$(cat)\n"
        'case "$input" in set_default_device_pinned_mem_limit\\ 0\\ *)\n'
        f"  printf 'sim_client_connect {EARLY}' | {real} >/dev/null || exit 1 ;;\n"
        "esac\n"
        f"printf '%s' \"$input\" | exec {real}\n"
    )
    binary.chmod(0o755)


async def test_a_server_started_before_the_limits_is_given_them(tmp_path: Path) -> None:
    _control_letting_a_client_in_first(tmp_path)
    store = DeviceStore()
    keeper = DaemonKeeper(
        DAEMON,
        store,
        dirs=MpsDirs(str(tmp_path / "mps")),
        driver_root=tmp_path / "driver",
        compute_modes=None,
        timing=Timing(backoff=Backoff(initial=3600.0, maximum=3600.0)),
    )
    pipe = tmp_path / "mps" / NAME / "pipe"
    async with running(keeper.run()):
        await eventually(
            lambda: (
                store.snapshot.mps.status(NAME)
                == MpsStatus(up=True, error="", starts=1, daemon=DAEMON)
            ),
            what=f"up (status: {store.snapshot.mps.status(NAME)})",
        )
        assert ask(pipe, "get_server_list") == (True, str(EARLY))
        # The defaults are set (for the next server), and the early server has them too.
        assert ask(pipe, "get_default_device_pinned_mem_limit 0") == (True, "20389M")
        assert ask(pipe, f"get_device_pinned_mem_limit {EARLY} 0") == (True, "20389M")
        assert ask(pipe, f"get_device_pinned_mem_limit {EARLY} 1") == (True, "10240M")
        assert ask(pipe, f"get_active_thread_percentage {EARLY}") == (True, "25.0")
