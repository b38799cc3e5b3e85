"""The one way the backend calls NVML: timed, counted, classified and logged once.

Every NVML call of the backend (discovery, telemetry, topology, MIG, events) goes through an
:class:`NvmlCalls`. It keeps, per call name (the pynvml function, such as
``nvmlDeviceGetTemperature``), how many calls were made, how long they took and how many failed
— what ``gpuagent_nvml_call_duration_seconds`` and ``gpuagent_nvml_call_errors_total`` export — and
which call each thread is in right now, so start-up can say what it waits for and notice a call
that does not return.

Three ways to call, by what the caller needs:

- :meth:`NvmlCalls.call`: the value, or the NVML error raised (counted);
- :meth:`NvmlCalls.optional`: ``None`` when the GPU or driver does not offer it (NOT_SUPPORTED,
  FUNCTION_NOT_FOUND; logged once per GPU and call), other errors raised;
- :meth:`NvmlCalls.reading`: a telemetry reading: ``None`` on any NVML error except a lost GPU
  (raised as :class:`pynvml.NVMLError_GpuIsLost`); errors counted and logged once per GPU and call.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import pynvml
import structlog

log = structlog.get_logger("gpuagent.nvml")
T = TypeVar("T")

#: Values a GPU or driver may simply not offer: absent, logged once, never an error.
ABSENT = frozenset({pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND})
#: The ``gpu`` of calls that concern no GPU (init, system queries, event waits).
NO_GPU = -1


def describe(error: pynvml.NVMLError) -> str:
    """``"GPU is lost (NVML 15)"``: the driver's text and code, for logs and health reasons."""
    return f"{error} (NVML {error.value})"


def describe_code(code: int) -> str:
    """:func:`describe` for a bare NVML return code (a field slot's ``nvmlReturn``)."""
    return describe(pynvml.NVMLError(code))


@dataclass
class CallStats:
    """Calls into NVML of one kind: how many, how long in total, how many failed."""

    count: int = 0
    seconds: float = 0.0
    errors: int = 0


@dataclass(frozen=True, slots=True)
class InFlight:
    """An NVML call that has not returned yet: on which GPU, which call, since when."""

    gpu: int
    name: str
    started: float


