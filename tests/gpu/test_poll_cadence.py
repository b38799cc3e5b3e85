"""A poll costs only what it must, and no consumer loses accuracy for it.

The agent's probe takes the costly readings (the energy counter, the throttling times where the
field values lack them, per-process utilisation on a GPU without processes) less often than every
poll (:mod:`gpuagent.gpu.cadence`). Here the readers at the agent's cadence and readers of every
value every poll (the reference) read the same simulated GPUs at the same instants, and their
consumers' results are compared, with the tolerances the docs state (docs/metrics.md):

* the energy figure (``DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION``) is the driver's counter where read,
  never falls, and is never further from the counter, nor its increase over 5 minutes from the
  counter's, than the load's :class:`Tolerance`;
* each container's energy (``gpuagent_container_gpu_energy_joules_total``) is within the load's
  tolerance of the reference's, and each poll's SM share is the same;

under the simulator's smooth load and under bursty ones (power a square wave out of step with
the polls, read as Hopper reads it: its mean over the last second). And the readings that
health is judged from are read every poll, whatever the cadence: a change shows in the very
next probe.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pynvml
import pytest
from support.clock import FakeClock
from support.synthetic import gpu_uuid, pods_by_device, synthetic_snapshot

from gpuagent.domain.accounting import Ledger, account
from gpuagent.domain.cgroups import CgroupOwner
from gpuagent.domain.devices import PodRef
from gpuagent.domain.snapshot import Snapshot
from gpuagent.gpu.cadence import ENERGY, VIOLATIONS, Cadence
from gpuagent.gpu.calls import NvmlCalls
from gpuagent.gpu.nvml import Nvml
from gpuagent.gpu.processes import ProcessReader
from gpuagent.gpu.sim import SimDriver, _api_device, install, node_from_mapping, uninstall
from gpuagent.gpu.sim import telemetry as sim_telemetry
from gpuagent.gpu.telemetry import TelemetryReader

EVERY_POLL = Cadence(0.0)
POLL_S = 5.0  # the default --poll-interval
GPUS = 2

A = PodRef("team-a", "trainer", "main")
B = PodRef("team-b", "notebook", "jupyter")
OWNERS = {101: CgroupOwner("a" * 64, "uid-a"), 201: CgroupOwner("b" * 64, "uid-b")}
NAMES = {"a" * 64: A, "b" * 64: B}


@dataclass
class Readers:
    """One GPU-reading pipeline: telemetry and processes, and accounting's ledger."""

    telemetry: TelemetryReader
    processes: ProcessReader
    ledger: Ledger = field(default_factory=Ledger)


def square_wave(low_w: float, high_w: float, half_s: float) -> Callable[..., Any]:
    """A replacement for the simulator's sample: power alternating between ``low_w`` and
    ``high_w`` every ``half_s`` seconds, the energy counter its exact integral, and the power
    read its mean over the last second (as ``nvmlDeviceGetPowerUsage`` reads on Hopper)."""
    real = sim_telemetry.sample

    def joules(t: float) -> float:
        halves = math.floor(t / half_s)
        high = halves % 2 == 1
        done = (halves // 2) * (low_w + high_w) * half_s + (low_w * half_s if high else 0.0)
        return 1_000_000.0 + done + (high_w if high else low_w) * (t - halves * half_s)

    def sample(profile: Any, index: int, memory_mib: int, t: float) -> sim_telemetry.Sample:
        return replace(
            real(profile, index, memory_mib, t),
            power_mw=round((joules(t) - joules(t - 1.0)) * 1000),
            energy_mj=round(joules(t) * 1000),
        )

    return sample


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(1000.0)


@pytest.fixture
def node(clock: FakeClock, tmp_path: Path) -> Iterator[tuple[SimDriver, list[Any], NvmlCalls]]:
    """Two simulated H200s, discovered; their handles and the backend's call bookkeeping."""
    node = node_from_mapping({"version": "v1", "gpus": [{"name": "h200"}] * GPUS})
    drv = SimDriver(node, clock=clock, sleep=lambda _: None)  # its latencies are not the point
    install(drv)
    backend = Nvml(sysfs_root=tmp_path, clock=clock)
    try:
        backend.init()
        backend.discover()
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(GPUS)]
        yield drv, handles, backend.calls
    finally:
        backend.shutdown()
        uninstall()


