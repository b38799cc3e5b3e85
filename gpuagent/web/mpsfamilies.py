"""The MPS control daemons' families: whether each is up, and how often it was started.

Two series per resource shared through MPS (none without MPS), so an alert can say "a shared
resource's daemon is down" (its devices are unhealthy meanwhile) and a dashboard can show a
daemon that keeps failing.
"""

from __future__ import annotations

from gpuagent.domain.mps import MpsState
from gpuagent.web.exposition import Family

__all__ = ["mps_families"]


def mps_families(state: MpsState) -> list[Family]:
    if not state.daemons:
        return []
    up = Family(
        "gpuagent_mps_daemon_up",
        "gauge",
        "Whether the MPS control daemon of a resource shared through MPS is running and "
        "configured (1), or not (0: its devices are advertised unhealthy meanwhile).",
    )
    starts = Family(
        "gpuagent_mps_daemon_starts_total",
        "counter",
        "Starts of the MPS control daemon of a resource since the agent started (the first "
        "start and every restart after it exited).",
    )
    for name, status in sorted(state.daemons.items()):
        labels = (("resource", name),)
        up.add(labels, 1 if status.up else 0)
        starts.add(labels, status.starts)
    return [up, starts]
