"""What each of the agent's API writers last found of the API server, as it says it in the
store's counters (a transition at a time, the moment a write fails or works again) and
/metrics and /readyz read it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["NOT_PUBLISHED", "ApiReach", "ApiWriter"]

#: The agent's API writers: the DRA side's ResourceSlices, the node's GPU health.
ApiWriter = Literal["resource_slices", "node_health"]

#: What the ResourceSlice publisher says before its first publication.
NOT_PUBLISHED = "not published yet"


@dataclass(frozen=True, slots=True)
class ApiReach:
    """Whether an API writer reaches the API server, as its last calls found it."""

    up: bool = False  # its last batch went out whole (False before the first)
    backing_off: bool = False  # it waits for a server unreachable, throttling or failing
    error: str = ""  # why not up ("" while up)