def pipelines(calls: NvmlCalls, clock: FakeClock) -> tuple[Readers, Readers]:
    """The agent's cadence, and the reference reading everything every poll."""
    agent = Readers(TelemetryReader(calls, clock), ProcessReader(calls))
    reference = Readers(
        TelemetryReader(calls, clock, energy=EVERY_POLL, violations=EVERY_POLL),
        ProcessReader(calls),
    )
    return agent, reference


def base_snapshot() -> Snapshot:
    """A node where A and B share GPU 0 (time-slicing) and GPU 1 is held by nobody."""
    snap = synthetic_snapshot(GPUS, refreshed_at=10.0)
    held = {f"{gpu_uuid(0)}::0": (A,), f"{gpu_uuid(0)}::1": (B,)}
    return replace(snap, pods=pods_by_device(held, refreshed_at=10.0))


def step(readers: Readers, handles: list[Any], base: Snapshot) -> Snapshot:
    """One poll through ``readers``: every GPU read, then accounted; the snapshot it makes."""
    gpus = []
    for gpu, handle in zip(base.gpus, handles, strict=True):
        reading = readers.telemetry.read(gpu.index, handle)
        processes = readers.processes.read(gpu.index, handle)
        gpus.append(replace(gpu, telemetry=reading.telemetry, processes=processes))
    snapshot = replace(base, gpus=tuple(gpus))
    usage, readers.ledger = account(snapshot, OWNERS, NAMES, readers.ledger)
    return replace(snapshot, usage=usage)


def run(
    drv: SimDriver, handles: list[Any], calls: NvmlCalls, clock: FakeClock, polls: int
) -> tuple[list[Snapshot], list[Snapshot], list[float]]:
    """``polls`` polls ``POLL_S`` apart through both pipelines, the containers' SM use changing
    every poll; the snapshots of each, and the driver's true counter of GPU 0 at each poll."""
    agent, reference = pipelines(calls, clock)
    base = base_snapshot()
    mine, theirs, counter = [], [], []
    try:
        for n in range(polls):
            a_util = 10 + (37 * n) % 80  # 10..89 %, in no step with anything
            drv.add_process(0, 101, 2048, a_util)
            drv.add_process(0, 201, 1024, (61 * n) % 100 * (100 - a_util) / 100)
            clock.now += POLL_S
            mine.append(step(agent, handles, base))
            theirs.append(step(reference, handles, base))
            counter.append(pynvml.nvmlDeviceGetTotalEnergyConsumption(handles[0]))
    finally:
        agent.telemetry.close()
        reference.telemetry.close()
    return mine, theirs, counter


def joules(snapshot: Snapshot) -> dict[PodRef, float]:
    return {
        PodRef(u.namespace, u.pod, u.container): u.energy_joules or 0.0
        for u in snapshot.usage.containers
        if u.gpu == 0
    }


def shares(snapshot: Snapshot) -> dict[PodRef, float | None]:
    return {
        PodRef(u.namespace, u.pod, u.container): u.sm_ratio
        for u in snapshot.usage.containers
        if u.gpu == 0
    }


# ----- consumers' results against the every-poll reference ---------------------------------------
@dataclass(frozen=True)
class Tolerance:
    """What a load may cost the consumers, against the every-poll reference (docs/metrics.md).

    ``figure``: the energy figure's largest distance from the driver's counter, as a share of
    one cadence period's energy; ``rate``: the largest relative error of its increase over any
    5-minute window (``rate(...[5m])``); ``container``: each container's energy, relative."""

    figure: float
    rate: float
    container: float


#: The simulator's smooth load, and square waves of 150 / 650 W out of step with the polls.
LOADS: dict[str, tuple[float | None, Tolerance]] = {
    "smooth": (None, Tolerance(figure=0.005, rate=0.001, container=0.001)),
    "bursty, 2.6 s period": (1.3, Tolerance(figure=0.35, rate=0.05, container=0.03)),
    "bursty, 7.4 s period": (3.7, Tolerance(figure=0.2, rate=0.04, container=0.02)),
    "bursty, 40 s period": (20.0, Tolerance(figure=0.005, rate=0.001, container=0.001)),
}
WINDOW_POLLS = int(300 / POLL_S)


