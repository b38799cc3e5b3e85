"""Reading /proc/<pid>/cgroup under an injected root, with its per-pid cache."""

from __future__ import annotations

from pathlib import Path

from support.cgroups import Layout, cgroup_file, host_cgroup_file, write_proc

from gpuagent.domain.cgroups import CgroupOwner
from gpuagent.runtime.procfs import ProcReader

POD = "3f1c9a2e-7b4d-4e8f-9a01-23456789abcd"
CID = "ab" * 32


def test_owners_of_container_and_host_processes(tmp_path: Path) -> None:
    layout = Layout("cri-o", "systemd", 2)
    root = write_proc(tmp_path, {10: cgroup_file(layout, POD, CID), 11: host_cgroup_file()})
    reader = ProcReader(root)
    assert reader.owners([10, 11, 12]) == {10: CgroupOwner(CID, POD, "cri-o"), 11: None}


def test_cached_while_the_pid_stays_and_read_again_after(tmp_path: Path) -> None:
    layout = Layout("containerd", "cgroupfs", 1)
    root = write_proc(tmp_path, {10: cgroup_file(layout, POD, CID)})
    reader = ProcReader(root)
    reader.owners([10, 99])
    reader.owners([10, 99])
    assert reader.reads == 2  # each pid once, the unreadable one too
    # The pid left the GPU; a new process reusing it is read afresh.
    reader.owners([])
    other = "cd" * 32
    write_proc(root, {10: cgroup_file(layout, POD, other)})
    assert reader.owners([10]) == {10: CgroupOwner(other, POD, "")}
    assert reader.reads == 3


def test_huge_or_binary_files_do_not_break_it(tmp_path: Path) -> None:
    (tmp_path / "5").mkdir()
    (tmp_path / "5" / "cgroup").write_bytes(b"\xff\xfe" * 100_000)
    assert ProcReader(tmp_path).owners([5]) == {5: None}
