"""Per-container accounting: memory, SM share, energy apportioning, unallocated use."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st
from support.synthetic import gpu_uuid, pods_by_device, synthetic_snapshot

from gpuagent.domain.accounting import UNKNOWN, Ledger, account
from gpuagent.domain.cgroups import CgroupOwner
from gpuagent.domain.devices import Attribution, Gpu, PodRef, Telemetry
from gpuagent.domain.snapshot import Snapshot
from gpuagent.domain.usage import ContainerUsage, GpuProcess, ProcessReading, ProcessSample

GIB = 1024**3
A = PodRef("team-a", "trainer-0", "main")
B = PodRef("team-b", "notebook", "jupyter")
C = PodRef("team-c", "sneaky", "miner")


def cid(n: int) -> str:
    return f"{n:064x}"


NAMES = {cid(1): A, cid(2): B, cid(3): C}
OWNERS: dict[int, CgroupOwner | None] = {
    101: CgroupOwner(cid(1), "uid-a"),
    102: CgroupOwner(cid(1), "uid-a"),
    201: CgroupOwner(cid(2), "uid-b"),
    301: CgroupOwner(cid(3), "uid-c"),
    401: CgroupOwner(cid(99), "uid-x"),  # a container the runtime does not list
    501: None,  # a process on the host
}


def node(
    reading: ProcessReading | None,
    *,
    held: Mapping[str, tuple[PodRef, ...]] | None = None,
    energy_mj: float | None = 1_000_000.0,
    gpus: int = 2,
) -> Snapshot:
    snap = synthetic_snapshot(gpus, refreshed_at=10.0)
    gpu0 = replace(snap.gpus[0], processes=reading, telemetry=Telemetry(energy_mj=energy_mj))
    mapping = held if held is not None else {f"{gpu_uuid(0)}::0": (A,), f"{gpu_uuid(0)}::1": (B,)}
    return replace(
        snap,
        gpus=(gpu0, *snap.gpus[1:]),
        pods=pods_by_device(mapping, refreshed_at=10.0),
    )


def by_name(usages: tuple[ContainerUsage, ...]) -> dict[PodRef, ContainerUsage]:
    return {PodRef(u.namespace, u.pod, u.container): u for u in usages}


def test_mps_clients_are_their_containers_and_the_server_nobodys() -> None:
    """NVML lists the MPS server among the compute processes beside its clients; the server runs
    in the agent's cgroup (its daemon is the agent's child) and is no container's work."""
    agent = CgroupOwner(cid(7), "uid-agent")
    reading = ProcessReading(
        processes=(
            GpuProcess(101, 4 * GIB),
            GpuProcess(201, 2 * GIB),
            GpuProcess(700, 66 * 1024 * 1024, mps_server=True),
        ),
        samples=(ProcessSample(101, 30, 10), ProcessSample(201, 20, 5)),
    )
    names = {**NAMES, cid(7): PodRef("gpuagent", "gpuagent-x1", "agent")}
    usage, _ = account(node(reading), {**OWNERS, 700: agent}, names)
    got = by_name(usage.containers)
    assert set(got) == {A, B}
    assert (got[A].processes, got[A].memory_bytes) == (1, 4 * GIB)
    assert (got[B].processes, got[B].memory_bytes) == (1, 2 * GIB)
    assert not any(u.unallocated for u in usage.containers)
    assert ("gpuagent", "gpuagent-x1", "uid-agent") not in usage.pod_uids


def test_time_sliced_containers_get_their_own_share() -> None:
    reading = ProcessReading(
        processes=(
            GpuProcess(101, 10 * GIB),
            GpuProcess(102, 2 * GIB),
            GpuProcess(201, 6 * GIB),
        ),
        samples=(
            ProcessSample(101, 30, 10),
            ProcessSample(102, 10, 5),
            ProcessSample(201, 45, 20),
        ),
    )
    usage, _ = account(node(reading), OWNERS, NAMES)
    got = by_name(usage.containers)
    assert set(got) == {A, B}
    assert got[A].memory_bytes == 12 * GIB
    assert got[A].processes == 2
    assert got[A].sm_ratio == pytest.approx(0.40)
    assert got[A].mem_ratio == pytest.approx(0.15)
    assert got[B].memory_bytes == 6 * GIB
    assert got[B].sm_ratio == pytest.approx(0.45)
    assert all(u.allocated and not u.unallocated for u in usage.containers)
    assert usage.judged
    # Only GPU 0 has a reading: GPU 1 reports nothing rather than zeros.
    assert {u.gpu for u in usage.containers} == {0}


def test_several_samples_of_one_process_are_averaged_and_unknown_pids_ignored() -> None:
    reading = ProcessReading(
        processes=(GpuProcess(101, GIB),),
        samples=(ProcessSample(101, 20), ProcessSample(101, 60), ProcessSample(999, 90)),
    )
    usage, _ = account(node(reading), OWNERS, NAMES)
    assert by_name(usage.containers)[A].sm_ratio == pytest.approx(0.40)


