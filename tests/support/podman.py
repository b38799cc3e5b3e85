"""podman as the tests run it.

Rootful podman 4.3 on this machine and on CI's: the cgroupfs manager (no systemd to ask for a
scope) and runc. runc here may not raise a container's rlimits above the caller's ("error setting
rlimit type 7: operation not permitted"), so every ``run`` names limits it can set.
"""

from __future__ import annotations

__all__ = ["PODMAN", "RUN_LIMITS"]

PODMAN = ("podman", "--cgroup-manager", "cgroupfs", "--runtime", "runc")
RUN_LIMITS = ("--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024")
