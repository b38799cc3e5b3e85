"""Start-up tuning: modules imported off the loop, and the interpreter's knobs.

Each part names the modules it imports on a thread before it starts (:attr:`Part.imports
<gpuagent.app.part.Part.imports>`): what serves the kubelet while the driver starts (NVML's
initialisation and discovery wait on the driver, not on the GIL), and what the kubelet does not
need once it has its device plugin (the loop keeps answering it meanwhile; BENCHMARKS.md measures
both). In its own process (the command line) the agent also tunes the interpreter for start-up:
the cyclic collector stays off until the agent has started, and an importing thread hands the GIL
to the others sooner.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib
import sys
from collections.abc import Callable, Iterator

__all__ = ["collector_held", "import_modules", "import_off_loop"]

# The GIL switch interval while modules are imported on a thread (Python's default is 5 ms): the
# rest's import holds the GIL for ~150 ms of CPU in all, and with the default every call the loop
# answers meanwhile (or every NVML call's return, while the driver starts) would first wait up to
# 5 ms for it.
IMPORT_SWITCH_INTERVAL = 0.0005


@contextlib.contextmanager
def collector_held(*, own_process: bool) -> Iterator[Callable[[], None]]:
    """The cyclic collector off while the agent starts in its own process; yields what to call
    once it has started.

    Start-up allocates hundreds of thousands of long-lived objects and next to no cyclic garbage:
    collections would only stop the loop (a full one ~20 ms while the rest is imported, under the
    kubelet's first calls). The command line turns the collector off before its imports; this
    keeps it off until started. Then what start-up built, which lives as long as the process,
    leaves the collector's view (shorter pauses in answers to the kubelet, fewer pages touched),
    and the collector is turned on (also when the start fails).
    """
    if not own_process:
        yield lambda: None
        return

    def started() -> None:
        gc.freeze()
        gc.enable()

    gc.disable()
    try:
        yield started
    finally:
        gc.enable()


async def import_off_loop(modules: tuple[str, ...], *, own_process: bool) -> None:
    """Import ``modules`` on a thread, with short GIL slices in the agent's own process (see
    :data:`IMPORT_SWITCH_INTERVAL`)."""
    switch = sys.getswitchinterval()
    if own_process:
        sys.setswitchinterval(min(switch, IMPORT_SWITCH_INTERVAL))
    try:
        await asyncio.to_thread(import_modules, modules)
    finally:
        sys.setswitchinterval(switch)


def import_modules(modules: tuple[str, ...]) -> None:
    for name in modules:
        importlib.import_module(name)
