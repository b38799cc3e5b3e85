"""The control binary driven as NVIDIA's MPS control daemon drives the real one: one client
invocation per command, the command on standard input without a trailing newline."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from support.mpsdaemon import installed_control, wait_until

from gpuagent.mps.control import ControlBinary, MpsCommandError, find_control_binary

RECORDER = """#!/bin/sh
out="$(dirname "$0")/calls"
mkdir -p "$out"
n=$(ls "$out" | grep -c argv)
printf '%s\\n' "$*" > "$out/$n.argv"
env=$(printf '%s\\n%s\\n%s' "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY" "$PATH")
echo "$env" > "$out/$n.env"
cat > "$out/$n.stdin"
echo "answer to $n"
exit ${EXIT:-0}
"""


def recorder(root: Path, body: str = RECORDER) -> Path:
    binary = root / "usr" / "bin" / "nvidia-cuda-mps-control"
    binary.parent.mkdir(parents=True)
    binary.write_text(body)
    binary.chmod(0o755)
    return binary


async def test_a_command_is_one_invocation_with_the_command_on_stdin(tmp_path: Path) -> None:
    binary = recorder(tmp_path)
    control = ControlBinary(binary, tmp_path / "pipe", tmp_path / "log")
    answer = await control.send("set_default_device_pinned_mem_limit 0 20389M")
    await control.send("set_default_active_thread_percentage 25")
    assert answer == "answer to 0"
    calls = binary.parent / "calls"
    assert (calls / "0.argv").read_text() == "\n"  # no argument: a client
    assert (calls / "0.stdin").read_bytes() == b"set_default_device_pinned_mem_limit 0 20389M"
    assert (calls / "1.stdin").read_bytes() == b"set_default_active_thread_percentage 25"
    pipe, log, path = (calls / "0.env").read_text().splitlines()
    assert (pipe, log) == (str(tmp_path / "pipe"), str(tmp_path / "log"))
    assert path.split(os.pathsep)[0] == str(binary.parent)  # the server is found beside it


async def test_a_failing_or_silent_command_is_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    binary = recorder(tmp_path)
    control = ControlBinary(binary, tmp_path / "pipe", tmp_path / "log")
    monkeypatch.setenv("EXIT", "3")
    with pytest.raises(MpsCommandError, match=r"'quit': exit status 3: answer to 0"):
        await control.send("quit")
    hung = recorder(tmp_path / "hung", "#!/bin/sh\nexec sleep 60\n")
    with pytest.raises(MpsCommandError, match=r"no answer in 0\.2 s"):
        await ControlBinary(hung, tmp_path, tmp_path).send("quit", within=0.2)
    gone = ControlBinary(tmp_path / "absent", tmp_path, tmp_path)
    with pytest.raises(MpsCommandError, match="cannot run"):
        await gone.send("quit")


async def test_a_client_that_exits_before_reading_is_its_exit_status(tmp_path: Path) -> None:
    """No daemon: the real client says so and exits without reading its input; the write to it
    may then fail (uvloop raises RuntimeError there, asyncio BrokenPipeError): still the exit
    status and what it said, never an error of another kind (a stop would skip the kill)."""
    gone = recorder(tmp_path, "#!/bin/sh\necho 'Cannot find MPS control daemon process'\nexit 1\n")
    control = ControlBinary(gone, tmp_path, tmp_path)
    for _ in range(20):  # the client often exits before the write: the race is taken
        with pytest.raises(MpsCommandError, match="exit status 1: Cannot find MPS control"):
            await control.send("quit " + "x" * 65536)


def test_the_binary_is_found_under_the_driver_root(tmp_path: Path) -> None:
    assert find_control_binary(tmp_path) is None
    (tmp_path / "bin").mkdir()
    plain = tmp_path / "bin" / "nvidia-cuda-mps-control"
    plain.write_text("not executable")
    assert find_control_binary(tmp_path) is None
    plain.chmod(0o755)
    assert find_control_binary(tmp_path) == plain
    assert find_control_binary(tmp_path) != installed_control(tmp_path)
    assert find_control_binary(tmp_path) == tmp_path / "usr" / "bin" / "nvidia-cuda-mps-control"


async def test_the_stand_in_daemon_answers_as_configured(tmp_path: Path) -> None:
    binary = installed_control(tmp_path / "driver")
    control = ControlBinary(binary, tmp_path / "pipe", tmp_path / "log")
    daemon = await control.start_daemon()
    try:
        await asyncio.to_thread(wait_until, (tmp_path / "pipe" / "control").is_socket)
        await control.send("set_default_device_pinned_mem_limit 1 4G")
        assert await control.send("get_default_device_pinned_mem_limit 1") == "4096M"
        assert await control.send("get_default_active_thread_percentage") == "100.0"
        with pytest.raises(MpsCommandError, match="Unrecognized command"):
            await control.send("set_default_everything 1")
        await control.send("quit")
        assert await asyncio.wait_for(daemon.wait(), 10) == 0
        assert sorted(p.name for p in (tmp_path / "pipe").iterdir()) == []
        with pytest.raises(MpsCommandError, match="Cannot find MPS control daemon"):
            await control.send("get_server_list")
    finally:
        if daemon.returncode is None:
            daemon.kill()
            await daemon.wait()