def test_unknown_containers_and_host_processes_kept_with_empty_names() -> None:
    reading = ProcessReading(
        processes=(GpuProcess(401, GIB), GpuProcess(501, 2 * GIB), GpuProcess(777, 3 * GIB)),
        samples=(),
    )
    usage, _ = account(node(reading, held={}), OWNERS, NAMES)
    (unknown,) = usage.containers
    assert PodRef(unknown.namespace, unknown.pod, unknown.container) == UNKNOWN
    assert unknown.processes == 3
    assert unknown.memory_bytes == 6 * GIB
    assert unknown.sm_ratio == 0.0
    # Not known by name: cannot be judged as unallocated.
    assert not unknown.unallocated


def test_holders_without_processes_show_zero_use() -> None:
    usage, _ = account(node(ProcessReading(samples=())), OWNERS, NAMES)
    got = by_name(usage.containers)
    assert set(got) == {A, B}
    assert all(u.processes == 0 and u.memory_bytes == 0 and u.sm_ratio == 0 for u in got.values())


def test_unallocated_use_is_flagged() -> None:
    reading = ProcessReading(
        processes=(GpuProcess(101, GIB), GpuProcess(301, GIB)), samples=(ProcessSample(301, 50),)
    )
    usage, _ = account(node(reading, held={gpu_uuid(0): (A,)}), OWNERS, NAMES)
    got = by_name(usage.containers)
    assert got[C].unallocated
    assert not got[C].allocated
    assert got[A].allocated
    assert not got[A].unallocated


def test_nothing_is_unallocated_before_the_kubelet_answered() -> None:
    snap = node(ProcessReading(processes=(GpuProcess(301, GIB),), samples=()))
    snap = replace(snap, pods=Attribution())
    usage, _ = account(snap, OWNERS, NAMES)
    assert not usage.judged


def test_no_per_process_utilisation_leaves_shares_and_energy_absent() -> None:
    reading = ProcessReading(processes=(GpuProcess(101, GIB),), samples=None)
    usage, ledger = account(node(reading), OWNERS, NAMES)
    got = by_name(usage.containers)
    assert got[A].memory_bytes == GIB
    assert got[A].sm_ratio is None
    assert got[A].energy_joules is None
    assert not ledger.joules


def polls(
    readings: list[ProcessReading], energies: list[float], held: Mapping[str, tuple[PodRef, ...]]
) -> list[dict[PodRef, ContainerUsage]]:
    ledger = Ledger()
    out = []
    for reading, energy in zip(readings, energies, strict=True):
        snap = node(reading, held=held, energy_mj=energy)
        usage, ledger = account(snap, OWNERS, NAMES, ledger)
        out.append(by_name(usage.containers))
    return out


def test_energy_split_by_sm_share_with_idle_energy_to_holders() -> None:
    held = {f"{gpu_uuid(0)}::0": (A,), f"{gpu_uuid(0)}::1": (B,)}
    reading = ProcessReading(
        processes=(GpuProcess(101, GIB), GpuProcess(301, GIB)),
        samples=(ProcessSample(101, 30), ProcessSample(301, 10)),
    )
    first, second = polls([reading, reading], [1_000_000.0, 1_100_000.0], held)
    # The first poll only sees the counter: everybody starts at 0 J.
    assert {u.energy_joules for u in first.values()} == {0.0}
    # 100 J over the interval; 40 % busy: 30 J to A, 10 J to C (unallocated, still charged);
    # the idle 60 J split between the holders A and B.
    assert second[A].energy_joules == pytest.approx(30 + 30)
    assert second[B].energy_joules == pytest.approx(30)
    assert second[C].energy_joules == pytest.approx(10)
    assert sum(u.energy_joules or 0 for u in second.values()) == pytest.approx(100)


def test_busy_beyond_full_is_split_by_share_and_nothing_is_idle() -> None:
    held = {gpu_uuid(0): (A,)}
    reading = ProcessReading(
        processes=(GpuProcess(101, GIB), GpuProcess(201, GIB)),
        samples=(ProcessSample(101, 90), ProcessSample(201, 60)),
    )
    _, second = polls([reading, reading], [0.0, 150_000.0], held)
    assert second[A].energy_joules == pytest.approx(90)
    assert second[B].energy_joules == pytest.approx(60)


def test_idle_gpu_without_holders_charges_nobody() -> None:
    reading = ProcessReading(samples=())
    _, second = polls([reading, reading], [0.0, 50_000.0], {})
    assert second == {}


def test_energy_counter_restart_adds_nothing_and_never_decreases() -> None:
    held = {gpu_uuid(0): (A,)}
    reading = ProcessReading(processes=(GpuProcess(101, GIB),), samples=(ProcessSample(101, 50),))
    got = polls([reading] * 4, [0.0, 10_000.0, 5_000.0, 15_000.0], held)
    totals = [g[A].energy_joules for g in got]
    assert totals == pytest.approx([0.0, 10.0, 10.0, 20.0])


