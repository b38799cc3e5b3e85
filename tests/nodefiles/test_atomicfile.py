"""Atomic replacement: readers see old or new content, failures leave nothing behind."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpuagent.nodefiles.atomicfile import remove_if_present, write_if_changed


def test_writes_creates_directories_and_sets_mode(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "file.json"
    assert write_if_changed(path, b"one", mode=0o600) is True
    assert path.read_bytes() == b"one"
    assert path.stat().st_mode & 0o777 == 0o600


def test_unchanged_content_is_not_rewritten(tmp_path: Path) -> None:
    path = tmp_path / "file"
    write_if_changed(path, b"same")
    before = path.stat()
    assert write_if_changed(path, b"same") is False
    after = path.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def test_changed_content_replaces_the_file_by_rename(tmp_path: Path) -> None:
    path = tmp_path / "file"
    write_if_changed(path, b"old")
    with path.open("rb") as reader:  # a reader holding the old file keeps the old content
        assert write_if_changed(path, b"new") is True
        assert reader.read() == b"old"
    assert path.read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_failed_rename_leaves_no_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "file"
    write_if_changed(path, b"old")

    def broken(src: object, dst: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken)
    with pytest.raises(OSError, match="No space left"):
        write_if_changed(path, b"new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]
    assert path.read_bytes() == b"old"


def test_target_that_is_a_directory_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "file").mkdir()
    with pytest.raises(IsADirectoryError):
        write_if_changed(tmp_path / "file", b"x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_remove_if_present(tmp_path: Path) -> None:
    path = tmp_path / "file"
    assert remove_if_present(path) is False
    path.write_bytes(b"x")
    assert remove_if_present(path) is True
    assert not path.exists()
