"""What an operator trying the agent by hand meets: answers cut short by a pipe, contradictions
and mistakes named by what was typed, in one line, before anything starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from e2e.agentprocess import T

pytestmark = pytest.mark.slow


def _into_a_closed_pipe(*args: str) -> subprocess.CompletedProcess[str]:
    """``gpuagent ARGS | head -0``, deterministically: the pipe's reader is gone before the
    agent writes a byte."""
    reader, writer = os.pipe()
    os.close(reader)
    try:
        return subprocess.run(
            [sys.executable, "-m", "gpuagent", *args],
            stdout=writer,
            stderr=subprocess.PIPE,
            text=True,
            timeout=T,
            check=False,
        )
    finally:
        os.close(writer)


@pytest.mark.parametrize(
    "args", [["--check-config", "CONFIG"], ["--help"], ["--version"]], ids=lambda a: a[0]
)
def test_an_answer_whose_reader_closed_the_pipe_ends_quietly(
    args: list[str], tmp_path: Path
) -> None:
    config = tmp_path / "gpuagent.yaml"
    config.write_text("version: v1\nsimulate: 1\n")
    result = _into_a_closed_pipe(*[str(config) if a == "CONFIG" else a for a in args])
    assert (result.returncode, result.stderr) == (0, "")
