"""The kubelet's container log links as a source of container names (listed, never followed)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import structlog.testing
from support.clock import FakeClock

from gpuagent.domain.devices import PodRef
from gpuagent.runtime.loglinks import LogLinks


def cid(n: int) -> str:
    return f"{n:064x}"


def add_link(directory: Path, pod: str, namespace: str, container: str, container_id: str) -> None:
    """A link as the kubelet makes it: to the container's log under /var/log/pods (which the
    agent's container does not have: the link dangles, and only its name is read)."""
    directory.mkdir(parents=True, exist_ok=True)
    target = f"/var/log/pods/{namespace}_{pod}_uid/{container}/0.log"
    os.symlink(target, directory / f"{pod}_{namespace}_{container}-{container_id}.log")


@pytest.fixture
def links_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "containers"
    add_link(directory, "trainer-0", "ml", "main", cid(1))
    add_link(directory, "trainer-0", "ml", "sidecar", cid(2))
    return directory


@pytest.fixture
def source(links_dir: Path, clock: FakeClock) -> LogLinks:
    return LogLinks(links_dir, min_interval=2.0, retry_interval=30.0, monotonic=clock)


def test_names_come_from_the_link_names_listed_once(source: LogLinks, clock: FakeClock) -> None:
    assert source.resolve({cid(1), cid(2)}) == {
        cid(1): PodRef("ml", "trainer-0", "main"),
        cid(2): PodRef("ml", "trainer-0", "sidecar"),
    }
    assert (source.listings, source.errors, source.containers) == (1, 0, 2)
    # Known IDs: no listing, however often they are asked for.
    for _ in range(5):
        clock.now += 10
        assert cid(1) in source.resolve({cid(1)})
    assert source.listings == 1


def test_a_new_container_lists_again_at_most_every_min_interval(
    source: LogLinks, links_dir: Path, clock: FakeClock
) -> None:
    source.resolve({cid(1)})
    add_link(links_dir, "trainer-1", "ml", "main", cid(3))
    assert source.resolve({cid(1), cid(3)}) == {cid(1): PodRef("ml", "trainer-0", "main")}
    assert source.listings == 1  # within 2 s of the last listing
    clock.now += 2
    assert source.resolve({cid(1), cid(3)})[cid(3)] == PodRef("ml", "trainer-1", "main")
    assert source.listings == 2


def test_an_unnamed_id_is_looked_for_again_only_after_the_retry_interval(
    source: LogLinks, links_dir: Path, clock: FakeClock
) -> None:
    host_process_container = cid(9)  # e.g. a container outside Kubernetes: never linked
    assert source.resolve({host_process_container}) == {}
    for _ in range(10):
        clock.now += 2.5
        source.resolve({host_process_container})
    assert source.listings == 1  # 25 s later: not yet
    # The kubelet makes a link a moment after the container starts: a later retry names it.
    add_link(links_dir, "late-0", "ml", "main", host_process_container)
    clock.now += 5
    assert source.resolve({host_process_container}) == {
        host_process_container: PodRef("ml", "late-0", "main")
    }
    assert source.listings == 2


def test_an_absent_directory_is_an_error_logged_once_and_the_last_names_stay(
    source: LogLinks, links_dir: Path, clock: FakeClock
) -> None:
    source.resolve({cid(1)})
    moved = links_dir.with_name("moved")
    links_dir.rename(moved)
    with structlog.testing.capture_logs() as logs:
        for _ in range(3):
            clock.now += 31
            names = source.resolve({cid(1), cid(5)})
            assert names == {cid(1): PodRef("ml", "trainer-0", "main")}
        moved.rename(links_dir)
        add_link(links_dir, "p5", "ns", "c", cid(5))
        clock.now += 31
        assert cid(5) in source.resolve({cid(1), cid(5)})
    assert source.errors == 3
    warnings = [e["event"] for e in logs if e["log_level"] == "warning"]
    assert warnings == [
        f"kubelet container log links unreadable ({links_dir}: No such file or directory); "
        "containers have no names"
    ]
    assert [e["event"] for e in logs if e["log_level"] == "info"] == [
        "kubelet container log links readable again"
    ]


def test_a_listing_is_bounded(links_dir: Path, clock: FakeClock) -> None:
    for n in range(10, 40):
        add_link(links_dir, f"p{n}", "ns", "c", cid(n))
    source = LogLinks(links_dir, max_entries=5, monotonic=clock)
    source.resolve({cid(1)})
    assert source.containers <= 5
