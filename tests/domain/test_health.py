"""The health policy: XID classes, NVIDIA's env knobs, and recovery."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gpuagent.domain import xids
from gpuagent.domain.devices import Condition, Gpu, GpuHealth, MigDevice
from gpuagent.domain.health import (
    DEFAULT_IGNORED_XIDS,
    NVIDIA_PLUGIN_IGNORED_XIDS,
    USABLE_ACTIONS,
    DoubleBitEccError,
    GpuLost,
    GpuReset,
    HealthCheckSpecError,
    HealthEvent,
    HealthPolicy,
    LivenessFailed,
    RecoveryActionChanged,
    Responding,
    RowRemapState,
    XidError,
    record_event,
)

HEALTHY = GpuHealth()


@pytest.mark.parametrize(
    ("disable", "enable", "xid", "checked"),
    [
        pytest.param("", "", 79, True, id="default-critical-xid"),
        pytest.param("", "", 13, False, id="default-application-xid"),
        pytest.param("", "", 109, True, id="default-checks-109-a-reset-xid"),
        pytest.param("109", "", 109, False, id="nvidias-109-default-by-disable"),
        pytest.param("", "", 8, False, id="catalog-restart-app"),
        pytest.param("", "", 121, False, id="catalog-ignore"),
        pytest.param("", "", 154, False, id="recovery-action-xid-is-informational"),
        pytest.param("", "", 48, True, id="dbe-workflow"),
        pytest.param("", "", 74, True, id="nvlink-workflow"),
        pytest.param("", "", 172, True, id="no-catalog-action"),
        pytest.param("", "", 0, False, id="zero-is-no-xid"),
        pytest.param("", "all", 0, False, id="zero-is-no-xid-even-enabled"),
        pytest.param("", "", 2**64 - 1, False, id="junk-is-no-xid"),
        pytest.param("", "", 94, False, id="contained-ecc-is-an-application-error"),
        pytest.param("", "", 95, True, id="uncontained-ecc-is-critical"),
        pytest.param("", "", 424, True, id="unknown-xid-is-critical"),
        pytest.param("", "94", 94, True, id="enable-catalog-application-xid"),
        pytest.param("48", "", 48, False, id="disable-adds-to-ignore-list"),
        pytest.param("48", "", 79, True, id="disable-list-leaves-others"),
        pytest.param("all", "", 79, False, id="disable-all"),
        pytest.param("xids", "", 79, False, id="disable-xids"),
        pytest.param("all", "79", 79, True, id="enable-beats-disable-all"),
        pytest.param("all", "79", 48, False, id="enable-only-what-it-names"),
        pytest.param("", "13", 13, True, id="enable-beats-default-ignore"),
        pytest.param("", "all", 31, True, id="enable-all-checks-application-xids"),
        pytest.param(" XIDS , 5 ", "", 5, False, id="case-and-spaces"),
    ],
)
def test_xid_checks(disable: str, enable: str, xid: int, checked: bool) -> None:
    policy = HealthPolicy.from_env_values(disable, enable)
    assert policy.checks_xid(xid) is checked


@pytest.mark.parametrize("bad", ["foo", "13,x", "-1", "1.5"])
def test_bad_spec_names_the_variable_and_entry(bad: str) -> None:
    with pytest.raises(HealthCheckSpecError, match="DP_DISABLE_HEALTHCHECKS"):
        HealthPolicy.from_env_values(bad, "")


def test_default_ignore_list_is_the_catalogs_usable_actions() -> None:
    """One policy: the XIDs whose catalog action leaves the GPU usable, and no others."""
    usable = {c for c, x in xids.CATALOG.items() if x.action in USABLE_ACTIONS}
    assert usable == DEFAULT_IGNORED_XIDS
    assert frozenset({13, 31, 43, 45, 68}) <= DEFAULT_IGNORED_XIDS
    assert 94 in DEFAULT_IGNORED_XIDS  # contained ECC error: restart the app (NVIDIA #1974)
    assert 109 not in DEFAULT_IGNORED_XIDS  # context switch timeout: RESET_GPU (NVIDIA #1974)
    assert not {48, 62, 64, 74, 79, 95, 119, 120} & DEFAULT_IGNORED_XIDS
    # What differs from NVIDIA's plugin is exactly 109 one way and the catalog's others the other.
    assert {109} == NVIDIA_PLUGIN_IGNORED_XIDS - DEFAULT_IGNORED_XIDS


def _run(events: list[HealthEvent], policy: HealthPolicy | None = None) -> GpuHealth:
    policy = policy or HealthPolicy()
    health = HEALTHY
    for event in events:
        health = policy.apply(health, event)
    return health


@pytest.mark.parametrize(
    ("events", "conditions"),
    [
        pytest.param([XidError(79)], (Condition("xid", "79"),), id="critical-xid"),
        pytest.param([XidError(13)], (), id="application-xid"),
        pytest.param([XidError(79), XidError(48)], (Condition("xid", "48"),), id="latest-xid"),
        pytest.param([DoubleBitEccError()], (Condition("ecc_dbe"),), id="dbe"),
        pytest.param([GpuLost()], (Condition("lost"),), id="lost"),
        pytest.param([LivenessFailed("e")] * 2, (), id="two-failed-liveness-checks-are-no-verdict"),
        pytest.param([LivenessFailed("e1"), LivenessFailed("e2"), LivenessFailed("e3")],
                     (Condition("unresponsive", "e3"),), id="three-in-a-row-are"),
        pytest.param([LivenessFailed(f"hung for {n}s") for n in range(1, 8)],
                     (Condition("unresponsive", "hung for 3s"),),
                     id="unresponsive-keeps-the-detail-it-was-judged-by"),
        pytest.param([LivenessFailed("e")] * 3 + [Responding()] + [LivenessFailed("f")] * 3,
                     (Condition("unresponsive", "f"),), id="a-new-verdict-after-recovery"),
        pytest.param([LivenessFailed("e"), LivenessFailed("e"), Responding(), LivenessFailed("e"),
                      LivenessFailed("e")], (), id="a-success-resets-the-count"),
        pytest.param([LivenessFailed("e")] * 3 + [Responding()], (), id="answering-clears"),
        pytest.param([RecoveryActionChanged(1)], (Condition("recovery_action", "gpu_reset"),),
                     id="driver-asks-for-reset"),
        pytest.param([XidError(79), RecoveryActionChanged(1), RecoveryActionChanged(0)], (),
                     id="recovery-clears-xid"),
        pytest.param([DoubleBitEccError(), RecoveryActionChanged(0)], (), id="recovery-clears-ecc"),
        pytest.param([GpuLost(), RecoveryActionChanged(0)], (Condition("lost"),),
                     id="recovery-action-does-not-find-a-lost-gpu"),
        pytest.param([GpuLost(), Responding()], (), id="answering-again-clears-lost"),
        pytest.param([XidError(79), Responding()], (Condition("xid", "79"),),
                     id="answering-does-not-clear-xid"),
        pytest.param([XidError(79), GpuLost(), Responding()], (), id="back-from-lost-is-a-reset"),
        pytest.param([DoubleBitEccError(), GpuReset()], (), id="reset-clears-ecc"),
        pytest.param([XidError(48), RecoveryActionChanged(1), GpuReset()],
                     (Condition("recovery_action", "gpu_reset"),),
                     id="reset-leaves-what-the-driver-still-asks"),
        pytest.param([XidError(0)], (), id="xid-0-is-no-evidence"),
        pytest.param([XidError(2**32)], (), id="junk-xid-is-no-evidence"),
        pytest.param([XidError(79), GpuLost()], (Condition("xid", "79"), Condition("lost")),
                     id="conditions-accumulate"),
        pytest.param([RecoveryActionChanged(42)], (Condition("recovery_action", "42"),),
                     id="unknown-action-number"),
        pytest.param([RowRemapState(pending=True, failed=False)],
                     (Condition("row_remap_pending"),), id="remap-pending"),
        pytest.param([RowRemapState(pending=True, failed=True)],
                     (Condition("row_remap_pending"), Condition("row_remap_failure")),
                     id="remap-failed"),
        pytest.param([RowRemapState(pending=True, failed=False),
                      RowRemapState(pending=False, failed=False)], (), id="remap-done-after-reset"),
        pytest.param([RowRemapState(pending=True, failed=False), RecoveryActionChanged(0)],
                     (Condition("row_remap_pending"),),
                     id="recovery-action-alone-does-not-clear-a-pending-remap"),
    ],
)  # fmt: skip
def test_state_machine(events: list[HealthEvent], conditions: tuple[Condition, ...]) -> None:
    assert _run(events).conditions == conditions


def test_disable_all_ignores_device_checks_too() -> None:
    policy = HealthPolicy.from_env_values("all", "")
    events: list[HealthEvent] = [GpuLost(), DoubleBitEccError(), XidError(79)]
    assert _run([*events, *[LivenessFailed("e")] * 3], policy).healthy


def test_reason_is_readable() -> None:
    health = _run([XidError(79), GpuLost()])
    assert not health.healthy
    assert health.kubelet_health == "Unhealthy"
    assert health.reason == "xid 79, lost"


def test_record_event_counts_every_xid_even_ignored_ones() -> None:
    gpu = Gpu(index=0, uuid="GPU-a", minor=0, name="x", memory_mib=1, pci_bus_id="b")
    policy = HealthPolicy()
    for xid in (13, 13, 79):
        gpu = record_event(gpu, XidError(xid), policy)
    assert dict(gpu.xid_counts) == {13: 2, 79: 1}
    assert gpu.last_xid == 79
    assert gpu.health.reason == "xid 79"


def test_record_event_returns_same_gpu_when_nothing_changes() -> None:
    gpu = Gpu(index=0, uuid="GPU-a", minor=0, name="x", memory_mib=1, pci_bus_id="b")
    assert record_event(gpu, Responding(), HealthPolicy()) is gpu


def _mig_gpu() -> Gpu:
    migs = tuple(
        MigDevice(
            uuid=f"MIG-{gi}-{ci}",
            parent_index=0,
            gpu_instance_id=gi,
            compute_instance_id=ci,
            profile="1g.10gb",
            memory_mib=9984,
        )
        for gi, ci in ((1, 0), (2, 0), (2, 1))
    )
    return Gpu(
        index=0, uuid="GPU-a", minor=0, name="x", memory_mib=1, pci_bus_id="b", mig_devices=migs
    )


def _unhealthy(gpu: Gpu) -> list[str]:
    return [m.uuid for m in gpu.mig_devices if not gpu.health_of(m).healthy]


@pytest.mark.parametrize(
    ("gi", "ci", "marked", "whole"),
    [
        pytest.param(1, None, ["MIG-1-0"], False, id="one-gpu-instance"),
        pytest.param(2, None, ["MIG-2-0", "MIG-2-1"], False, id="every-ci-of-the-gi"),
        pytest.param(2, 1, ["MIG-2-1"], False, id="one-compute-instance"),
        pytest.param(None, None, ["MIG-1-0", "MIG-2-0", "MIG-2-1"], True, id="no-instance"),
        pytest.param(7, None, ["MIG-1-0", "MIG-2-0", "MIG-2-1"], True, id="unknown-instance"),
    ],
)
def test_mig_xid_marks_its_instance(
    gi: int | None, ci: int | None, marked: list[str], whole: bool
) -> None:
    """An XID with instance IDs marks only those MIG devices; without, the whole GPU."""
    gpu = record_event(_mig_gpu(), XidError(48, gi, ci), HealthPolicy())
    assert _unhealthy(gpu) == marked
    assert gpu.health.healthy is not whole
    assert not gpu.overall_health.healthy
    assert dict(gpu.xid_counts) == {48: 1}


def test_mig_instance_recovers_with_the_gpu() -> None:
    """The driver's "no action needed" and a reset clear instance conditions too."""
    policy = HealthPolicy()
    for clearing in (RecoveryActionChanged(0), GpuReset()):
        gpu = record_event(_mig_gpu(), XidError(48, 2, None), policy)
        gpu = record_event(gpu, clearing, policy)
        assert _unhealthy(gpu) == []
        assert gpu.overall_health.healthy


