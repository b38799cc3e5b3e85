"""The XID catalog: one table of codes, dcgm-exporter's texts and the catalog's actions."""

from __future__ import annotations

import pytest

from gpuagent.domain import xids
from gpuagent.domain.xids import CATALOG, Action, is_known, is_valid, lookup


@pytest.mark.parametrize(
    ("code", "action"),
    [
        (8, Action.RESTART_APP),
        (13, Action.RESTART_APP),
        (31, Action.RESTART_APP),
        (38, Action.IGNORE),
        (43, Action.IGNORE),
        (45, Action.WORKFLOW_XID_45),
        (48, Action.WORKFLOW_XID_48),
        (63, Action.IGNORE),
        (64, Action.RESET_GPU),
        (74, Action.WORKFLOW_NVLINK_ERR),
        (79, Action.RESTART_BM),
        (94, Action.RESTART_APP),
        (95, Action.RESET_GPU),
        (109, Action.RESET_GPU),
        (119, Action.RESET_GPU),
        (121, Action.IGNORE),
        (145, Action.WORKFLOW_NVLINK5_ERR),
        (151, Action.RESTART_VM),
        (154, Action.XID_154),
        (159, Action.CHECK_UVM),
        (172, Action.NONE),
    ],
)
def test_catalog_actions(code: int, action: Action) -> None:
    """Spot checks against the catalog's "Resolution Bucket (Immediate Action)" column."""
    assert lookup(code).action is action
    assert lookup(code).resolution is action


@pytest.mark.parametrize(
    ("code", "text"),
    [
        (13, "Graphics Engine Exception"),
        (31, "GPU memory page fault"),
        (45, "Preemptive cleanup, due to previous errors -- Most likely to see when running "
             "multiple cuda"),
        (48, "Double Bit ECC Error"),
        (79, "GPU has fallen off the bus"),
        (121, "C2C Link Error"),
        (142, "Robust Channel NVENVC3 Error"),
        (168, "Reduced GPU Memory Capacity (Errors found in write protection region)"),
        (172, "Uncorrectable SRAM Error"),
    ],
)  # fmt: skip
def test_texts_are_dcgm_exporters(code: int, text: str) -> None:
    """``err_msg`` texts exactly as dcgm-exporter's XID table spells them."""
    assert lookup(code).text == text


def test_the_whole_catalog() -> None:
    """Every XID from 1 to 172, each with a text; keys are the entries' codes."""
    assert sorted(CATALOG) == list(range(1, 173))
    assert all(code == entry.code and entry.text for code, entry in CATALOG.items())
    assert all(is_known(code) for code in CATALOG)


def test_unknown_xid_needs_support_and_has_text() -> None:
    entry = lookup(999)
    assert entry == xids.Xid(999, xids.UNKNOWN_TEXT, Action.CONTACT_SUPPORT)
    assert not is_known(999)


def test_zero_is_no_error_and_not_an_xid() -> None:
    assert lookup(0).text == "No Error"
    assert not is_known(0)
    assert not is_valid(0)


@pytest.mark.parametrize(
    ("code", "valid"),
    [(0, False), (1, True), (172, True), (999, True), (1000, False), (-1, False),
     (2**64 - 1, False), (0xFFFF_FFFF, False)],
)  # fmt: skip
def test_valid_range(code: int, valid: bool) -> None:
    assert is_valid(code) is valid
