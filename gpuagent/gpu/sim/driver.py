"""The simulated ``libnvidia-ml.so.1``: an object pynvml loads in place of the C library."""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import pynvml

from gpuagent.gpu.sim import (
    _api_device,
    _api_events,
    _api_gpm,
    _api_mig,
    _api_migmake,
    _api_process,
    _api_system,
    _api_topology,
    mps,
)
from gpuagent.gpu.sim._abi import BadArgument, Symbol, as_bytes, as_int, out
from gpuagent.gpu.sim.callfaults import CALL_FAULTS, CallFaults
from gpuagent.gpu.sim.hostfiles import SimSysFiles
from gpuagent.gpu.sim.processes import new_process
from gpuagent.gpu.sim.procfiles import SimProcFiles
from gpuagent.gpu.sim.spec import SimNode
from gpuagent.gpu.sim.state import FAULTS, RECOVERY_ACTION_NAMES, DriverState, GpuState, MigState
from gpuagent.overrides.nvml import use_nvml_library

#: Latencies below this are not slept: a shorter sleep takes 50-100 us on Linux, ten times what
#: the real H200 took for such calls (2-10 us), so sleeping would make them the poll's cost.
MIN_SLEEP_S = 0.000_05
# Every fault ``inject`` knows, for its error message and for /sim/faults'.
FAULT_KINDS = (*FAULTS, *CALL_FAULTS)

SYMBOLS: dict[str, Symbol] = {
    **_api_system.SYMBOLS,
    **_api_device.SYMBOLS,
    **_api_events.SYMBOLS,
    **_api_topology.SYMBOLS,
    **_api_mig.SYMBOLS,
    **_api_migmake.SYMBOLS,
    **_api_gpm.SYMBOLS,
    **_api_process.SYMBOLS,
}


class _Entry:
    """One C entry point as pynvml sees it: callable, and ``restype``/``argtypes`` can be set."""

    restype: object = None
    argtypes: object = None

    def __init__(self, driver: SimDriver, name: str, symbol: Symbol) -> None:
        self.__name__ = name
        self._driver = driver
        self._symbol = symbol

    def __call__(self, *args: object) -> int | bytes:
        return self._driver._call(self.__name__, self._symbol, args)

    def __repr__(self) -> str:
        return f"<simulated NVML entry point {self.__name__}>"


