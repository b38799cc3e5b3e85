"""MPS sharing in the domain: the block's rules, the replicas, the daemons' limits, their devices'
health, and what a container receives."""

from __future__ import annotations

from dataclasses import replace

import pytest
from support.nodes import gpu, gpu_uuid, mig, node

from gpuagent.domain.containers import ContainerSettings, DeviceListStrategy, allocate
from gpuagent.domain.errors import ResourceError, SettingError
from gpuagent.domain.mps import (
    MpsDaemon,
    MpsDirs,
    MpsGpu,
    MpsState,
    MpsStatus,
    client_env,
    server_pids,
)
from gpuagent.domain.mpsplan import gate_mps, mps_daemons
from gpuagent.domain.resources import MigStrategy, ResourceSettings, build_resources
from gpuagent.domain.serving import ResourceView, ServingPolicy
from gpuagent.domain.sharing import MpsSharing, Sharing
from gpuagent.domain.snapshot import Snapshot
from gpuagent.domain.timeslicing import ReplicaRule, TimeSlicing

G0, G1 = gpu_uuid(0), gpu_uuid(1)
TWO = node(gpu(0, memory_mib=81559), gpu(1, memory_mib=81559))


def mps(*rules: ReplicaRule, rename: bool = False) -> MpsSharing:
    return MpsSharing(resources=rules, rename_by_default=rename)


def resources_of(snapshot: Snapshot, sharing: MpsSharing, **settings: object) -> dict[str, object]:
    built = build_resources(snapshot, ResourceSettings(mps=sharing, **settings))  # type: ignore[arg-type]
    return {r.name: r for r in built.resources}


# ----- the block ----------------------------------------------------------------------------------
def test_mps_fails_requests_greater_than_one_unless_told() -> None:
    assert MpsSharing().fail_requests_greater_than_one
    assert not TimeSlicing().fail_requests_greater_than_one


@pytest.mark.parametrize(
    ("rules", "key", "reason"),
    [
        pytest.param((ReplicaRule("gpu", 49),), "sharing.mps.resources[0].replicas",
                     "at most 48 clients", id="past-48-clients"),
        pytest.param((ReplicaRule("gpu", 1),), "sharing.mps.resources[0].replicas",
                     "between 2 and", id="one-replica"),
        pytest.param((ReplicaRule("gpu", 4, ("0:1",)),), "sharing.mps.resources[0].devices",
                     "MIG devices cannot be shared through MPS", id="mig-index"),
        pytest.param((ReplicaRule("gpu", 4, ("MIG-abc",)),), "sharing.mps.resources[0].devices",
                     "MIG devices", id="mig-uuid"),
        pytest.param((ReplicaRule("gpu", 4, ("0",)), ReplicaRule("gpu", 2, ("1",))),
                     "sharing.mps.resources[1].replicas", "same replicas", id="two-counts"),
        pytest.param((ReplicaRule("Not A Name", 4),), "sharing.mps.resources[0].name",
                     "DNS subdomain", id="bad-name"),
    ],
)  # fmt: skip
def test_bad_rules_name_the_key(rules: tuple[ReplicaRule, ...], key: str, reason: str) -> None:
    with pytest.raises(SettingError, match=reason) as info:
        MpsSharing(resources=rules)
    assert info.value.key == key


def test_time_slicing_and_mps_together_are_refused() -> None:
    with pytest.raises(SettingError, match="keep one") as info:
        Sharing(TimeSlicing((ReplicaRule("gpu", 2),)), mps(ReplicaRule("gpu", 4)))
    assert info.value.key == "sharing"
    # An empty block beside the other is no conflict.
    assert Sharing(TimeSlicing(), mps(ReplicaRule("gpu", 4))).strategy == "mps"


def test_mig_strategy_mixed_is_refused_naming_both() -> None:
    with pytest.raises(SettingError, match="mig-strategy mixed") as info:
        ResourceSettings(mig_strategy=MigStrategy.MIXED, mps=mps(ReplicaRule("gpu", 4)))
    assert info.value.key == "sharing.mps"


