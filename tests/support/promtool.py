"""Prometheus' own tools for the tests that let them judge: promtool and prometheus.

Debian's ``prometheus`` package has both (``.ci/run`` installs it). A test that needs one is
skipped where it is missing, unless ``TESTS_REQUIRE_PROMTOOL`` is set: then it fails.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

__all__ = ["check_metrics", "prometheus_tool"]


def prometheus_tool(name: str) -> str:
    """The path of ``promtool`` or ``prometheus`` (on ``PATH`` or in ``/usr/bin``)."""
    fallback = f"/usr/bin/{name}"
    found = shutil.which(name) or (fallback if os.access(fallback, os.X_OK) else None)
    if found is None:
        if os.environ.get("TESTS_REQUIRE_PROMTOOL"):
            pytest.fail(f"{name} is required here (TESTS_REQUIRE_PROMTOOL is set)")
        pytest.skip(f"{name} not installed")
    return found


def check_metrics(text: str) -> subprocess.CompletedProcess[str]:
    """``promtool check metrics`` of an exposition ``text``."""
    return subprocess.run(
        [prometheus_tool("promtool"), "check", "metrics"],
        input=text,
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