class SimDriver:
    """A fake NVIDIA driver: NVML's C entry points as attributes, plus fault injection.

    Install it with :func:`install` and the unmodified pynvml wrappers talk to it. Every C symbol
    (``nvmlInitWithFlags``, ``nvmlDeviceGetHandleByIndex_v2``, ``nvmlEventSetWait_v2``, …) is an
    attribute taking the ctypes arguments pynvml passes and returning an NVML return code.
    Telemetry is a smooth function of ``clock`` (seconds); fault state surfaces only through
    NVML, as on a real node. Thread-safe: all state sits behind one lock, which an event-set wait
    releases while it blocks.

    Calls other than ``nvmlInitWithFlags``/``nvmlErrorString`` return UNINITIALIZED outside
    ``nvmlInit``…``nvmlShutdown``. Waiting on, registering on or freeing a freed event set returns
    INVALID_ARGUMENT (a blocked waiter wakes with it); the last ``nvmlShutdown`` wakes waiters
    with UNINITIALIZED. Wait timeouts are wall-clock; ``clock`` only drives telemetry.
    ``sleep`` spends the node's latencies (per call, and a cold GPU's bring-up): ``time.sleep``
    unless a test records what was asked instead. A hang is a wait that ``recover`` ends, not a
    sleep. ``boot_id``: the boot the simulated node runs in (a new one by default: a driver's MIG
    devices do not outlive it, as a real node's do not outlive a reboot); its files under
    ``/proc`` are under :attr:`proc_root`, those under ``/sys`` under :attr:`sys_root`.
    """

    calls: Counter[str]

    def __init__(
        self,
        node: SimNode,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        boot_id: str | None = None,
    ) -> None:
        self._state = DriverState(node, clock)
        self._proc = SimProcFiles(node, boot_id or str(uuid.uuid4()))
        self._sys = SimSysFiles(node)
        self._mps = mps.Servers(node.cuda_driver_version)
        self._sleep = sleep
        self.calls = Counter()
        self._faults = CallFaults(self._state.cond, len(self._state.gpus), SYMBOLS, self.remove)
        # Cold GPUs: each is brought up by the first call that touches it after nvmlInit.
        self._warm_lock = threading.Lock()
        self._warming: dict[int, threading.Lock] = {}
        self._entries = {name: _Entry(self, name, symbol) for name, symbol in SYMBOLS.items()}
        for name, entry in self._entries.items():
            setattr(self, name, entry)

    @property
    def node(self) -> SimNode:
        """The simulated node this driver was built from."""
        return self._state.node

    @property
    def proc_root(self) -> Path:
        """The simulated node's ``/proc``: its MIG capability minors and its boot ID."""
        return self._proc.root

    @property
    def boot_id(self) -> str:
        return self._proc.boot_id

    @property
    def sys_root(self) -> Path:
        """The simulated node's ``/sys``: its GPUs' PCI devices and its DMI product name."""
        return self._sys.root

    def interrupt_waits(self) -> None:
        """End every blocked ``nvmlEventSetWait_v2`` now with ``NVML_ERROR_TIMEOUT``, as nvml.h
        says an interrupt may (the agent's shutdown uses it before the driver is uninstalled)."""
        with self._state.cond:
            self._state.interrupts += 1
            self._state.cond.notify_all()

    @property
    def misuse(self) -> list[str]:
        """Calls nvml.h does not allow that were made anyway (see ``_api_events``), in order."""
        with self._state.cond:
            return list(self._state.misuse)

    # ----- dispatch ----------------------------------------------------------------------------
    def _call(self, name: str, symbol: Symbol, args: tuple[object, ...]) -> int | bytes:
        st = self._state
        target = partial(self._target, symbol, args)
        if self._faults.hanging:
            self._faults.hang_if_needed(target)
        self._spend_time(name, symbol, args)
        with st.cond:
            self.calls[name] += 1
            if name in self._faults.removed:
                return int(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
            injected = self._faults.injected(name, target)
            if injected is not None:
                return injected
            if symbol.needs_init and st.init_count == 0:
                return int(pynvml.NVML_ERROR_UNINITIALIZED)
            if name in st.node.absent_calls:
                return int(pynvml.NVML_ERROR_NOT_SUPPORTED)
            gpus: list[GpuState] = []
            for handle in args[: symbol.handles]:
                gpu = st.gpu_of(handle)
                if gpu is None:
                    return int(pynvml.NVML_ERROR_INVALID_ARGUMENT)
                gpus.append(gpu)
            if not symbol.lost_ok and any(gpu.lost for gpu in gpus):
                return int(pynvml.NVML_ERROR_GPU_IS_LOST)
            if self._mps.running:  # servers whose daemon went end (see sim/mps.py)
                self._mps.reap_due(st.processes, time.monotonic())
            try:
                return symbol.impl(st, *gpus, *args[symbol.handles :])
            except BadArgument:
                return int(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    def _spend_time(self, name: str, symbol: Symbol, args: tuple[object, ...]) -> None:
        """Take as long as the call takes on this driver (outside the lock, like a real one)."""
        latency = self._state.node.latency
        if latency.cold_start_s > 0 and symbol.target != "none":
            with self._state.cond:
                target = self._target(symbol, args) if self._state.init_count else None
            if target is not None and target not in self._state.warm:
                self._bring_up(target, latency.cold_start_s)
        seconds = latency.of(name)
        if name == "nvmlDeviceGetFieldValues" and latency.fields:
            seconds += latency.of_fields(_field_ids(args))
        if seconds >= MIN_SLEEP_S:
            self._sleep(seconds)

    def _bring_up(self, gpu: int, seconds: float) -> None:
        """The first call on a cold GPU brings it up; others on that GPU wait for it."""
        with self._warm_lock:
            lock = self._warming.setdefault(gpu, threading.Lock())
        with lock:
            if gpu in self._state.warm:
                return
            self._sleep(seconds)
            with self._state.cond:
                self._state.warm.add(gpu)

    def _target(self, symbol: Symbol, args: tuple[object, ...]) -> int | None:
        st = self._state
        try:
            if symbol.target == "handle":
                gpu = st.gpu_of(args[0])
            elif symbol.target == "index":
                return as_int(args[0])
            elif symbol.target == "uuid":
                gpu = st.find_uuid(as_bytes(args[0]))
            elif symbol.target == "pci":
                gpu = st.find_bus_id(as_bytes(args[0]))
            else:
                return None
        except (BadArgument, IndexError):
            return None
        return None if gpu is None else gpu.index

    # ----- control plane -----------------------------------------------------------------------
    def describe(self) -> list[dict[str, object]]:
        """The simulated GPUs and their fault state, JSON-ready, one dict per GPU.

        Keys: index, uuid, name, memory_mib, pci_bus_id, numa_node, mig (the MIG devices'
        profiles), mig_mode and mig_mode_pending ("enabled" or "disabled"), mig_devices (each with
        its UUID, profile and profile ID, GPU and compute instance IDs and placement),
        gpu_instances_without_compute_instance,
        state ("ok" or "lost"), recovery_action ("none", "gpu_reset", …), last_xid (int or None),
        xid_count, ecc_dbe_count, hang_s (what is left of a hang), hung_calls (calls blocked in it
        now), not_supported, call_errors, function_not_found.
        """
        return [self._describe(i) for i in range(len(self._state.gpus))]

    def inject(
        self,
        gpu: int,
        fault: str,
        xid: int | None = None,
        *,
        seconds: object = None,
        symbol: object = None,
        error: object = None,
        action: object = None,
        gpu_instance: object = None,
        compute_instance: object = None,
    ) -> dict[str, object]:
        """Apply a fault to GPU ``gpu`` and return its new description.

        Driver-state faults: ``"xid"`` (needs ``xid``; with ``gpu_instance`` and optionally
        ``compute_instance`` the event names that MIG instance; XIDs that need a reset also set the
        recovery action to GPU_RESET), ``"lost"`` (XID 79, then every call on the GPU returns
        GPU_IS_LOST and event waits do too), ``"ecc_dbe"`` (a double-bit ECC event, recovery
        action GPU_RESET), ``"recovery_action"`` (``action``: none, gpu_reset, node_reboot,
        drain_p2p, drain_and_reset; sets the field and delivers its event with ``eventData`` 0 —
        nothing on a driver before R565) and ``"recover"`` (a GPU reset: answers again, recovery
        action NONE, volatile ECC counts back to 0, and the call faults below cleared).
        Call faults: ``"hang"`` (every call on the GPU blocks for ``seconds``, then answers),
        ``"not_supported"`` (``symbol`` returns NOT_SUPPORTED on this GPU),
        ``"function_not_found"`` (``symbol`` disappears driver-wide, as in an older driver) and
        ``"call_error"`` (``symbol`` fails with ``error`` — unknown, no_permission or timeout — on
        this GPU, or driver-wide for a call that names no GPU); each until the GPU recovers.

        Raises ``ValueError`` for an unknown fault or a bad or misplaced parameter, and
        ``LookupError`` for a GPU index that does not exist.
        """
        if fault not in FAULT_KINDS:
            raise ValueError(f"unknown fault {fault!r} (known: {', '.join(FAULT_KINDS)})")
        if fault in CALL_FAULTS:
            if any(v is not None for v in (action, gpu_instance, compute_instance)):
                raise ValueError(f"fault {fault!r} takes no action or instance")
            self._faults.inject(gpu, fault, xid, seconds, symbol, error)
            return self._describe(gpu)
        if seconds is not None or symbol is not None or error is not None:
            raise ValueError(f"fault {fault!r} takes no seconds, symbol or error")
        self._state.inject(
            gpu,
            fault,
            xid,
            gpu_instance=gpu_instance,
            compute_instance=compute_instance,
            action=action,
        )
        if fault == "recover":
            self._restore(self._faults.recovered(gpu))
        return self._describe(gpu)

    def _describe(self, gpu: int) -> dict[str, object]:
        with self._state.cond:
            described = _gpu_json(self._state.gpus[gpu])
        described.update(self._faults.describe(gpu))
        return described

    # ----- processes (control plane, see sim/processes.py) ------------------------------------
    def add_process(
        self,
        gpu: object,
        pid: object,
        memory_mib: object,
        sm_util: object,
        *,
        gpu_instance: object = None,
        compute_instance: object = None,
        kind: object = "compute",
        name: object = "python3",
        mps_client: object = None,
    ) -> dict[str, object]:
        """Start (or update) process ``pid``'s context on GPU ``gpu``; returns it as JSON. With
        ``mps_client`` (or ``kind`` ``mps``): an MPS client (:mod:`gpuagent.gpu.sim.mps`).
        ``LookupError``: no such GPU; ``Refused``: what the driver refuses; ``ValueError``: a bad
        value, a MIG instance that does not exist, more memory than the GPU (instance) has free."""
        st = self._state
        if isinstance(gpu, bool) or not isinstance(gpu, int):
            raise ValueError(f"'gpu' must be an integer GPU index, got {gpu!r}")  # noqa: TRY004
        connected = mps.connect_process(self._mps, mps_client, kind)
        started = {"pid": pid, "memory_mib": memory_mib, "sm_util": sm_util, "name": name,
                   "gpu_instance": gpu_instance, "compute_instance": compute_instance}  # fmt: skip
        with st.cond:
            if not 0 <= gpu < len(st.gpus):
                raise LookupError(f"no simulated GPU {gpu} (there are {len(st.gpus)})")
            self._mps.reap(st.processes)
            target = st.gpus[gpu]
            if connected is not None:
                process = self._mps.start(target, st.processes, connected, **started)
                return process.describe()
            plain = "compute" if kind == "mps" else kind  # no daemon: CUDA runs without MPS
            process = new_process(target, st.processes, kind=plain, **started)  # type: ignore[arg-type]
            st.processes.add(process)
            return process.describe()

    def remove_process(self, pid: int) -> list[dict[str, object]]:
        """End process ``pid`` on every GPU (and a server it leaves without client or daemon);
        ``LookupError`` when it runs on none."""
        with self._state.cond:
            removed = self._state.processes.remove(pid)
            ended = self._mps.reap(self._state.processes)
        if not removed:
            raise LookupError(f"no simulated process {pid}")
        return [p.describe() for p in (*removed, *ended)]

    def processes(self) -> list[dict[str, object]]:
        """Every simulated process context, by GPU then start order, as JSON."""
        with self._state.cond:
            self._mps.reap(self._state.processes)
            return [p.describe() for p in self._state.processes.all()]

    # ----- test hooks --------------------------------------------------------------------------
    def fail(
        self, symbol: str, code: int, gpu: int | None = None, count: int | None = None
    ) -> None:
        """Make C symbol ``symbol`` return ``code``, only for GPU ``gpu`` if given, ``count`` times.

        Without ``count`` the failure lasts until :meth:`clear_failures`. A later ``fail`` for the
        same symbol and GPU replaces the earlier one.
        """
        self._faults.fail(symbol, code, gpu, count)

    def remove(self, symbol: str) -> None:
        """Make C symbol ``symbol`` disappear, as in an older driver (FUNCTION_NOT_FOUND)."""
        if symbol not in SYMBOLS:
            raise ValueError(f"the simulated driver has no symbol {symbol!r}")
        with self._state.cond:
            self._faults.removed.add(symbol)
        if symbol in vars(self):
            delattr(self, symbol)

    def clear_failures(self) -> None:
        """Undo every :meth:`fail` and :meth:`remove`."""
        self._restore(self._faults.clear())

    def _restore(self, symbols: set[str]) -> None:
        """Put removed C symbols back."""
        for name in symbols:
            setattr(self, name, self._entries[name])


def _field_ids(args: tuple[object, ...]) -> list[int]:
    """The field IDs an ``nvmlDeviceGetFieldValues(device, count, values)`` asks for."""
    try:
        values: Any = out(args[2])
        return [int(values[i].fieldId) for i in range(as_int(args[1]))]
    except (AttributeError, BadArgument, IndexError, TypeError, ValueError):
        return []  # a malformed call: its answer says so


def install(driver: SimDriver) -> None:
    """Make pynvml use ``driver`` as its NVML library (instead of loading libnvidia-ml.so.1)."""
    use_nvml_library(driver)


def uninstall() -> None:
    """Forget any installed driver: pynvml loads the real library on the next ``nvmlInit``."""
    use_nvml_library(None)


@contextmanager
def installed(driver: SimDriver) -> Iterator[SimDriver]:
    """``install(driver)`` for the duration of a ``with`` block, then :func:`uninstall`."""
    install(driver)
    try:
        yield driver
    finally:
        uninstall()


def _placed(mig: MigState) -> dict[str, object]:
    """A GPU instance's profile, ID and placement, as /sim/gpus shows them."""
    spec = mig.spec
    return {
        "profile": spec.name,
        "gpu_instance": spec.gpu_instance_id,
        "placement": {"start": spec.start, "size": spec.profile.memory_slices},
    }


def _gpu_json(gpu: GpuState) -> dict[str, object]:
    """A simulated GPU's state (see :meth:`SimDriver.describe`); the caller holds the lock."""
    spec = gpu.spec
    return {
        "index": spec.index,
        "uuid": spec.uuid,
        "name": spec.name,
        "memory_mib": spec.memory_mib,
        "pci_bus_id": spec.pci_bus_id,
        "numa_node": spec.numa_node,
        "mig": [m.spec.name for m in gpu.migs],
        "mig_mode": "enabled" if gpu.mig_mode else "disabled",
        "mig_mode_pending": "enabled" if gpu.mig_pending else "disabled",
        "compute_mode": _api_process.COMPUTE_MODES.get(gpu.compute_mode, str(gpu.compute_mode)),
        "mig_devices": [
            {
                **_placed(m),
                "uuid": m.spec.uuid,
                "profile_id": m.spec.profile.profile_id,
                "compute_instance": m.spec.compute_instance_id,
            }
            for m in gpu.migs
        ],
        "gpu_instances_without_compute_instance": [_placed(m) for m in gpu.bare],
        "state": "lost" if gpu.lost else "ok",
        "recovery_action": RECOVERY_ACTION_NAMES.get(gpu.recovery_action, str(gpu.recovery_action)),
        "last_xid": gpu.last_xid,
        "xid_count": gpu.xid_count,
        "ecc_dbe_count": gpu.ecc_dbe_count,
    }
