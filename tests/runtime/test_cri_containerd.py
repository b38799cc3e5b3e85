"""Per-container accounting against a real container runtime (Debian's ``containerd`` and ``runc``).

A private containerd (:mod:`support.containerd`: its own root, state and socket, a local sandbox
image made from busybox-static, no CNI) runs pods offline the way the kubelet asks for them
through the CRI: a sandbox in the node's network namespace, a container carrying the kubelet's
labels, started, with the cgroupfs layout the kubelet gives it. The container's real process is
put on a simulated GPU (``POST /sim/processes`` with its host PID) and the agent, reading the
real ``/proc``, must name it (pod, namespace, container) on the ``gpuagent_container_*`` series
from its real cgroup: once through the runtime's CRI, once through the kubelet's log links with
no runtime socket at all (the accounting component's setup).

Skipped where containerd, runc or busybox-static is missing, or containerd cannot start here (not
root); failed instead when ``CI`` is set (``.ci/run`` installs them). Every container, pod,
process, mount, cgroup and state directory is removed at the end, a failure included, and the
fixture checks that nothing is left.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e.agentrun import RunningAgent, running_agent
from prometheus_client.parser import text_string_to_metric_families
from support.containerd import ContainerdUnavailable, CriRuntime, PrivateContainerd
from support.grpcstubs import CriStubs
from support.required import unavailable

from gpuagent.domain.cgroups import container_of
from gpuagent.runtime.cri import CriClient

MIB = 1024 * 1024
MEMORY = "gpuagent_container_gpu_memory_used_bytes"
PROCESSES = "gpuagent_container_gpu_processes"


@pytest.fixture
def containerd(short_tmp_path: Path) -> Iterator[PrivateContainerd]:
    runtime = PrivateContainerd(short_tmp_path / "ctd")
    runtime.root.mkdir()
    try:
        runtime.start()
    except ContainerdUnavailable as why:
        unavailable(str(why))
    try:
        yield runtime
    finally:
        runtime.close()
        assert runtime.leftovers() == [], "containerd left things behind"


@pytest.fixture
def pods(containerd: PrivateContainerd, cri_stubs: CriStubs) -> Iterator[CriRuntime]:
    with CriRuntime(containerd, cri_stubs) as runtime:
        yield runtime


@pytest.mark.asyncio(loop_factories=["asyncio"])
async def test_containerd_answers_version_and_list_containers(
    containerd: PrivateContainerd,
) -> None:
    cri = CriClient(containerd.socket, retry_interval=0.0, min_interval=0.0)
    try:
        name, version = await cri.version()
        assert name == "containerd"
        assert version
        names = await cri.resolve({"0" * 64})
        assert cri.requests == 1
        assert cri.errors == 0, "ListContainers failed against containerd"
        assert names == {}
    finally:
        cri.close()


def series(text: str, name: str) -> dict[tuple[str, str, str], float]:
    """(namespace, pod, container) → value of the family's series on GPU 0."""
    return {
        (s.labels["namespace"], s.labels["pod"], s.labels["container"]): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and s.labels["gpu"] == "0"
    }


def cgroup_owner(pid: int) -> tuple[str, str] | None:
    """The container ID and pod UID that ``/proc/<pid>/cgroup`` names."""
    owner = container_of(Path(f"/proc/{pid}/cgroup").read_text(encoding="utf-8"))
    return None if owner is None else (owner.container_id, owner.pod_uid)


async def on_gpu_0(run: RunningAgent, memory_mib: dict[int, int]) -> None:
    """Put the host processes ``memory_mib`` names on simulated GPU 0."""
    for pid, mib in memory_mib.items():
        body = {"gpu": 0, "pid": pid, "memory_mib": mib, "sm_util": 10}
        async with run.http.post(run.base_url + "/sim/processes", json=body) as response:
            assert response.status == 200, await response.text()


@pytest.mark.asyncio(loop_factories=["asyncio"])
async def test_the_agent_names_a_real_containers_gpu_process_from_its_cgroup(
    containerd: PrivateContainerd, pods: CriRuntime, device_plugin_dir: Path, tmp_path: Path
) -> None:
    trainer = pods.run_pod("ml", "trainer-0", "main")
    notebook = pods.run_pod("ds", "notebook-0", "lab", qos="burstable")
    # The real processes, in the cgroups runc made for them under their pods'.
    for running in (trainer, notebook):
        assert cgroup_owner(running.pid) == (running.id, running.pod_uid)
    no_links = tmp_path / "no-links"
    no_links.mkdir()
    args: tuple[str, ...] = (
        "--simulate", "1",
        "--proc-root", "/proc",
        "--cri-socket", str(containerd.socket),
        "--container-logs-dir", str(no_links),
        "--pod-resources-socket", str(tmp_path / "no-kubelet.sock"),
        "--detailed-agent-metrics",
    )  # fmt: skip
    expected = {
        ("ml", "trainer-0", "main"): 3_000 * MIB,
        ("ds", "notebook-0", "lab"): 1_000 * MIB,
    }
    async with running_agent(device_plugin_dir, args) as run:
        await on_gpu_0(run, {trainer.pid: 3_000, notebook.pid: 1_000})
        text = await run.metrics_until(lambda t: series(t, MEMORY) == expected, within=20)
        assert series(text, PROCESSES) == dict.fromkeys(expected, 1)
        (requests,) = [
            s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if s.name == "gpuagent_cri_requests_total"
        ]
        assert requests >= 1

    # The accounting component's setup: no runtime socket, the kubelet's log links (as the
    # kubelet names them) for the same real containers.
    links = tmp_path / "containers"
    links.mkdir()
    for (namespace, pod, name), running in zip(expected, (trainer, notebook), strict=True):
        link = links / f"{pod}_{namespace}_{name}-{running.id}.log"
        link.symlink_to(f"/var/log/pods/{namespace}_{pod}_{running.pod_uid}/{name}/0.log")
    args = (
        "--simulate", "1",
        "--proc-root", "/proc",
        "--cri-socket", str(tmp_path / "no-runtime.sock"),
        "--container-logs-dir", str(links),
        "--pod-resources-socket", str(tmp_path / "no-kubelet.sock"),
    )  # fmt: skip
    async with running_agent(device_plugin_dir, args) as run:
        await on_gpu_0(run, {trainer.pid: 3_000, notebook.pid: 1_000})
        await run.metrics_until(lambda t: series(t, MEMORY) == expected, within=20)
