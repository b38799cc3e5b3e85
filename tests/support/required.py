"""What a test does when a tool, library or privilege it needs is missing."""

from __future__ import annotations

import os
from typing import NoReturn

import pytest

__all__ = ["unavailable"]


def unavailable(why: str) -> NoReturn:
    """Fails the test when ``CI`` is set (CI installs everything), skips it otherwise."""
    if os.environ.get("CI"):
        pytest.fail(f"required in CI: {why}")
    pytest.skip(why)
