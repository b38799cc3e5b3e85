"""Health from evidence, over /sim/faults and the kubelet's ListAndWatch stream (issue 12).

Each case drives the strict simulator through the agent's HTTP fault injection and reads the
verdict the kubelet gets. Every one of them failed on the agent before this change: a failing
metric turned a GPU Unhealthy, the recovery-action event's data was taken as the action, an XID
on one MIG instance took down every instance, a MIG GPU without CAP_SYS_ADMIN was Unhealthy for
ever, and a lost GPU on a driver without the recovery-action field never came back.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from support.fake_kubelet import FakeKubelet
from support.waiting import eventually

from e2e.agentrun import RunningAgent, first_stream, running_agent
from e2e.test_http import samples

T = 10.0
MIG_NODE = {
    "version": "v1",
    "gpus": [{"name": "H100", "mig": ["3g.40gb", "2g.20gb", "1g.10gb"]}, {"name": "H100"}],
}


def health(update: Any) -> dict[str, str]:
    return {d.ID: d.health for d in update.devices}


def shows(device: str, state: str) -> Callable[[Any], bool]:
    return lambda update: health(update).get(device) == state


async def fault(run: RunningAgent, body: dict[str, object]) -> dict[str, Any]:
    status, state = await run.fault(body)
    assert status == 200, state
    assert isinstance(state, dict)
    return state


def errors_in(text: str, call: str) -> float:
    """The errors /metrics ``text`` counts for NVML call ``call``."""
    return samples(text, "gpuagent_nvml_call_errors_total").get((("call", call),), 0.0)


def failed_calls(text: str) -> float:
    """Failed NVML function calls, all together (what an operator sees by default)."""
    return samples(text, "gpuagent_nvml_calls_total").get((("result", "error"),), 0.0)


async def errors_of(run: RunningAgent, call: str) -> float:
    _, text = await run.get("/metrics")
    return errors_in(text, call)


async def test_failing_telemetry_calls_leave_the_gpu_healthy(
    fake_kubelet: FakeKubelet, device_plugin_dir: Path
) -> None:
    """``call_error`` on one GPU's telemetry calls: its metrics go absent, the error counters
    (per call: --detailed-agent-metrics; and of all calls) rise poll after poll, and the kubelet
    never hears it Unhealthy; recover brings them back."""
    async with running_agent(
        device_plugin_dir, ("--simulate", "2", "--detailed-agent-metrics")
    ) as run:
        reg = await first_stream(fake_kubelet)
        uuid = run.uuids[1]
        for symbol in ("nvmlDeviceGetTemperature", "nvmlDeviceGetPowerUsage"):
            await fault(
                run, {"gpu": 1, "fault": "call_error", "symbol": symbol, "error": "unknown"}
            )
        state = await fault(
            run,
            {"gpu": 1, "fault": "call_error", "symbol": "nvmlDeviceGetFieldValues",
             "error": "no_permission"},
        )  # fmt: skip
        assert state["call_errors"] == [
            "nvmlDeviceGetFieldValues",
            "nvmlDeviceGetPowerUsage",
            "nvmlDeviceGetTemperature",
        ]
        before = await errors_of(run, "nvmlDeviceGetTemperature")
        # Forty polls (50 ms apart): the counter rises with each, the verdict never changes.
        text = await run.metrics_until(
            lambda t: (
                errors_in(t, "nvmlDeviceGetTemperature") >= before + 40
                and errors_in(t, "nvmlDeviceGetFieldValues") >= 40
            ),
            within=3 * T,
        )
        # Every failed call is counted in the aggregate too: the per-function counts add up to it.
        per_function = samples(text, "gpuagent_nvml_call_errors_total")
        work = {"init", "discover", "probe"}
        assert failed_calls(text) == sum(
            n for labels, n in per_function.items() if dict(labels)["call"] not in work
        )
        assert failed_calls(text) >= before + 80
        for family in (
            "DCGM_FI_DEV_GPU_TEMP",
            "DCGM_FI_DEV_POWER_USAGE",
            "DCGM_FI_DEV_MEMORY_TEMP",
        ):
            assert {dict(k)["gpu"] for k in samples(text, family)} == {"0"}, family
        assert {dict(k)["gpu"] for k in samples(text, "DCGM_FI_DEV_SM_CLOCK")} == {"0", "1"}
        assert samples(text, "gpuagent_gpu_healthy")[(("gpu", "1"), ("uuid", uuid))] == 1
        assert all(health(update)[uuid] == "Healthy" for _, update in reg.history)
        await fault(run, {"gpu": 1, "fault": "recover"})
        await run.metrics_until(
            lambda t: {dict(k)["gpu"] for k in samples(t, "DCGM_FI_DEV_GPU_TEMP")} == {"0", "1"}
        )


async def test_recovery_action_keeps_then_clears(
    fake_kubelet: FakeKubelet, device_plugin_dir: Path
) -> None:
    """XID 48, then the driver asks for a GPU reset: Unhealthy for both; "none" after the reset
    (the field read on the event — whose data is 0 — not the event's data) brings it back."""
    async with running_agent(device_plugin_dir, ("--simulate", "2")) as run:
        reg = await first_stream(fake_kubelet)
        uuid = run.uuids[0]
        await fault(run, {"gpu": 0, "fault": "xid", "xid": 48})
        await fault(run, {"gpu": 0, "fault": "recovery_action", "action": "gpu_reset"})
        await asyncio.to_thread(reg.wait_until, shows(uuid, "Unhealthy"), T)
        # The XID alone already makes it Unhealthy: the recovery action's event may come later.
        await eventually(lambda: reason(run, 0) == "xid 48, recovery_action gpu_reset", what="both")
        # The same verdict a few polls later: nothing the probes read clears it.
        await run.polls(10)
        gpu = run.agent.store.snapshot.gpu(0)
        assert gpu is not None
        assert gpu.health.reason == "xid 48, recovery_action gpu_reset"
        await fault(run, {"gpu": 0, "fault": "recovery_action", "action": "none"})
        await asyncio.to_thread(reg.wait_until, shows(uuid, "Healthy"), T)


async def test_xid_on_one_mig_instance_marks_that_instance_only(
    fake_kubelet: FakeKubelet, device_plugin_dir: Path, tmp_path: Path
) -> None:
    """An XID the driver attributes to one MIG instance marks that MIG device alone; one without
    instance IDs marks every device of the GPU."""
    config = tmp_path / "node.yaml"
    config.write_text(yaml.safe_dump(MIG_NODE))
    args = ("--sim-config", str(config), "--mig-strategy", "mixed", "--detailed-agent-metrics")
    async with running_agent(device_plugin_dir, args) as run:
        await asyncio.to_thread(fake_kubelet.wait_for_registrations, 4, T)
        migs = {m["profile"]: m for m in run.sim.describe()[0]["mig_devices"]}  # type: ignore[attr-defined]
        streams = {profile: fake_kubelet.latest(f"nvidia.com/mig-{profile}") for profile in migs}
        for reg in streams.values():
            await asyncio.to_thread(reg.next_update, T)
        target = migs["2g.20gb"]
        await fault(
            run,
            # 46 needs a reset by the catalog, and the simulated driver sets no recovery action
            # for it (which, being per GPU, would mark every instance).
            {"gpu": 0, "fault": "xid", "xid": 46, "gpu_instance": target["gpu_instance"],
             "compute_instance": target["compute_instance"]},
        )  # fmt: skip
        await asyncio.to_thread(
            streams["2g.20gb"].wait_until, shows(target["uuid"], "Unhealthy"), T
        )
        for profile in ("3g.40gb", "1g.10gb"):
            assert health(streams[profile].last_update)[migs[profile]["uuid"]] == "Healthy"
        full = fake_kubelet.latest("nvidia.com/gpu")
        assert set(health(full.last_update).values()) == {"Healthy"}  # GPU 1, untouched
        # Without instance IDs: the whole GPU.
        await fault(run, {"gpu": 0, "fault": "xid", "xid": 46})
        for profile in ("3g.40gb", "1g.10gb"):
            reg = streams[profile]
            await asyncio.to_thread(reg.wait_until, shows(migs[profile]["uuid"], "Unhealthy"), T)
        assert health(streams["2g.20gb"].last_update)[target["uuid"]] == "Unhealthy"


async def test_mig_node_without_cap_sys_admin_stays_healthy(
    fake_kubelet: FakeKubelet, device_plugin_dir: Path, tmp_path: Path
) -> None:
    """With the base manifest's privileges the driver refuses the MIG GPU's aggregate memory:
    that reading is absent and counted; every device stays Healthy, as it should."""
    config = tmp_path / "node.yaml"
    config.write_text(yaml.safe_dump(MIG_NODE))
    args = ("--sim-config", str(config), "--mig-strategy", "mixed", "--detailed-agent-metrics")
    async with running_agent(device_plugin_dir, args) as run:
        await asyncio.to_thread(fake_kubelet.wait_for_registrations, 4, T)
        await run.metrics_until(
            lambda t: errors_in(t, "nvmlDeviceGetMemoryInfo_v2") >= 20, within=3 * T
        )
        for reg in fake_kubelet.registrations:
            assert all(set(health(update).values()) == {"Healthy"} for _, update in reg.history), (
                reg
            )
        gpu = run.agent.store.snapshot.gpu(0)
        assert gpu is not None
        assert gpu.memory_mib > 0
        assert sorted(m.profile for m in gpu.mig_devices) == ["1g.10gb", "2g.20gb", "3g.40gb"]


async def test_recovery_on_a_driver_without_the_field(
    fake_kubelet: FakeKubelet, device_plugin_dir: Path, tmp_path: Path
) -> None:
    """R560 has no recovery-action field or event: a lost GPU that answers again, and a GPU
    whose volatile ECC count went back to zero, count as reset — recovered, as on R565+."""
    config = tmp_path / "node.yaml"
    config.write_text(yaml.safe_dump({"version": "v1", "gpus": [{}, {}],
                                      "driver_version": "560.35.03"}))  # fmt: skip
    async with running_agent(device_plugin_dir, ("--sim-config", str(config))) as run:
        reg = await first_stream(fake_kubelet)
        uuids = run.uuids
        await fault(run, {"gpu": 0, "fault": "lost"})
        await fault(run, {"gpu": 1, "fault": "ecc_dbe"})
        await asyncio.to_thread(
            reg.wait_until, lambda u: set(health(u).values()) == {"Unhealthy"}, T
        )

        # The probes find it lost (no recovery-action event to say so).
        await eventually(lambda: reason(run, 0) == "xid 79, lost", what="GPU 0 found lost")
        await fault(run, {"gpu": 0, "fault": "recover"})
        await asyncio.to_thread(reg.wait_until, shows(uuids[0], "Healthy"), T)
        await fault(run, {"gpu": 1, "fault": "recover"})
        await asyncio.to_thread(reg.wait_until, shows(uuids[1], "Healthy"), T)


async def test_bad_new_fault_parameters_are_400(device_plugin_dir: Path) -> None:
    async with running_agent(device_plugin_dir, ("--simulate", "1")) as run:
        for body in (
            {"gpu": 0, "fault": "call_error", "symbol": "nvmlDeviceGetName"},
            {"gpu": 0, "fault": "call_error", "symbol": "nvmlDeviceGetName", "error": "boom"},
            {"gpu": 0, "fault": "call_error", "error": "unknown"},
            {"gpu": 0, "fault": "recovery_action"},
            {"gpu": 0, "fault": "recovery_action", "action": "reboot_everything"},
            {"gpu": 0, "fault": "xid", "xid": 48, "gpu_instance": 1},  # no MIG on this GPU
            {"gpu": 0, "fault": "xid", "xid": 48, "compute_instance": 0},
            {"gpu": 0, "fault": "lost", "action": "none"},
            {"gpu": 0, "fault": "hang", "seconds": 1, "error": "unknown"},
        ):
            status, payload = await run.fault(body)
            assert status == 400, body
            assert isinstance(payload, dict)
            assert payload["error"]


def reason(run: RunningAgent, index: int) -> str:
    """GPU ``index``'s health reason in the agent's store (empty while it has none)."""
    gpu = run.agent.store.snapshot.gpu(index)
    return "" if gpu is None else gpu.health.reason
