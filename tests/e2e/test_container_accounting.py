"""Per-container GPU accounting end to end: a real agent on the simulated driver, processes started
over /sim/processes, their cgroup files under --proc-root (every runtime, driver and cgroup
version), a CRI stand-in on grpcio and the kubelet's pod-resources stand-in."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from structlog.testing import capture_logs
from support.cgroups import LAYOUTS, Layout, cgroup_file, host_cgroup_file, write_proc
from support.fake_cri import FakeCri, RuntimeContainer
from support.fake_podresources import FakePodResources, Held
from support.grpcstubs import CriStubs, StubModules

from e2e.agentrun import RunningAgent, running_agent
from gpuagent.gpu.sim import load_sim_config

T = 10.0
GPU = "nvidia.com/gpu"
MIB = 1024 * 1024
MEMORY = "gpuagent_container_gpu_memory_used_bytes"
SM = "gpuagent_container_gpu_sm_utilization_ratio"
ENERGY = "gpuagent_container_gpu_energy_joules_total"
PROCESSES = "gpuagent_container_gpu_processes"
UNALLOCATED = "gpuagent_gpu_unallocated_use"


@dataclass(frozen=True)
class Workload:
    """A container with one GPU process: its pid, cgroup layout and names."""

    pid: int
    layout: Layout
    namespace: str
    pod: str
    container: str = "main"

    @property
    def container_id(self) -> str:
        return f"{self.pid:064x}"

    @property
    def pod_uid(self) -> str:
        return f"{self.pid:08x}-0000-4000-8000-{self.pid:012x}"

    def runtime_container(self) -> RuntimeContainer:
        return RuntimeContainer(
            self.container_id, self.namespace, self.pod, self.container, pod_uid=self.pod_uid
        )


TRAINER = Workload(1001, Layout("containerd", "systemd", 2, "guaranteed"), "ml", "trainer")
NOTEBOOK = Workload(1002, Layout("cri-o", "cgroupfs", 1, "besteffort"), "ds", "notebook")
MINER = Workload(1003, Layout("docker", "systemd", 1, "burstable"), "sneaky", "miner")
GHOST = Workload(1004, Layout("containerd", "cgroupfs", 2), "gone", "ghost")  # not in the CRI
HOST_PID = 1005


@pytest.fixture
def pod_resources(short_tmp_path: Path, grpc_stubs: StubModules) -> Iterator[FakePodResources]:
    with FakePodResources(short_tmp_path / "pr" / "kubelet.sock", grpc_stubs) as fake:
        yield fake


@pytest.fixture
def runtime(short_tmp_path: Path, cri_stubs: CriStubs) -> Iterator[FakeCri]:
    with FakeCri(short_tmp_path / "cri" / "containerd.sock", cri_stubs) as fake:
        fake.set(w.runtime_container() for w in (TRAINER, NOTEBOOK, MINER))
        yield fake


@pytest.fixture
def proc_root(tmp_path: Path) -> Path:
    files = {
        w.pid: cgroup_file(w.layout, w.pod_uid, w.container_id)
        for w in (TRAINER, NOTEBOOK, MINER, GHOST)
    }
    files[HOST_PID] = host_cgroup_file()
    return write_proc(tmp_path / "proc", files)


def args(
    pod_resources: FakePodResources, runtime: FakeCri, proc_root: Path, *extra: str
) -> tuple[str, ...]:
    return (
        "--pod-resources-socket", str(pod_resources.socket_path),
        "--cri-socket", str(runtime.socket_path),
        "--proc-root", str(proc_root),
        # No kubelet log links here: names come from the CRI stand-in.
        "--container-logs-dir", str(proc_root / "no-log-links"),
        # Longer than the simulated driver's sampling period: every poll sees new samples.
        "--poll-interval", "0.3",
        *extra,
    )  # fmt: skip


AccountingAgent = Callable[..., AbstractAsyncContextManager[RunningAgent]]


@pytest.fixture
def accounting_agent(
    device_plugin_dir: Path, pod_resources: FakePodResources, runtime: FakeCri, proc_root: Path
) -> AccountingAgent:
    """``accounting_agent(*options)``: an agent with ``options`` (the node: ``--simulate N`` or
    ``--sim-config FILE``, and any other) and :func:`args`, on this module's stand-ins."""

    def start(*options: str) -> AbstractAsyncContextManager[RunningAgent]:
        return running_agent(
            device_plugin_dir, (*options, *args(pod_resources, runtime, proc_root))
        )

    return start


