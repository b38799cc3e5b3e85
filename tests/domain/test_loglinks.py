"""Container names from the kubelet's log link names: ``<pod>_<namespace>_<container>-<id>.log``."""

from __future__ import annotations

import pytest

from gpuagent.domain.devices import PodRef
from gpuagent.domain.loglinks import MIN_PREFIX, LogLink, index_links, parse_log_link


def cid(n: int) -> str:
    return f"{n:064x}"


def long_pod(length: int) -> str:
    """A valid pod name (DNS labels of at most 63 characters, dotted) of ``length``."""
    name = ".".join(["p" * 49] * 6)[:length]
    assert not name.endswith(".")
    return name


def link_name(pod: str, namespace: str, container: str, container_id: str) -> str:
    """The name the kubelet gives the link, cut to 255 bytes as it cuts it (251 + ".log")."""
    stem = f"{pod}_{namespace}_{container}-{container_id}"
    return stem[:251] + ".log"


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        (
            link_name("trainer-0", "ml", "main", cid(1)),
            LogLink(cid(1), PodRef("ml", "trainer-0", "main")),
        ),
        # Pod names may hold dots and dashes, container names dashes: the ID is after the last.
        (
            link_name("web.v2-7d9f-x1", "team-a", "cuda-sidecar-2", cid(2)),
            LogLink(cid(2), PodRef("team-a", "web.v2-7d9f-x1", "cuda-sidecar-2")),
        ),
        # A static pod (its name ends in the node's name).
        (
            link_name("etcd-node-1.example.com", "kube-system", "etcd", cid(3)),
            LogLink(cid(3), PodRef("kube-system", "etcd-node-1.example.com", "etcd")),
        ),
    ],
)
def test_a_link_names_its_container(name: str, expected: LogLink) -> None:
    link = parse_log_link(name)
    assert link == expected
    assert link is not None
    assert link.complete


@pytest.mark.parametrize(
    "name",
    [
        "trainer-0_ml_main-" + cid(1),  # no .log
        "trainer-0_ml_main-" + cid(1) + ".log.1",
        "trainer-0_main-" + cid(1) + ".log",  # two parts
        "trainer-0_ml_x_main-" + cid(1) + ".log",  # four parts
        "trainer-0_ml_main" + cid(1) + ".log",  # no dash before the ID
        "trainer-0_ml_main-" + cid(1)[:-1] + "g.log",  # not hex
        "trainer-0_ml_main-" + "AB" * 32 + ".log",
        "trainer-0_ml_main-" + cid(1)[:40] + ".log",  # short ID in a name that was not cut
        "Trainer-0_ml_main-" + cid(1) + ".log",  # not a pod name
        "trainer-0_m.l_main-" + cid(1) + ".log",  # not a namespace
        "trainer-0_ml_ma.in-" + cid(1) + ".log",  # not a container name
        "trainer-0__main-" + cid(1) + ".log",
        "_ml_main-" + cid(1) + ".log",
        "trainer-0_ml_-" + cid(1) + ".log",
        ".keep",
        "kube-proxy.log",
    ],
)
def test_other_names_name_nothing(name: str) -> None:
    assert parse_log_link(name) is None


def test_a_cut_name_keeps_the_prefix_of_the_id() -> None:
    pod = long_pod(190)  # a long pod name: the kubelet cuts the ID to 52 hex digits
    name = link_name(pod, "ml", "main", cid(7))
    assert len(name) == 255
    link = parse_log_link(name)
    assert link is not None
    assert not link.complete
    assert cid(7).startswith(link.container_id)
    assert MIN_PREFIX <= len(link.container_id) < 64
    assert link.names == PodRef("ml", pod, "main")


def test_a_cut_that_leaves_too_little_of_the_id_names_nothing() -> None:
    pod = long_pod(235)  # 7 hex digits left
    name = link_name(pod, "ml", "main", cid(7))
    assert len(name) == 255
    assert parse_log_link(name) is None


def test_the_index_names_the_ids_asked_for() -> None:
    index = index_links(
        [
            link_name("a-0", "ns", "main", cid(1)),
            link_name("a-0", "ns", "sidecar", cid(2)),
            link_name("b-0", "ns", "main", cid(3)),
            "not-a-link",
        ]
    )
    assert len(index) == 3
    assert index.names_for({cid(1), cid(2), cid(9)}) == {
        cid(1): PodRef("ns", "a-0", "main"),
        cid(2): PodRef("ns", "a-0", "sidecar"),
    }
    assert index.names_for(set()) == {}


def test_a_cut_id_names_the_one_id_it_prefixes() -> None:
    pod = long_pod(190)
    wanted = "abcdef012345" * 5 + "0000"
    other = wanted[:60] + "ffff"  # the same 52 first digits
    index = index_links([link_name(pod, "ml", "main", wanted)])
    assert index.names_for({wanted}) == {wanted: PodRef("ml", pod, "main")}
    # Two IDs asked for share the prefix: neither is named from the cut link.
    assert index.names_for({wanted, other}) == {}
    # A complete link for an ID wins over a cut one.
    both = index_links(
        [link_name(pod, "ml", "main", wanted), link_name("q", "ml", "other", wanted)]
    )
    assert both.names_for({wanted}) == {wanted: PodRef("ml", "q", "other")}
    # Two cut links naming one ID differently: it stays unnamed.
    twice = index_links(
        [link_name(pod, "ml", "main", wanted), link_name(pod, "ml", "main2", wanted)]
    )
    assert twice.names_for({wanted}) == {}
