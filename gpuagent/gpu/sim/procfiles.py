"""The simulated node's files under ``/proc``: what the kernel and the NVIDIA kernel module write
there for the agent to read, in a folder of the simulated node's own (its proc root).

* ``driver/nvidia-caps/mig-minors``: the device minors of the MIG capabilities, as the kernel
  module writes it (:func:`~gpuagent.gpu.sim.spec.mig_minors_text`), so the MIG devices of a
  simulated node get their ``/dev/nvidia-caps`` nodes as on a real one;
* ``sys/kernel/random/boot_id``: the boot the simulated node runs in. Each simulated driver is a
  boot of its own: its MIG devices do not outlive it, as a real node's do not outlive a reboot.

The folder is made on first use and removed with the driver object (or at exit).
"""

from __future__ import annotations

from pathlib import Path

from gpuagent.gpu.sim.scratch import scratch_folder
from gpuagent.gpu.sim.spec import SimNode, mig_minors_text

__all__ = ["MIG_MINORS", "BOOT_ID", "SimProcFiles"]

#: Their paths under the proc root, as under ``/proc``.
MIG_MINORS = "driver/nvidia-caps/mig-minors"
BOOT_ID = "sys/kernel/random/boot_id"


class SimProcFiles:
    """The proc root of one simulated node, booted as ``boot_id``."""

    def __init__(self, node: SimNode, boot_id: str) -> None:
        self._node = node
        self.boot_id = boot_id
        self._root: Path | None = None

    @property
    def root(self) -> Path:
        """The folder standing for ``/proc``, its files written (made on first use)."""
        if self._root is None:
            root = scratch_folder(self, "proc")
            for name, text in ((MIG_MINORS, mig_minors_text(self._node)), (BOOT_ID, self.boot_id)):
                path = root / name
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text if text.endswith("\n") else f"{text}\n", encoding="ascii")
            self._root = root
        return self._root
