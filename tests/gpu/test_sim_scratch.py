"""The simulated node's scratch folders: made where a read-only root allows, removed with their
owner, and swept when the process that made them was killed."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from gpuagent.gpu.sim.scratch import PREFIX, scratch_folder


class Owner:
    pass


def test_the_folder_goes_with_its_owner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    owner = Owner()
    root = scratch_folder(owner, "proc")
    assert root.parent == tmp_path
    assert root.name.startswith(f"{PREFIX}proc-{os.getpid()}-")
    del owner
    gc.collect()
    assert not root.exists()


def test_without_a_usable_temporary_directory_the_fallback_holds_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read-only root with no /tmp (the DaemonSet's): tempfile finds no usable directory."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "absent"))
    fallback = tmp_path / "shm"
    fallback.mkdir()
    owner = Owner()
    root = scratch_folder(owner, "sys", fallback=fallback)
    assert root.parent == fallback
    assert root.is_dir()


def test_folders_of_processes_that_are_gone_are_swept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    dead = tmp_path / f"{PREFIX}proc-{gone.stdout.strip()}-abc"
    alive = tmp_path / f"{PREFIX}proc-{os.getppid()}-abc"
    other_kind = tmp_path / f"{PREFIX}sys-{gone.stdout.strip()}-abc"
    for path in (dead, alive, other_kind):
        (path / "driver").mkdir(parents=True)
    owner = Owner()
    scratch_folder(owner, "proc")
    assert not dead.exists()
    assert alive.exists()
    assert other_kind.exists()  # swept when a folder of its own kind is made