Sample = tuple[dict[str, str], float]


def samples(text: str, name: str) -> list[Sample]:
    return [
        (dict(s.labels), float(s.value))
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == name
    ]


def by_pod(text: str, name: str, gpu: str = "0") -> dict[str, float]:
    return {labels["pod"]: v for labels, v in samples(text, name) if labels["gpu"] == gpu}


def gpu_value(text: str, name: str, gpu: str = "0") -> float:
    values = {v for labels, v in samples(text, name) if labels["gpu"] == gpu}
    assert len(values) == 1, (name, values)
    return values.pop()


async def start(
    run: RunningAgent, gpu: int, pid: int, memory_mib: float, sm: float, **more: object
) -> None:
    body = {"gpu": gpu, "pid": pid, "memory_mib": memory_mib, "sm_util": sm, **more}
    async with run.http.post(run.base_url + "/sim/processes", json=body) as response:
        assert response.status == 200, await response.text()


async def end(run: RunningAgent, pid: int) -> None:
    async with run.http.delete(f"{run.base_url}/sim/processes/{pid}") as response:
        assert response.status == 200, await response.text()


async def test_time_sliced_containers_get_their_own_share(
    accounting_agent: AccountingAgent, pod_resources: FakePodResources, runtime: FakeCri
) -> None:
    # Two time-slicing replicas of GPU 0 (index form), allocated before the agent starts.
    pod_resources.set(
        [
            Held("ml", "trainer", "main", GPU, ("0::0",)),
            Held("ds", "notebook", "main", GPU, ("0::1",)),
        ]
    )
    async with accounting_agent("--simulate", "2") as run:
        uuid = run.uuids[0]
        await start(run, 0, TRAINER.pid, 10_000, 30)
        await start(run, 0, NOTEBOOK.pid, 6_000, 45)
        # A probe reads memory, then the processes: one that straddled a start reads them apart.
        await run.polls(2)

        def shared(text: str) -> bool:
            sm = by_pod(text, SM)
            return (
                by_pod(text, MEMORY).keys() == {"trainer", "notebook"}
                and sm.get("trainer", 0) > 0
                and sm.get("notebook", 0) > 0
            )

        text = await run.metrics_until(shared)
        memory = by_pod(text, MEMORY)
        assert memory == {"trainer": 10_000 * MIB, "notebook": 6_000 * MIB}
        assert sum(memory.values()) == gpu_value(text, "DCGM_FI_DEV_FB_USED") * MIB
        sm = by_pod(text, SM)
        assert sm == pytest.approx({"trainer": 0.30, "notebook": 0.45})
        assert sum(sm.values()) == pytest.approx(gpu_value(text, "DCGM_FI_DEV_GPU_UTIL") / 100)
        assert by_pod(text, PROCESSES) == {"trainer": 1, "notebook": 1}
        # The GPU by its index: its identity is gpuagent_gpu_info's, once.
        labels = next(lbl for lbl, _ in samples(text, MEMORY) if lbl["pod"] == "trainer")
        assert labels == {"gpu": "0", "container": "main", "namespace": "ml", "pod": "trainer"}
        (info,) = [lbl for lbl, _ in samples(text, "gpuagent_gpu_info") if lbl["gpu"] == "0"]
        assert info["uuid"] == uuid
        # Both hold the GPU and only use it as allocated.
        assert by_pod(text, UNALLOCATED) == {"": 0}
        # The GPU's energy counter is shared out as time passes: from here on the notebook
        # (45 % of SM time) gains more than the trainer (30 %); idle energy is split evenly.
        before = by_pod(text, ENERGY)
        text = await run.metrics_until(
            lambda t: all(by_pod(t, ENERGY)[p] > before[p] for p in ("trainer", "notebook"))
        )
        after = by_pod(text, ENERGY)
        assert after["notebook"] - before["notebook"] > after["trainer"] - before["trainer"] > 0
        # The shared GPU's dcgm-exporter series: one, the whole GPU's, without pod labels.
        util = {
            lbl["pod"]: v for lbl, v in samples(text, "DCGM_FI_DEV_GPU_UTIL") if lbl["gpu"] == "0"
        }
        assert util == {"": 75}
        # A process that exits is gone at the next poll (the container holds the GPU still).
        await end(run, NOTEBOOK.pid)
        text = await run.metrics_until(lambda t: by_pod(t, PROCESSES).get("notebook") == 0)
        assert by_pod(text, MEMORY)["notebook"] == 0
        assert by_pod(text, MEMORY)["trainer"] == 10_000 * MIB
        # Names came from one CRI refresh, never per scrape or poll.
        assert runtime.calls == 1