@pytest.mark.parametrize("load", list(LOADS))
def test_consumers_match_the_every_poll_reference(
    node: tuple[SimDriver, list[Any], NvmlCalls],
    clock: FakeClock,
    monkeypatch: pytest.MonkeyPatch,
    load: str,
) -> None:
    """Ten minutes at the default poll: the energy figure never falls, equals the counter where
    read and stays within the load's tolerance of it; its increase over 5-minute windows and
    each container's energy are within the load's tolerance of the reference's; SM shares and
    power are the same poll for poll."""
    half_s, tolerance = LOADS[load]
    if half_s is not None:
        monkeypatch.setattr(sim_telemetry, "sample", square_wave(150.0, 650.0, half_s))
    drv, handles, calls = node
    mine, theirs, counter = run(drv, handles, calls, clock, polls=120)
    served = [s.gpus[0].telemetry.energy_mj for s in mine]
    figures = [float(v) for v in served if v is not None]
    assert len(figures) == len(counter)
    assert figures == sorted(figures), "the energy figure fell"
    assert sum(f == c for f, c in zip(figures, counter, strict=True)) >= len(counter) // 7
    period_mj = (counter[-1] - counter[0]) / (len(counter) - 1) * ENERGY.period_s / POLL_S
    worst = max(abs(f - c) for f, c in zip(figures, counter, strict=True))
    assert worst <= tolerance.figure * period_mj
    for i in range(len(counter) - WINDOW_POLLS):
        want = counter[i + WINDOW_POLLS] - counter[i]
        got = figures[i + WINDOW_POLLS] - figures[i]
        assert got == pytest.approx(want, rel=tolerance.rate), f"window from poll {i}"
    for m, t in zip(mine, theirs, strict=True):
        assert shares(m) == shares(t)
        assert m.gpus[0].telemetry.power_w == t.gpus[0].telemetry.power_w
    got_j, want_j = joules(mine[-1]), joules(theirs[-1])
    assert set(got_j) == set(want_j) == {A, B}
    for ref in want_j:
        assert want_j[ref] > 0
        assert got_j[ref] == pytest.approx(want_j[ref], rel=tolerance.container), ref


