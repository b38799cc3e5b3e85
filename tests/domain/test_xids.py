"""The XID catalog table: resolutions and what they mean for allocation."""

from __future__ import annotations

import pytest

from gpuagent.domain.xids import APPLICATION_XIDS, CATALOG, Resolution, lookup


@pytest.mark.parametrize(
    ("code", "resolution"),
    [
        (13, Resolution.RESTART_APP),
        (31, Resolution.RESTART_APP),
        (48, Resolution.RESET_GPU),
        (79, Resolution.RESTART_BM),
        (94, Resolution.RESTART_APP),
        (95, Resolution.RESET_GPU),
        (109, Resolution.RESET_GPU),
        (119, Resolution.RESET_GPU),
    ],
)
def test_known_resolutions(code: int, resolution: Resolution) -> None:
    assert lookup(code).resolution is resolution


def test_unknown_xid_needs_support_and_has_text() -> None:
    entry = lookup(99999)
    assert entry.resolution is Resolution.CONTACT_SUPPORT
    assert entry.text == "Unknown XID"
    assert not entry.resolution.gpu_usable


def test_application_xids_are_exactly_usable_resolutions_plus_nvidias_list() -> None:
    usable = {c for c, x in CATALOG.items() if x.resolution.gpu_usable}
    assert usable | {13, 31, 43, 45, 68, 109} == APPLICATION_XIDS


def test_catalog_keys_match_entries() -> None:
    assert all(code == entry.code for code, entry in CATALOG.items())
    assert all(entry.text for entry in CATALOG.values())