def test_mig_devices_under_single_are_refused() -> None:
    migs = node(gpu(0, migs=[mig(0, 7), mig(0, 8)]))
    with pytest.raises(ResourceError, match=r"sharing.mps: nvidia.com/gpu .* MIG devices 0:0, 0:1"):
        resources_of(migs, mps(ReplicaRule("gpu", 2)), mig_strategy=MigStrategy.SINGLE)


# ----- replicas and daemons -----------------------------------------------------------------------
def test_replicas_are_advertised_as_mps_and_refuse_two_at_once() -> None:
    shared = resources_of(TWO, mps(ReplicaRule("gpu", 4)))["nvidia.com/gpu"]
    assert shared.mps  # type: ignore[attr-defined]
    assert len(shared.devices) == 8  # type: ignore[attr-defined]
    assert shared.fail_requests_greater_than_one  # type: ignore[attr-defined]
    renamed = resources_of(TWO, mps(ReplicaRule("gpu", 4), rename=True))
    assert set(renamed) == {"nvidia.com/gpu.shared"}


def test_the_daemon_of_a_resource_gets_nvidias_limits() -> None:
    built = build_resources(TWO, ResourceSettings(mps=mps(ReplicaRule("gpu", 3))))
    (daemon,) = mps_daemons(built)
    assert daemon == MpsDaemon(
        "nvidia.com/gpu",
        (MpsGpu(0, G0, 81559, 3), MpsGpu(1, G1, 81559, 3)),
        thread_percentage=33,
    )
    # NVIDIA's: memory / replicas in whole MiB per GPU index, then 100 / replicas.
    assert daemon.commands() == (
        "set_default_device_pinned_mem_limit 0 27186M",
        "set_default_device_pinned_mem_limit 1 27186M",
        "set_default_active_thread_percentage 33",
    )


def test_only_the_listed_gpus_are_under_the_daemon() -> None:
    built = build_resources(
        TWO, ResourceSettings(mps=mps(ReplicaRule("gpu", 2, ("1",), rename="gpu.mps")))
    )
    names = {r.name: r for r in built.resources}
    assert not names["nvidia.com/gpu"].mps  # GPU 0 whole, not shared
    (daemon,) = mps_daemons(built)
    assert (daemon.name, daemon.uuids) == ("nvidia.com/gpu.mps", (G1,))


def test_no_daemon_without_mps_or_for_time_slicing() -> None:
    assert mps_daemons(build_resources(TWO)) == ()
    sliced = ResourceSettings(time_slicing=TimeSlicing((ReplicaRule("gpu", 2),)))
    assert mps_daemons(build_resources(TWO, sliced)) == ()


def test_a_gpu_of_unknown_memory_gets_no_memory_limit() -> None:
    daemon = MpsDaemon("r", (MpsGpu(0, G0, 0, 2), MpsGpu(1, G1, 1000, 2)), thread_percentage=50)
    assert daemon.commands() == (
        "set_default_device_pinned_mem_limit 1 500M",
        "set_default_active_thread_percentage 50",
    )
    assert MpsDaemon("claim", (MpsGpu(0, G0),)).commands() == ()


def test_a_running_server_gets_the_same_limits_by_its_pid() -> None:
    daemon = MpsDaemon("r", (MpsGpu(0, G0, 0, 2), MpsGpu(1, G1, 1000, 2)), thread_percentage=50)
    assert daemon.commands(server=4242) == (
        "set_device_pinned_mem_limit 4242 1 500M",
        "set_active_thread_percentage 4242 50",
    )
    assert MpsDaemon("claim", (MpsGpu(0, G0),)).commands(server=7) == ()


@pytest.mark.parametrize(
    ("answer", "pids"), [("", ()), ("4242", (4242,)), ("4242\n4243\n", (4242, 4243))]
)
def test_the_server_list_names_pids(answer: str, pids: tuple[int, ...]) -> None:
    assert server_pids(answer) == pids