async def test_dcgm_series_carry_each_containers_share_when_asked(
    accounting_agent: AccountingAgent, pod_resources: FakePodResources
) -> None:
    pod_resources.set(
        [
            Held("ml", "trainer", "main", GPU, ("0::0",)),
            Held("ds", "notebook", "main", GPU, ("0::1",)),
        ]
    )
    async with accounting_agent("--simulate", "1", "--dcgm-container-shares") as run:
        await start(run, 0, TRAINER.pid, 4_000, 20)
        await start(run, 0, NOTEBOOK.pid, 2_000, 50)

        def split(text: str) -> bool:
            util = {lbl["pod"]: v for lbl, v in samples(text, "DCGM_FI_DEV_GPU_UTIL")}
            return util == {"trainer": 20, "notebook": 50}

        text = await run.metrics_until(split)
        fb = {lbl["pod"]: v for lbl, v in samples(text, "DCGM_FI_DEV_FB_USED")}
        assert fb == {"trainer": 4_000, "notebook": 2_000}
        # Physical readings stay the GPU's.
        temps = {v for _, v in samples(text, "DCGM_FI_DEV_GPU_TEMP")}
        assert len(temps) == 1


async def test_unknown_containers_and_unallocated_use(
    accounting_agent: AccountingAgent, pod_resources: FakePodResources, runtime: FakeCri
) -> None:
    pod_resources.set([Held("ml", "trainer", "main", GPU, ("0",))])
    async with accounting_agent("--simulate", "2") as run:
        uuid1 = run.uuids[1]
        await start(run, 0, TRAINER.pid, 1_000, 10)
        # A privileged pod seeing every GPU runs on GPU 1, which nobody was allocated.
        await start(run, 1, MINER.pid, 3_000, 90)
        # A container the runtime does not list, and a process on the host.
        await start(run, 1, GHOST.pid, 500, 5)
        await start(run, 1, HOST_PID, 250, 0)

        def ready(text: str) -> bool:
            # Every process started above is in the GPU's process list (a poll that began before
            # the last start has only some of them), and the miner has been judged.
            return (
                sum(by_pod(text, PROCESSES, gpu="1").values()) == 3
                and by_pod(text, UNALLOCATED, gpu="1").get("miner") == 1
            )

        text = await run.metrics_until(ready)
        assert by_pod(text, UNALLOCATED, gpu="0") == {"": 0}
        (offender,) = [lbl for lbl, v in samples(text, UNALLOCATED) if v == 1]
        who = (offender["gpu"], offender["namespace"], offender["container"])
        assert who == ("1", "sneaky", "main")
        infos = {lbl["gpu"]: lbl["uuid"] for lbl, _ in samples(text, "gpuagent_gpu_info")}
        assert infos["1"] == uuid1
        # Unknown container and host process: kept, with empty labels, never dropped.
        assert by_pod(text, MEMORY, gpu="1") == {"miner": 3_000 * MIB, "": 750 * MIB}
        assert by_pod(text, PROCESSES, gpu="1") == {"miner": 1, "": 2}
        # Names were asked for when unseen IDs appeared (once, or twice if the unknown one came
        # after a first refresh); at rest, never.
        calls = runtime.calls
        assert 1 <= calls <= 2
        await run.polls(3)
        assert runtime.calls == calls
        # The miner leaves: the GPU is back to no unallocated use.
        await end(run, MINER.pid)
        await run.metrics_until(lambda t: by_pod(t, UNALLOCATED, gpu="1") == {"": 0})