class NvmlCalls:
    """Timing, counting and log-once bookkeeping for NVML calls; safe from any thread."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._stats: dict[str, CallStats] = {}
        self._logged: set[tuple[int, str, str]] = set()
        self._noted: set[tuple[object, ...]] = set()
        self._in_flight: dict[int, InFlight] = {}
        self._sink: Callable[..., None] | None = None

    def forward(self, sink: Callable[..., None]) -> None:
        """Also hand every count to ``sink(name, seconds, failed=…)`` (the store's counters)."""
        self._sink = sink

    def _count(self, name: str, seconds: float, *, failed: bool) -> None:
        """Count one call under ``name`` (the caller holds the lock)."""
        stats = self._stats.setdefault(name, CallStats())
        stats.count += 1
        stats.seconds += seconds
        stats.errors += failed
        if self._sink is not None:
            self._sink(name, seconds, failed=failed)

    # ----- calling -------------------------------------------------------------------------------
    def call(
        self,
        gpu: int,
        fn: Callable[..., T],
        *args: Any,
        name: str = "",
        answers: Collection[int] = (),
    ) -> T:
        """``fn(*args)``; an NVML error is counted under ``name`` (default: ``fn``'s) and raised.

        ``answers``: error codes that are an answer, not a failure (an event wait's TIMEOUT: no
        event; a utilisation read's NOT_FOUND: no sample), raised but not counted as errors.
        """
        what = name or _name(fn)
        thread = threading.get_ident()
        started = self._clock()
        with self._lock:
            self._in_flight[thread] = InFlight(gpu, what, started)
        failed = True
        try:
            result = fn(*args)
        except pynvml.NVMLError as exc:
            failed = exc.value not in ABSENT and exc.value not in answers
            raise
        else:
            failed = False
            return result
        finally:
            elapsed = self._clock() - started
            with self._lock:
                self._in_flight.pop(thread, None)
                self._count(what, elapsed, failed=failed)

    def optional(self, gpu: int, fn: Callable[..., T], *args: Any, name: str = "") -> T | None:
        """``fn(*args)``, or ``None`` when the GPU or driver does not offer it (logged once)."""
        try:
            return self.call(gpu, fn, *args, name=name)
        except pynvml.NVMLError as exc:
            if exc.value not in ABSENT:
                raise
            self.absent(gpu, name or _name(fn), exc.value)
            return None

    def reading(self, gpu: int, fn: Callable[..., T], *args: Any, name: str = "") -> T | None:
        """A telemetry reading: ``None`` on any NVML error but GPU_IS_LOST, which is raised."""
        try:
            return self.call(gpu, fn, *args, name=name)
        except pynvml.NVMLError as exc:
            what = name or _name(fn)
            if exc.value == pynvml.NVML_ERROR_GPU_IS_LOST:
                raise
            if exc.value in ABSENT:
                self.absent(gpu, what, exc.value)
            else:
                self.failed(gpu, what, exc.value)
            return None

    # ----- results that did not come from a call of their own -----------------------------------
    def slot(self, gpu: int, name: str, code: int, call: str = "nvmlDeviceGetFieldValues") -> None:
        """One value of a batch call (a field-values slot, a GPM metric) that did not read.

        A failure is counted as a call of its own, ``<call>:<name>`` (no time of its own); absent
        or failed values are logged once per GPU like calls.
        """
        what = f"{call}:{name}"
        failed = code != pynvml.NVML_SUCCESS and code not in ABSENT
        with self._lock:
            self._count(what, 0.0, failed=failed)
        if code in ABSENT:
            self.absent(gpu, what, code)
        elif failed:
            self._once(gpu, what, "failed", "nvml value unreadable; left out", code)

    def refused(self, gpu: int, name: str, reason: str) -> None:
        """A value the driver returned that cannot be true: an error of ``<name>:refused``."""
        with self._lock:
            self._count(f"{name}:refused", 0.0, failed=True)
            first = (gpu, name, reason) not in self._logged
            self._logged.add((gpu, name, reason))
        if first:
            log.warning("nvml value refused", gpu=gpu, call=name, reason=reason)

    def absent(self, gpu: int, name: str, code: int) -> None:
        """Log once per GPU and call that the GPU or driver does not offer ``name``."""
        self._once(gpu, name, "absent", "value not offered by this gpu or driver", code)

    def failed(self, gpu: int, name: str, code: int) -> None:
        """Log once per GPU and call that ``name`` failed (already counted by :meth:`call`)."""
        self._once(gpu, name, "failed", "nvml call failed; value left out", code)

    def note(
        self, key: tuple[object, ...], event: str, *, level: str = "warning", **fields: Any
    ) -> None:
        """Log ``event`` the first time ``key`` is noted (topology and MIG findings, which are
        not one call's outcome)."""
        with self._lock:
            first = key not in self._noted
            self._noted.add(key)
        if first:
            getattr(log, level)(event, **fields)

    def _once(self, gpu: int, name: str, kind: str, event: str, code: int) -> None:
        with self._lock:
            first = (gpu, name, kind) not in self._logged
            self._logged.add((gpu, name, kind))
        if first:
            emit = log.info if kind == "absent" else log.warning
            emit(event, gpu=gpu, call=name, error=describe_code(code))

    # ----- reporting -----------------------------------------------------------------------------
    def stats(self) -> list[tuple[str, CallStats]]:
        """A consistent copy of the per-call statistics, sorted by call name."""
        with self._lock:
            return [(n, replace(s)) for n, s in sorted(self._stats.items())]

    def record(self, name: str, seconds: float, *, failed: bool) -> None:
        """Count one piece of NVML work timed elsewhere (``init``, ``probe``, ``discover``)."""
        with self._lock:
            self._count(name, seconds, failed=failed)

    def in_flight(self, thread: int | None = None) -> list[InFlight]:
        """Calls that have not returned yet (of one thread, when given), oldest first."""
        with self._lock:
            if thread is not None:
                found = self._in_flight.get(thread)
                return [] if found is None else [found]
            return sorted(self._in_flight.values(), key=lambda c: c.started)

    def now(self) -> float:
        """The clock calls are timed by."""
        return self._clock()


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__name__", "nvml")
