"""Where dashboards and alerts look: ``device`` numbering, ``err_msg``, bounded XID series."""

from __future__ import annotations

from dataclasses import replace
from types import MappingProxyType

import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.synthetic import synthetic_snapshot

from gpuagent.domain import xids
from gpuagent.domain.snapshot import Snapshot
from gpuagent.state.counters import AgentCounters
from gpuagent.web.dcgm import xid_label, xid_message
from gpuagent.web.metrics import MetricsRenderer


def render(snapshot: Snapshot) -> str:
    return MetricsRenderer("node-1", "1").render(snapshot, AgentCounters())


def samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    return [
        (dict(s.labels), s.value)
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == name
    ]


def test_device_is_numbered_by_index_not_minor() -> None:
    """dcgm-exporter's ``device`` is ``nvidia<GPU index>``, whatever the device minor is."""
    snapshot = synthetic_snapshot(2)
    gpus = tuple(replace(g, minor=7 - g.index) for g in snapshot.gpus)
    text = render(replace(snapshot, gpus=gpus))
    devices = {
        labels["gpu"]: labels["device"] for labels, _ in samples(text, "DCGM_FI_DEV_GPU_TEMP")
    }
    assert devices == {"0": "nvidia0", "1": "nvidia1"}


def test_mig_series_carry_the_parents_device() -> None:
    text = render(synthetic_snapshot(2, mig=True))
    for labels, _ in samples(text, "DCGM_FI_DEV_FB_USED"):
        assert labels["device"] == f"nvidia{labels['gpu']}"


@pytest.mark.parametrize("code", sorted(xids.CATALOG))
def test_err_msg_is_the_catalogs_text_for_every_xid(code: int) -> None:
    snapshot = synthetic_snapshot(1)
    gpu = replace(snapshot.gpus[0], last_xid=code)
    ((labels, value),) = samples(render(replace(snapshot, gpus=(gpu,))), "DCGM_FI_DEV_XID_ERRORS")
    assert (labels["err_code"], labels["err_msg"], value) == (
        str(code),
        xids.CATALOG[code].text,
        code,
    )
    assert labels["err_msg"] != "Unknown Error"


def test_err_msg_for_none_and_unknown() -> None:
    assert xid_message(0) == "No Error"
    assert xid_message(998) == "Unknown Error"


def test_xid_series_are_bounded_by_the_catalog() -> None:
    """5,000 junk codes make one ``other`` series holding their total, not 5,000 series."""
    counts = dict.fromkeys(range(1000, 6000), 1) | {79: 2, 13: 3}
    snapshot = synthetic_snapshot(1)
    gpu = replace(snapshot.gpus[0], xid_counts=MappingProxyType(counts))
    text = render(replace(snapshot, gpus=(gpu,)))
    series = {
        (labels["xid"], labels["action"]): value
        for labels, value in samples(text, "gpuagent_xid_errors_total")
    }
    assert series == {
        ("13", "RESTART_APP"): 3,
        ("79", "RESTART_BM"): 2,
        ("other", "CONTACT_SUPPORT"): 5000,
    }
    assert len(text) < 20_000


def test_xid_label() -> None:
    assert [xid_label(c) for c in (79, 154, 172, 0, 173, 999, 2**40)] == [
        "79", "154", "172", "other", "other", "other", "other",
    ]  # fmt: skip


def test_build_info_carries_the_node() -> None:
    """For rules that compare a node's GPU count across agent restarts (a new instance)."""
    ((labels, value),) = samples(render(synthetic_snapshot(3)), "gpuagent_build_info")
    assert (labels["node"], value) == ("node-1", 1)


def test_no_kubelet_families_off_kubernetes() -> None:
    """With --kubernetes=false there is no kubelet: nothing says "not registered" (an alert)."""
    snapshot = synthetic_snapshot(1)
    on = MetricsRenderer("node-1", "1", detailed=True).render(snapshot, AgentCounters())
    off = MetricsRenderer("node-1", "1", kubernetes=False, detailed=True).render(
        snapshot, AgentCounters()
    )
    for name in ("gpuagent_kubelet_registered", "gpuagent_kubelet_registrations_total",
                 "gpuagent_allocations_total"):  # fmt: skip
        assert samples(on, name)
        assert not samples(off, name)
    assert samples(off, "gpuagent_gpus") == [({}, 1)]
