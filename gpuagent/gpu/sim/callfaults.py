"""Driver misbehaviour on the simulated driver's calls: hangs, refusals, failures, missing symbols.

Unlike the driver-state faults (:mod:`~gpuagent.gpu.sim.state`), these change how calls answer,
not what the GPUs are: ``hang`` blocks every call on a GPU (outside the driver's lock, like a
call stuck in the kernel) until it ends or the GPU recovers; ``not_supported`` and
``call_error`` make one symbol answer an error on one GPU (or driver-wide, for a call that names
no GPU); ``function_not_found`` makes a symbol disappear, as in an older driver. Each lasts until
the GPU it was injected on recovers. Tests also make a symbol fail a number of times
(:meth:`CallFaults.fail`) or disappear until :meth:`CallFaults.clear`.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import pynvml

from gpuagent.gpu.sim._abi import Symbol

__all__ = ["CALL_ERRORS", "CALL_FAULTS", "MAX_HANG_S", "CallFaults"]

CALL_FAULTS = ("hang", "not_supported", "function_not_found", "call_error")
MAX_HANG_S = 3600.0
#: The errors ``call_error`` can inject, by the names the fault takes.
CALL_ERRORS = {
    "unknown": int(pynvml.NVML_ERROR_UNKNOWN),
    "no_permission": int(pynvml.NVML_ERROR_NO_PERMISSION),
    "timeout": int(pynvml.NVML_ERROR_TIMEOUT),
}


@dataclass
class _Rule:
    code: int
    remaining: int | None


class CallFaults:
    """The call faults of one driver with ``gpus`` GPUs and these ``symbols``, guarded by the
    driver's lock ``cond``; ``remove`` makes a symbol disappear from the driver (the driver puts
    back the ones :meth:`recovered` and :meth:`clear` return)."""

    def __init__(
        self,
        cond: threading.Condition,
        gpus: int,
        symbols: Mapping[str, Symbol],
        remove: Callable[[str], None],
    ) -> None:
        self._cond = cond
        self._gpus = gpus
        self._symbols = symbols
        self._remove = remove
        self._rules: dict[tuple[str, int | None], _Rule] = {}
        # Driver-wide call errors injected "on" a GPU, cleared when that GPU recovers.
        self._owned: dict[int, set[str]] = {}
        # Symbols removed by a function_not_found injected on a GPU, back when it recovers.
        self._removed_by: dict[int, set[str]] = {}
        self.removed: set[str] = set()  # symbols gone (under the lock)
        self._hangs: dict[int, float] = {}  # gpu index -> monotonic time the hang ends
        self._hang_released = threading.Event()
        self._blocked: Counter[int] = Counter()  # gpu index -> calls blocked in its hang now

    @property
    def hanging(self) -> bool:
        """Whether some GPU hangs (a quick look, outside the lock)."""
        return bool(self._hangs)

    def hang_if_needed(self, target: Callable[[], int | None]) -> None:
        """Block (outside the lock, like a driver call stuck in the kernel) on a hung GPU;
        ``target`` names the call's GPU (under the lock)."""
        with self._cond:
            gpu = target()
            until = self._hangs.get(gpu) if gpu is not None else None
        if gpu is not None and until is not None:
            delay = until - time.monotonic()
            if delay > 0:
                with self._cond:
                    self._blocked[gpu] += 1
                try:
                    self._hang_released.wait(delay)
                finally:
                    with self._cond:
                        self._blocked[gpu] -= 1

    def injected(self, name: str, target: Callable[[], int | None]) -> int | None:
        """The error C symbol ``name`` answers now, if one is injected (under the lock)."""
        key: tuple[str, int | None] = (name, None)
        if any(n == name and gpu is not None for n, gpu in self._rules):
            gpu = target()
            if (name, gpu) in self._rules:
                key = (name, gpu)
        rule = self._rules.get(key)
        if rule is None:
            return None
        if rule.remaining is not None:
            rule.remaining -= 1
            if rule.remaining == 0:
                del self._rules[key]
        return rule.code

    def inject(  # noqa: PLR0917 (one argument per fault parameter)
        self, gpu: int, fault: str, xid: int | None, seconds: object, symbol: object, error: object
    ) -> None:
        """Apply call fault ``fault`` to GPU ``gpu``; ``ValueError``/``LookupError`` for bad
        parameters (see :meth:`~gpuagent.gpu.sim.driver.SimDriver.inject`)."""
        if xid is not None:
            raise ValueError(f"fault {fault!r} takes no xid")
        if isinstance(gpu, bool) or not isinstance(gpu, int):
            raise ValueError(f"gpu must be an integer index, got {gpu!r}")  # noqa: TRY004
        if not 0 <= gpu < self._gpus:
            raise LookupError(f"no simulated GPU {gpu} (there are {self._gpus})")
        if fault != "call_error" and error is not None:
            raise ValueError(f"fault {fault!r} takes no error")
        if fault == "hang":
            if symbol is not None:
                raise ValueError("fault 'hang' takes no symbol")
            if (
                isinstance(seconds, bool)
                or not isinstance(seconds, int | float)
                or not 0 < seconds <= MAX_HANG_S
            ):
                raise ValueError(f"fault 'hang' needs seconds in (0, {MAX_HANG_S}]: {seconds!r}")
            with self._cond:
                self._hang_released.clear()
                self._hangs[gpu] = time.monotonic() + float(seconds)
            return
        if seconds is not None:
            raise ValueError(f"fault {fault!r} takes no seconds")
        if not isinstance(symbol, str) or symbol not in self._symbols:
            raise ValueError(f"fault {fault!r} needs an NVML symbol name, got {symbol!r}")
        if fault == "not_supported":
            self.fail(symbol, int(pynvml.NVML_ERROR_NOT_SUPPORTED), gpu=gpu)
        elif fault == "call_error":
            if not isinstance(error, str) or error not in CALL_ERRORS:
                known = ", ".join(CALL_ERRORS)
                raise ValueError(f"fault 'call_error' needs an error ({known}), got {error!r}")
            if self._symbols[symbol].target == "none":
                self.fail(symbol, CALL_ERRORS[error])
                with self._cond:
                    self._owned.setdefault(gpu, set()).add(symbol)
            else:
                self.fail(symbol, CALL_ERRORS[error], gpu=gpu)
        else:
            self._remove(symbol)
            with self._cond:
                self._removed_by.setdefault(gpu, set()).add(symbol)

    def recovered(self, gpu: int) -> set[str]:
        """GPU ``gpu`` was reset: its hang ends, and the call faults injected on it with it.
        Returns the symbols to put back: those its ``function_not_found`` removed that no other
        GPU's still does."""
        with self._cond:
            if self._hangs.pop(gpu, None) is not None and not self._hangs:
                self._hang_released.set()
            for key in [k for k in self._rules if k[1] == gpu]:
                del self._rules[key]
            for name in self._owned.pop(gpu, set()):
                self._rules.pop((name, None), None)
            mine = self._removed_by.pop(gpu, set())
            back = mine.difference(*self._removed_by.values())
            self.removed -= back
        return back

    def describe(self, gpu: int) -> dict[str, object]:
        """GPU ``gpu``'s call faults, JSON-ready (``hang_s``, ``hung_calls``, ``not_supported``,
        ``call_errors``, ``function_not_found``)."""
        with self._cond:
            until = self._hangs.get(gpu)
            return {
                "hang_s": max(0.0, until - time.monotonic()) if until else 0.0,
                "hung_calls": self._blocked[gpu],
                "not_supported": sorted(
                    n
                    for (n, g), rule in self._rules.items()
                    if g == gpu and rule.code == pynvml.NVML_ERROR_NOT_SUPPORTED
                ),
                "call_errors": sorted(
                    n
                    for (n, g), rule in self._rules.items()
                    if rule.code != pynvml.NVML_ERROR_NOT_SUPPORTED
                    and (g == gpu or (g is None and n in self._owned.get(gpu, ())))
                ),
                "function_not_found": sorted(self.removed),
            }

    def fail(
        self, symbol: str, code: int, gpu: int | None = None, count: int | None = None
    ) -> None:
        """Make C symbol ``symbol`` return ``code``, only for GPU ``gpu`` if given, ``count`` times.

        Without ``count`` the failure lasts until :meth:`clear`. A later ``fail`` for the same
        symbol and GPU replaces the earlier one.
        """
        sym = self._symbols.get(symbol)
        if sym is None:
            raise ValueError(f"the simulated driver has no symbol {symbol!r}")
        if count is not None and count < 1:
            raise ValueError(f"count must be at least 1, got {count}")
        if gpu is not None:
            if sym.target == "none":
                raise ValueError(f"{symbol} does not act on one GPU")
            if not 0 <= gpu < self._gpus:
                raise LookupError(f"no simulated GPU {gpu}")
        with self._cond:
            self._rules[(symbol, gpu)] = _Rule(code=int(code), remaining=count)

    def clear(self) -> set[str]:
        """Undo every :meth:`fail` and removal; the symbols to put back."""
        with self._cond:
            self._rules.clear()
            self._removed_by.clear()
            restored, self.removed = self.removed, set()
        return restored
