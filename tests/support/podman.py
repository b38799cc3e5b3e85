"""podman as the tests run it, and what a test does when a tool it needs is missing.

Rootful podman 4.3 on this machine and on CI's: the cgroupfs manager (no systemd to ask for a
scope) and runc. runc here may not raise a container's rlimits above the caller's ("error setting
rlimit type 7: operation not permitted"), so every ``run`` names limits it can set.
"""

from __future__ import annotations

import os
from typing import NoReturn

import pytest

__all__ = ["PODMAN", "RUN_LIMITS", "unavailable"]

PODMAN = ("podman", "--cgroup-manager", "cgroupfs", "--runtime", "runc")
RUN_LIMITS = ("--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024")


def unavailable(why: str) -> NoReturn:
    """A missing tool or privilege: fails the test when ``CI`` is set, skips it otherwise."""
    if os.environ.get("CI"):
        pytest.fail(f"required in CI: {why}")
    pytest.skip(why)