async def test_a_mig_instances_process_is_credited_to_that_instance(
    accounting_agent: AccountingAgent, pod_resources: FakePodResources, tmp_path: Path
) -> None:
    node = tmp_path / "node.yaml"
    node.write_text("version: v1\ngpus:\n  - name: H100\n    mig: [3g.40gb, 2g.20gb, 1g.10gb]\n")
    spec = load_sim_config(node).gpus[0].mig_devices  # the UUIDs the simulated node will have
    gis, migs = [m.gpu_instance_id for m in spec], [m.uuid for m in spec]
    pod_resources.set(
        [
            Held("ml", "trainer", "main", "nvidia.com/mig-2g.20gb", (migs[1],)),
            Held("ds", "notebook", "main", "nvidia.com/mig-1g.10gb", (migs[2],)),
        ]
    )
    async with accounting_agent("--sim-config", str(node)) as run:
        assert [m.uuid for m in run.sim.node.gpus[0].mig_devices] == migs
        await start(run, 0, TRAINER.pid, 7_000, 60, gpu_instance=gis[1])
        await start(run, 0, NOTEBOOK.pid, 3_000, 60, gpu_instance=gis[2])

        def credited(text: str) -> bool:
            return {lbl["pod"] for lbl, v in samples(text, MEMORY) if v > 0} == {
                "trainer",
                "notebook",
            }

        text = await run.metrics_until(credited)
        memory = {(lbl["GPU_I_ID"], lbl["pod"]): v for lbl, v in samples(text, MEMORY)}
        assert memory == {
            (str(gis[1]), "trainer"): 7_000 * MIB,
            (str(gis[2]), "notebook"): 3_000 * MIB,
        }
        # NVML has no per-process utilisation under MIG: no share, no energy (not invented).
        assert samples(text, SM) == []
        assert samples(text, ENERGY) == []
        unallocated = {lbl["GPU_I_ID"]: v for lbl, v in samples(text, UNALLOCATED)}
        assert unallocated == {str(gi): 0 for gi in gis}


async def test_every_cgroup_layout_end_to_end(
    device_plugin_dir: Path,
    pod_resources: FakePodResources,
    short_tmp_path: Path,
    cri_stubs: CriStubs,
    tmp_path: Path,
) -> None:
    workloads = [
        Workload(2000 + n, layout, "layouts", layout.name) for n, layout in enumerate(LAYOUTS)
    ]
    proc = write_proc(
        tmp_path / "all",
        {w.pid: cgroup_file(w.layout, w.pod_uid, w.container_id) for w in workloads},
    )
    with FakeCri(short_tmp_path / "all.sock", cri_stubs) as runtime:
        runtime.set(w.runtime_container() for w in workloads)
        async with running_agent(
            device_plugin_dir, ("--simulate", "4", *args(pod_resources, runtime, proc))
        ) as run:
            for n, w in enumerate(workloads):
                await start(run, n % 4, w.pid, 100 + n, 1)

            def all_named(text: str) -> bool:
                return {lbl["pod"] for lbl, _ in samples(text, PROCESSES)} == {
                    w.pod for w in workloads
                }

            text = await run.metrics_until(all_named)
            assert "" not in {lbl["pod"] for lbl, _ in samples(text, PROCESSES)}
            assert runtime.calls == 1


async def test_switched_off_accounting_says_so_and_reads_no_processes(
    accounting_agent: AccountingAgent, pod_resources: FakePodResources, runtime: FakeCri
) -> None:
    """The base DaemonSet's setting (no host PID namespace): an allocated GPU with a process on
    it yields no per-container series, no per-process NVML calls and no CRI calls, and the
    gauge tells "not enabled" apart from "nothing runs"."""
    pod_resources.set([Held("ml", "trainer", "main", GPU, ("0",))])
    args = ("--simulate", "1", "--container-accounting=false", "--detailed-agent-metrics")
    async with accounting_agent(*args) as run:
        await start(run, 0, TRAINER.pid, 1_000, 10)
        await run.polls(3)
        text = await run.metrics_until(lambda t: "gpuagent_pod_resources_up 1" in t)
        assert [v for _, v in samples(text, "gpuagent_container_accounting_enabled")] == [0]
        for family in (MEMORY, SM, ENERGY, PROCESSES, UNALLOCATED):
            assert samples(text, family) == [], family
        calls = {
            lbl["call"] for lbl, _ in samples(text, "gpuagent_nvml_call_duration_seconds_count")
        }
        assert calls, "the poller's calls are counted"
        assert not {c for c in calls if "Process" in c}, calls
        assert runtime.calls == 0
        assert samples(text, "gpuagent_cri_requests_total") == []
        # The allocation still labels the dcgm-exporter series, as without accounting.
        assert set(by_pod(text, "DCGM_FI_DEV_GPU_TEMP")) == {"trainer"}


