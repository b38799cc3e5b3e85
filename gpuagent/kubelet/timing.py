"""The registration cycle's intervals (:mod:`gpuagent.kubelet.registration`), apart from it: what
builds the agent names them without importing the gRPC side, which is imported off the loop while
the driver starts (:mod:`gpuagent.app.parts.kubelet`)."""

from __future__ import annotations

from dataclasses import dataclass

from gpuagent.domain.backoff import Backoff

__all__ = ["Timing"]


@dataclass(frozen=True, slots=True)
class Timing:
    """Intervals of the registration cycle, injectable so tests never wait on wall time."""

    # Polling, where inotify is unavailable: how often both sockets are looked at.
    watch_interval: float = 0.1
    # Longer than the kubelet's own 10 s blocking dial of our socket inside Register.
    register_timeout: float = 12.0
    backoff_initial: float = 0.01  # a kubelet socket bound but not listening yet: soon again
    backoff_max: float = 1.0
    register_retry_max: float = 30.0
    close_timeout: float = 1.0
    # How long the kubelet socket may be absent before a warning names the setting to check.
    kubelet_grace: float = 30.0
    # Watch the socket directories with inotify when the kernel allows it (False: poll only).
    inotify: bool = True
    # How long our socket may be gone, the kubelet's staying, before we serve again: another
    # plugin taking our path, or a restarting kubelet, shows within it.
    settle: float = 0.5

    @property
    def kubelet_wait(self) -> Backoff:
        """Between looks for an absent kubelet socket (where the directory is polled)."""
        return Backoff(self.backoff_initial, self.backoff_max)

    @property
    def register_retry(self) -> Backoff:
        """Between tries of a cycle that did not register (failures in a row)."""
        return Backoff(self.backoff_initial, self.register_retry_max)