def test_a_container_that_leaves_restarts_from_zero() -> None:
    held: dict[str, tuple[PodRef, ...]] = {}
    with_c = ProcessReading(processes=(GpuProcess(301, GIB),), samples=(ProcessSample(301, 100),))
    without = ProcessReading(samples=())
    got = polls([with_c, with_c, without, with_c], [0.0, 10_000.0, 20_000.0, 30_000.0], held)
    assert got[1][C].energy_joules == pytest.approx(10)
    assert C not in got[2]
    # Back again: a new counter (a reset for Prometheus) holding only the latest interval.
    assert got[3][C].energy_joules == pytest.approx(10)


def test_a_gpu_without_a_reading_keeps_its_counters() -> None:
    held = {gpu_uuid(0): (A,)}
    reading = ProcessReading(processes=(GpuProcess(101, GIB),), samples=(ProcessSample(101, 100),))
    ledger = Ledger()
    for snap in (
        node(reading, held=held, energy_mj=0.0),
        node(reading, held=held, energy_mj=10_000.0),
        node(None, held=held, energy_mj=15_000.0),
        node(reading, held=held, energy_mj=20_000.0),
    ):
        usage, ledger = account(snap, OWNERS, NAMES, ledger)
    assert by_name(usage.containers)[A].energy_joules == pytest.approx(20)


def mig_node(reading: ProcessReading, held: Mapping[str, tuple[PodRef, ...]]) -> Snapshot:
    snap = synthetic_snapshot(1, mig=True, refreshed_at=10.0)
    gpu = replace(snap.gpus[0], processes=reading)
    return replace(snap, gpus=(gpu,), pods=pods_by_device(held, refreshed_at=10.0))


def test_mig_processes_are_credited_to_their_instance() -> None:
    gpu: Gpu = synthetic_snapshot(1, mig=True).gpus[0]
    first, second = gpu.mig_devices[0], gpu.mig_devices[3]
    reading = ProcessReading(
        processes=(
            GpuProcess(101, GIB, first.gpu_instance_id, 0),
            GpuProcess(201, 3 * GIB, second.gpu_instance_id, 0),
        ),
        samples=None,
    )
    usage, _ = account(mig_node(reading, {first.uuid: (A,), second.uuid: (C,)}), OWNERS, NAMES)
    got = by_name(usage.containers)
    assert (got[A].gpu_instance, got[A].memory_bytes) == (first.gpu_instance_id, GIB)
    assert (got[B].gpu_instance, got[B].memory_bytes) == (second.gpu_instance_id, 3 * GIB)
    assert got[A].allocated
    assert got[B].unallocated
    # The holder of the second instance runs nothing there.
    assert got[C].gpu_instance == second.gpu_instance_id
    assert got[C].processes == 0
    assert all(u.sm_ratio is None and u.energy_joules is None for u in usage.containers)


@given(
    st.lists(
        st.tuples(st.sampled_from(sorted(OWNERS)), st.floats(0, 100), st.integers(0, 2**36)),
        max_size=12,
    ),
    st.lists(st.floats(0, 1e7), min_size=2, max_size=5),
)
def test_energy_never_exceeds_the_gpus_and_never_decreases(
    procs: list[tuple[int, float, int]], energies: list[float]
) -> None:
    reading = ProcessReading(
        processes=tuple(GpuProcess(pid, mem) for pid, _, mem in procs),
        samples=tuple(ProcessSample(pid, sm) for pid, sm, _ in procs),
    )
    ledger = Ledger()
    before: dict[tuple[str, str, str], float] = {}
    gained = 0.0
    for previous, energy in zip([None, *energies], energies, strict=False):
        usage, ledger = account(node(reading, energy_mj=energy), OWNERS, NAMES, ledger)
        totals = {
            (u.namespace, u.pod, u.container): u.energy_joules or 0.0 for u in usage.containers
        }
        for key, value in totals.items():
            assert value >= before.get(key, 0.0) - 1e-9
        before = totals
        if previous is not None and energy >= previous:
            gained += (energy - previous) / 1000
        assert sum(totals.values()) <= gained + 1e-6


def test_pod_uids_come_from_the_processes_cgroups() -> None:
    """The pods whose GPU processes' cgroups name their UID, once each; a container the runtime
    does not name, a host process or a cgroup without a pod UID gives none."""
    owners = {**OWNERS, 601: CgroupOwner(cid(2), "")}
    reading = ProcessReading(
        processes=(
            GpuProcess(101, GIB),
            GpuProcess(102, GIB),
            GpuProcess(301, GIB),
            GpuProcess(401, GIB),
            GpuProcess(501, GIB),
            GpuProcess(601, GIB),
        ),
        samples=(),
    )
    usage, _ = account(node(reading), owners, NAMES)
    # team-b/notebook holds the GPU, but its process's cgroup names no UID: not listed.
    assert usage.pod_uids == (("team-a", "trainer-0", "uid-a"), ("team-c", "sneaky", "uid-c"))