async def test_names_from_the_kubelets_log_links_without_a_runtime_socket(
    device_plugin_dir: Path, pod_resources: FakePodResources, proc_root: Path, tmp_path: Path
) -> None:
    """The accounting component's setup: the kubelet's log links mounted, no CRI socket. Every
    container is named from a link; the (absent) runtime is never asked."""
    links = tmp_path / "containers"
    links.mkdir()
    for w in (TRAINER, NOTEBOOK):
        name = f"{w.pod}_{w.namespace}_{w.container}-{w.container_id}.log"
        (links / name).symlink_to(f"/var/log/pods/{w.namespace}_{w.pod}_{w.pod_uid}/0.log")
    pod_resources.set([Held("ml", "trainer", "main", GPU, ("0::0",))])
    extra = (
        "--pod-resources-socket", str(pod_resources.socket_path),
        "--proc-root", str(proc_root),
        "--container-logs-dir", str(links),
        "--cri-socket", str(tmp_path / "no-runtime.sock"),
        "--poll-interval", "0.3",
        "--detailed-agent-metrics",
    )  # fmt: skip
    async with running_agent(device_plugin_dir, ("--simulate", "1", *extra)) as run:
        await start(run, 0, TRAINER.pid, 4_000, 20)
        await start(run, 0, NOTEBOOK.pid, 2_000, 50)
        text = await run.metrics_until(
            lambda t: (
                by_pod(t, MEMORY) == {"trainer": 4_000 * MIB, "notebook": 2_000 * MIB}
                and by_pod(t, UNALLOCATED).get("notebook") == 1
            )
        )
        (trainer,) = [lbl for lbl, _ in samples(text, MEMORY) if lbl["pod"] == "trainer"]
        assert (trainer["namespace"], trainer["container"]) == ("ml", "main")
        assert [v for _, v in samples(text, "gpuagent_container_accounting_enabled")] == [1]
        assert [v for _, v in samples(text, "gpuagent_container_log_links")] == [2]
        assert [v for _, v in samples(text, "gpuagent_container_log_links_errors_total")] == [0]
        assert [v for _, v in samples(text, "gpuagent_cri_requests_total")] == [0]
        assert [v for _, v in samples(text, "gpuagent_cri_errors_total")] == [0]


async def test_accounting_as_pid_1_of_its_own_namespace_warns_once(
    device_plugin_dir: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Accounting on without the host's PID namespace (the agent is its container's PID 1):
    NVML would list no other container's processes, and the log says so at start."""
    monkeypatch.setattr("gpuagent.app.parts.accounting.os.getpid", lambda: 1)
    with capture_logs() as logs:
        async with running_agent(device_plugin_dir, ("--simulate", "1")) as run:
            await run.metrics_until(lambda t: "gpuagent_container_accounting_enabled" in t)
    warnings = [e["event"] for e in logs if e["log_level"] == "warning"]
    assert [w for w in warnings if "PID 1" in w] == [
        "container accounting is on, but the agent is PID 1 of its own PID namespace: NVML "
        "lists no other container's processes (run it in the host's PID namespace, or set "
        "container-accounting: false)"
    ]
    with capture_logs() as logs:
        async with running_agent(
            device_plugin_dir, ("--simulate", "1", "--container-accounting=false")
        ) as run:
            await run.metrics_until(lambda t: "gpuagent_container_accounting_enabled" in t)
    assert not [e for e in logs if "PID 1" in e["event"]]