def test_ignored_xid_on_an_instance_changes_nothing_but_the_count() -> None:
    gpu = record_event(_mig_gpu(), XidError(13, 1, 0), HealthPolicy())
    assert _unhealthy(gpu) == []
    assert dict(gpu.xid_counts) == {13: 1}


def test_unchanged_remap_state_keeps_the_same_health_object() -> None:
    policy = HealthPolicy()
    health = _run([RowRemapState(pending=True, failed=False), XidError(79)])
    assert policy.apply(health, RowRemapState(pending=True, failed=False)) is health


def test_migration_doc_lists_every_xid_difference_from_nvidias_plugin() -> None:
    """docs/migration.md names exactly the XIDs the two default policies judge differently."""
    doc = (Path(__file__).parents[2] / "docs" / "migration.md").read_text()
    block = doc.split("<!-- xid-differences")[1].split("<!-- end xid-differences -->")[0]
    checked_line, ignored_line = block.split("\n- ")[1:3]

    def numbers(text: str) -> set[int]:
        return {int(n) for n in re.findall(r"\b\d+\b", text.split(":", 1)[1].partition("(")[0])}

    assert numbers(checked_line) == NVIDIA_PLUGIN_IGNORED_XIDS - DEFAULT_IGNORED_XIDS
    assert numbers(ignored_line) == DEFAULT_IGNORED_XIDS - NVIDIA_PLUGIN_IGNORED_XIDS