# ----- health while a daemon is down --------------------------------------------------------------
def test_replicas_are_unhealthy_until_their_daemon_is_up() -> None:
    settings = ServingPolicy(resources=ResourceSettings(mps=mps(ReplicaRule("gpu", 2))))
    view = ResourceView()
    down = view.resources(TWO, settings).get("nvidia.com/gpu")
    assert down is not None
    assert {d.health for d in down.devices} == {"Unhealthy"}
    assert down.devices[0].reason == "MPS control daemon for nvidia.com/gpu: not started"
    (daemon,) = view.mps_daemons(TWO, settings)
    running = MpsStatus(up=True, starts=1, daemon=daemon)
    up = replace(TWO, mps=MpsState().with_status("nvidia.com/gpu", running))
    healthy = view.resources(up, settings).get("nvidia.com/gpu")
    assert healthy is not None
    assert {d.health for d in healthy.devices} == {"Healthy"}
    # Up, but configured for another plan (a reload changed the replicas): not yet.
    earlier = replace(running, daemon=replace(daemon, thread_percentage=25))
    stale = replace(TWO, mps=MpsState().with_status("nvidia.com/gpu", earlier))
    waiting = view.resources(stale, settings).get("nvidia.com/gpu")
    assert waiting is not None
    assert waiting.devices[0].reason.endswith("with the limits of an earlier configuration")
    # The daemons come from every device, whatever their health.
    assert view.mps_daemons(TWO, settings) == view.mps_daemons(up, settings)


def test_a_sick_gpu_keeps_its_own_reason_first() -> None:
    sick = node(gpu(0, healthy=False))
    built = build_resources(sick, ResourceSettings(mps=mps(ReplicaRule("gpu", 2))))
    state = MpsState().with_status("nvidia.com/gpu", MpsStatus(error="exited with status 1"))
    device = gate_mps(built, state).resources[0].devices[0]
    assert device.reason == "xid 79; MPS control daemon for nvidia.com/gpu: exited with status 1"


def test_state_equality_and_removal() -> None:
    state = MpsState().with_status("b", MpsStatus()).with_status("a", MpsStatus(up=True))
    assert list(state.daemons) == ["a", "b"]
    assert state == MpsState().with_status("a", MpsStatus(up=True)).with_status("b", MpsStatus())
    assert state.with_status("a", None).with_status("b", None) == MpsState()
    assert hash(state) == hash(
        MpsState().with_status("a", MpsStatus(up=True)).with_status("b", MpsStatus())
    )


# ----- what a container receives ------------------------------------------------------------------
@pytest.mark.parametrize("strategy", list(DeviceListStrategy))
def test_every_strategy_gets_the_pipe_directory_and_shm(strategy: DeviceListStrategy) -> None:
    built = build_resources(TWO, ResourceSettings(mps=mps(ReplicaRule("gpu", 2))))
    shared = built.get("nvidia.com/gpu")
    assert shared is not None
    healthy = replace(shared, devices=tuple(replace(d, healthy=True) for d in shared.devices))
    settings = ContainerSettings(strategies=(strategy,), mps=MpsDirs("/var/run/mps"))
    allocation = allocate(healthy, [f"{G1}::1"], settings)
    assert allocation.envs["CUDA_MPS_PIPE_DIRECTORY"] == "/mps/nvidia.com/gpu/pipe"
    mounts = [(m.container_path, m.host_path, m.read_only) for m in allocation.mounts]
    assert mounts[-2:] == [
        ("/mps/nvidia.com/gpu/pipe", "/var/run/mps/nvidia.com/gpu/pipe", False),
        ("/dev/shm", "/var/run/mps/shm", False),
    ]


def test_a_resource_not_shared_through_mps_gets_nothing_of_it() -> None:
    built = build_resources(
        TWO, ResourceSettings(time_slicing=TimeSlicing((ReplicaRule("gpu", 2),)))
    )
    shared = built.get("nvidia.com/gpu")
    assert shared is not None
    allocation = allocate(shared, [f"{G0}::0"], ContainerSettings())
    assert "CUDA_MPS_PIPE_DIRECTORY" not in allocation.envs
    assert allocation.mounts == ()


def test_a_clients_own_limits_for_a_later_daemon() -> None:
    env = client_env(MpsDirs(), "gpu-0", pinned_limits_mib={1: 512, 0: 2048}, thread_percentage=25)
    assert env == {
        "CUDA_MPS_PIPE_DIRECTORY": "/mps/gpu-0/pipe",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=2048M,1=512M",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25",
    }