def test_a_container_alone_on_its_gpu_gets_the_gpus_energy(
    node: tuple[SimDriver, list[Any], NvmlCalls],
    clock: FakeClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A GPU's energy is all its holders', whatever the estimate between reads: one container
    holding the GPU has the energy figure's whole increase at every poll, and so exactly the
    reference's joules wherever the figure is the counter."""
    monkeypatch.setattr(sim_telemetry, "sample", square_wave(150.0, 650.0, 3.7))
    drv, handles, calls = node
    agent, reference = pipelines(calls, clock)
    base = replace(
        base_snapshot(), pods=pods_by_device({f"{gpu_uuid(0)}::0": (A,)}, refreshed_at=10.0)
    )
    drv.add_process(0, 101, 2048, 40)
    first: float | None = None
    on_counter = 0
    try:
        for _ in range(40):
            clock.now += POLL_S
            mine, theirs = step(agent, handles, base), step(reference, handles, base)
            figure = mine.gpus[0].telemetry.energy_mj
            assert figure is not None
            first = figure if first is None else first
            assert joules(mine)[A] == pytest.approx((figure - first) / 1000, rel=1e-9, abs=1e-9)
            if figure == theirs.gpus[0].telemetry.energy_mj:
                on_counter += 1
                assert joules(mine)[A] == pytest.approx(joules(theirs)[A], rel=1e-9, abs=1e-9)
    finally:
        agent.telemetry.close()
        reference.telemetry.close()
    assert on_counter >= 5


# ----- what each poll costs, and what is read every poll ------------------------------------------
def test_costly_readings_once_a_period_staggered_over_the_gpus(
    node: tuple[SimDriver, list[Any], NvmlCalls],
    clock: FakeClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under a steady load the energy counter is read once per GPU and period (not every poll),
    the GPUs' reads in different polls; an idle GPU's per-process utilisation is asked once."""
    monkeypatch.setattr(sim_telemetry, "sample", square_wave(300.0, 300.0, 1.0))
    drv, handles, calls = node
    agent, _ = pipelines(calls, clock)
    polls = 72  # six minutes: twelve periods
    energy_rounds = []
    try:
        for _ in range(polls):
            clock.now += POLL_S
            before = Counter(drv.calls)
            for index, handle in enumerate(handles):
                agent.telemetry.read(index, handle)
                agent.processes.read(index, handle)
            made = Counter(drv.calls)
            made.subtract(before)
            energy_rounds.append(made["nvmlDeviceGetTotalEnergyConsumption"])
    finally:
        agent.telemetry.close()
    periods = polls * POLL_S / ENERGY.period_s
    assert periods * GPUS <= sum(energy_rounds) <= (periods + 1) * GPUS
    assert energy_rounds[0] == GPUS  # the first poll reads every GPU's counter
    assert max(energy_rounds[1:]) == 1  # then the two GPUs' reads never fall in one poll
    assert drv.calls["nvmlDeviceGetProcessesUtilizationInfo"] == GPUS


#: What health is judged from, read by every probe: (what, the call, its field ids if batched).
HEALTH_READINGS = (
    ("liveness", "nvmlDeviceGetPerformanceState", ()),
    ("temperature", "nvmlDeviceGetTemperature", ()),
    ("power", "nvmlDeviceGetPowerUsage", ()),
    (
        "ECC, row remapping, recovery action, memory temperature, PCIe replays",
        "nvmlDeviceGetFieldValues",
        (
            pynvml.NVML_FI_DEV_ECC_SBE_VOL_TOTAL,
            pynvml.NVML_FI_DEV_ECC_DBE_VOL_TOTAL,
            pynvml.NVML_FI_DEV_REMAPPED_COR,
            pynvml.NVML_FI_DEV_REMAPPED_UNC,
            pynvml.NVML_FI_DEV_REMAPPED_PENDING,
            pynvml.NVML_FI_DEV_REMAPPED_FAILURE,
            pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION,
            pynvml.NVML_FI_DEV_MEMORY_TEMP,
            pynvml.NVML_FI_DEV_PCIE_REPLAY_COUNTER,
        ),
    ),
)


def test_health_readings_every_poll(
    node: tuple[SimDriver, list[Any], NvmlCalls],
    clock: FakeClock,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every probe makes each health-relevant call and asks each health-relevant field, and an
    ECC error shows in the probe right after it, whichever poll of a period that is."""
    asked: list[list[int]] = []
    real = pynvml.nvmlDeviceGetFieldValues

    def spy(handle: Any, ids: list[Any]) -> Any:
        asked.append([i[0] if isinstance(i, tuple) else i for i in ids])
        return real(handle, ids)

    monkeypatch.setattr(pynvml, "nvmlDeviceGetFieldValues", spy)
    drv, _, _ = node
    backend = Nvml(sysfs_root=tmp_path, clock=clock)
    backend.init()
    backend.discover()
    try:
        for n in range(2 * int(ENERGY.period_s / POLL_S)):
            clock.now += POLL_S
            before, asked[:] = Counter(drv.calls), []
            if n % 3 == 1:
                drv.inject(1, "ecc_dbe")
            probe = backend.probe(1)
            made = Counter(drv.calls)
            made.subtract(before)
            for what, call, field_ids in HEALTH_READINGS:
                assert made[call] >= 1, f"poll {n}: {what} not read"
                if field_ids:
                    assert len(asked) == 1
                    assert set(field_ids) <= set(asked[0]), f"poll {n}: {what} not asked"
            assert probe.telemetry.temperature_c is not None
            assert probe.telemetry.ecc_dbe_volatile == (n + 2) // 3
    finally:
        backend.shutdown()


def test_throttling_times_by_their_own_call_once_a_period(
    node: tuple[SimDriver, list[Any], NvmlCalls],
    clock: FakeClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the field values lack the throttling times (the real H200's driver), their call
    (0.6 ms each there) is made once a period, and the last values are served in between."""
    real = _api_device._field
    policies = (pynvml.NVML_FI_DEV_PERF_POLICY_POWER, pynvml.NVML_FI_DEV_PERF_POLICY_THERMAL)

    def lacking(st: Any, gpu: Any, fid: int, *rest: Any) -> Any:
        return None if fid in policies else real(st, gpu, fid, *rest)

    monkeypatch.setattr(_api_device, "_field", lacking)
    drv, handles, calls = node
    agent, _ = pipelines(calls, clock)
    polls = 36
    try:
        before = drv.calls["nvmlDeviceGetViolationStatus"]
        for _ in range(polls):
            clock.now += POLL_S
            t = agent.telemetry.read(0, handles[0]).telemetry
            assert t.power_violation_ns is not None
            assert t.thermal_violation_ns is not None
        made = drv.calls["nvmlDeviceGetViolationStatus"] - before
    finally:
        agent.telemetry.close()
    periods = polls * POLL_S / VIOLATIONS.period_s
    assert 2 * periods <= made <= 2 * (periods + 1)


def test_throttling_fields_in_the_batch_once_a_period(
    node: tuple[SimDriver, list[Any], NvmlCalls],
    clock: FakeClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the field values carry the throttling times, their slots (~0.5 ms each in the real
    H200's batch) are asked once a period; the last values are served in between."""
    asked: list[list[int]] = []
    real = pynvml.nvmlDeviceGetFieldValues

    def spy(handle: Any, ids: list[Any]) -> Any:
        asked.append([i[0] if isinstance(i, tuple) else i for i in ids])
        return real(handle, ids)

    monkeypatch.setattr(pynvml, "nvmlDeviceGetFieldValues", spy)
    drv, handles, calls = node
    agent, _ = pipelines(calls, clock)
    policies = {pynvml.NVML_FI_DEV_PERF_POLICY_POWER, pynvml.NVML_FI_DEV_PERF_POLICY_THERMAL}
    polls = 36
    try:
        for _ in range(polls):
            clock.now += POLL_S
            t = agent.telemetry.read(0, handles[0]).telemetry
            assert t.power_violation_ns is not None
            assert t.thermal_violation_ns is not None
    finally:
        agent.telemetry.close()
    assert len(asked) == polls
    with_policies = sum(policies <= set(ids) for ids in asked)
    periods = polls * POLL_S / VIOLATIONS.period_s
    assert periods <= with_policies <= periods + 1
    assert drv.calls["nvmlDeviceGetViolationStatus"] == 0


def test_every_poll_cadence_reads_every_poll(
    node: tuple[SimDriver, list[Any], NvmlCalls], clock: FakeClock
) -> None:
    """The reference pipeline is what it claims: the energy counter read by every probe."""
    drv, handles, calls = node
    _, reference = pipelines(calls, clock)
    try:
        before = drv.calls["nvmlDeviceGetTotalEnergyConsumption"]
        for _ in range(10):
            clock.now += POLL_S
            reference.telemetry.read(0, handles[0])
        assert drv.calls["nvmlDeviceGetTotalEnergyConsumption"] - before == 10
    finally:
        reference.telemetry.close()


def test_a_closed_reader_reads_the_counter_at_once_when_used_again(
    node: tuple[SimDriver, list[Any], NvmlCalls], clock: FakeClock
) -> None:
    """After close (NVML shut down and initialised again) nothing estimated before is carried
    over: the first read takes the counter again."""
    drv, handles, calls = node
    agent, _ = pipelines(calls, clock)
    try:
        agent.telemetry.read(0, handles[0])
        clock.now += POLL_S
        before = drv.calls["nvmlDeviceGetTotalEnergyConsumption"]
        agent.telemetry.read(0, handles[0])
        assert drv.calls["nvmlDeviceGetTotalEnergyConsumption"] == before  # estimated
        agent.telemetry.close()
        clock.now += POLL_S
        agent.telemetry.read(0, handles[0])
        assert drv.calls["nvmlDeviceGetTotalEnergyConsumption"] == before + 1
    finally:
        agent.telemetry.close()
