"""The HTTP surface: probes, fault injection and /metrics."""

from __future__ import annotations

import asyncio
import gzip
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.fake_kubelet import FakeKubelet
from support.promtool import check_metrics, prometheus_tool

from e2e.agentrun import RunningAgent, registered_agent, running_agent
from gpuagent.gpu.sim.driver import FAULT_KINDS

T = 10.0


def samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                found[tuple(sorted(sample.labels.items()))] = sample.value
    return found


def probe_count(text: str, name: str) -> float:
    """The ``call="probe"`` series of ``name`` (0 when absent)."""
    return samples(text, name).get((("call", "probe"),), 0)


async def wait_for_metric(
    run: RunningAgent, name: str, labels: dict[str, str], value: float
) -> str:
    """/metrics once a series of ``name`` with (at least) ``labels`` has ``value``."""

    def reached(text: str) -> bool:
        return any(
            labels.items() <= dict(key).items() and got == value
            for key, got in samples(text, name).items()
        )

    try:
        return await run.metrics_until(reached)
    except AssertionError as exc:
        raise AssertionError(f"{name}{labels} never became {value}: {exc}") from None


async def test_sim_gpus_lists_the_simulated_node(device_plugin_dir: Path) -> None:
    async with running_agent(device_plugin_dir, ("--simulate", "8")) as run:
        async with run.http.get(run.base_url + "/sim/gpus") as response:
            assert response.status == 200
            gpus = await response.json()
        assert [g["index"] for g in gpus] == list(range(8))
        assert {g["name"] for g in gpus} == {"NVIDIA H100 80GB HBM3"}
        assert [g["numa_node"] for g in gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
        assert len({g["uuid"] for g in gpus}) == 8


@pytest.mark.parametrize(
    ("body", "status"),
    [
        pytest.param({"gpu": 9, "fault": "lost"}, 404, id="unknown-gpu"),
        pytest.param({"gpu": 0, "fault": "melt"}, 400, id="unknown-fault"),
        pytest.param({"gpu": 0, "fault": "xid"}, 400, id="xid-without-code"),
        pytest.param({"gpu": "0", "fault": "lost"}, 400, id="gpu-not-int"),
        pytest.param({"gpu": True, "fault": "lost"}, 400, id="gpu-bool"),
        pytest.param({"fault": "lost"}, 400, id="gpu-missing"),
        pytest.param({"gpu": 0}, 400, id="fault-missing"),
        pytest.param({"gpu": 0, "fault": "xid", "xid": "79"}, 400, id="xid-not-int"),
        pytest.param([1, 2], 400, id="not-an-object"),
    ],
)
async def test_bad_fault_requests_are_refused(
    device_plugin_dir: Path, body: object, status: int
) -> None:
    async with running_agent(device_plugin_dir, ("--simulate", "2")) as run:
        got, payload = await run.fault(body)
        assert got == status
        assert isinstance(payload, dict)
        assert payload["error"]


async def test_an_unknown_fault_lists_every_fault_kind(device_plugin_dir: Path) -> None:
    async with running_agent(device_plugin_dir, ("--simulate", "1")) as run:
        status, payload = await run.fault({"gpu": 0, "fault": "melt"})
    assert status == 400
    assert isinstance(payload, dict)
    listed = str(payload["error"]).partition("known: ")[2]
    assert set(listed.rstrip(")").split(", ")) == set(FAULT_KINDS)
    assert {"xid", "lost", "ecc_dbe", "recover", "hang", "not_supported"} <= set(FAULT_KINDS)


async def test_malformed_json_is_400(device_plugin_dir: Path) -> None:
    async with (
        running_agent(device_plugin_dir, ("--simulate", "1")) as run,
        run.http.post(run.base_url + "/sim/faults", data=b"{nope") as response,
    ):
        assert response.status == 400


async def test_fault_response_is_the_gpus_new_state(device_plugin_dir: Path) -> None:
    async with running_agent(device_plugin_dir, ("--simulate", "2")) as run:
        status, state = await run.fault({"gpu": 1, "fault": "lost"})
        assert status == 200
        assert isinstance(state, dict)
        assert state["index"] == 1
        assert state["state"] == "lost"


async def test_probes(fake_kubelet: FakeKubelet, device_plugin_dir: Path) -> None:
    async with running_agent(device_plugin_dir) as run:
        assert (await run.get("/healthz"))[0] == 200
        await asyncio.to_thread(fake_kubelet.wait_for_registrations, 1, T)
        await run.ready()
        status, body = await run.get("/")
        assert status == 200
        assert 'href="metrics"' in body


async def test_metrics_report_health_and_xids(
    fake_kubelet: FakeKubelet, device_plugin_dir: Path
) -> None:
    async with registered_agent(fake_kubelet, device_plugin_dir) as run:
        uuid = run.uuids[1]
        text = await wait_for_metric(run, "gpuagent_kubelet_registered", {}, 1)
        assert samples(text, "gpuagent_gpu_healthy")[(("gpu", "1"), ("uuid", uuid))] == 1
        # XID 46 needs a GPU reset, but the simulated driver posts no recovery action beside it.
        await run.fault({"gpu": 1, "fault": "xid", "xid": 46})
        text = await wait_for_metric(run, "gpuagent_gpu_healthy", {"gpu": "1"}, 0)
        assert samples(text, "gpuagent_xid_errors_total") == {
            (("action", "RESET_GPU"), ("gpu", "1"), ("uuid", uuid), ("xid", "46")): 1
        }
        condition = samples(text, "gpuagent_gpu_condition")
        assert condition == {
            (("condition", "xid"), ("detail", "46"), ("gpu", "1"), ("uuid", uuid)): 1
        }
        last = samples(text, "DCGM_FI_DEV_XID_ERRORS")
        assert [v for k, v in last.items() if ("gpu", "1") in k] == [46]


async def test_metrics_carry_dcgm_names_and_labels(device_plugin_dir: Path) -> None:
    async with running_agent(device_plugin_dir, ("--simulate", "2")) as run:
        text = await run.metrics_until(lambda t: len(samples(t, "DCGM_FI_DEV_GPU_TEMP")) == 2)
        temps = samples(text, "DCGM_FI_DEV_GPU_TEMP")
        assert len(temps) == 2
        labels = dict(next(iter(temps)))
        assert set(labels) == {
            "gpu", "UUID", "pci_bus_id", "device", "modelName", "Hostname",
            "DCGM_FI_DRIVER_VERSION", "container", "namespace", "pod",
        }  # fmt: skip
        assert (labels["container"], labels["namespace"], labels["pod"]) == ("", "", "")
        assert labels["Hostname"] == "test-node"
        assert labels["modelName"] == "NVIDIA H100 80GB HBM3"
        driver = run.agent.store.snapshot.driver.version
        assert driver
        assert labels["DCGM_FI_DRIVER_VERSION"] == driver


async def test_metrics_gzip(device_plugin_dir: Path) -> None:
    async with running_agent(device_plugin_dir, ("--simulate", "1")) as run:
        headers = {"Accept-Encoding": "gzip"}
        async with run.http.get(
            run.base_url + "/metrics", headers=headers, auto_decompress=False
        ) as response:
            assert response.headers["Content-Encoding"] == "gzip"
            assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            text = gzip.decompress(await response.read()).decode()
        assert "gpuagent_gpus 1" in text


async def test_own_families_pass_promtool(
    fake_kubelet: FakeKubelet, device_plugin_dir: Path
) -> None:
    prometheus_tool("promtool")
    async with registered_agent(fake_kubelet, device_plugin_dir) as run:
        await run.fault({"gpu": 0, "fault": "xid", "xid": 79})
        text = await wait_for_metric(run, "gpuagent_gpu_healthy", {"gpu": "0"}, 0)
    own = "".join(line + "\n" for line in text.splitlines() if "gpuagent_" in line)
    assert "gpuagent_gpu_condition" in own
    result = await asyncio.to_thread(check_metrics, own)
    assert result.returncode == 0, result.stderr + result.stdout
    assert result.stderr.strip() == ""


@pytest.mark.parametrize("detailed", [False, True], ids=["default", "detailed"])
async def test_nvml_call_timings_are_exported(device_plugin_dir: Path, detailed: bool) -> None:
    flags = ("--detailed-agent-metrics",) if detailed else ()
    async with running_agent(device_plugin_dir, ("--simulate", "2", *flags)) as run:
        text = await run.metrics_until(
            lambda t: probe_count(t, "gpuagent_nvml_call_duration_seconds_count") >= 2
        )
        counts = samples(text, "gpuagent_nvml_call_duration_seconds_count")
        assert counts[(("call", "probe"),)] >= 2
        made = samples(text, "gpuagent_nvml_calls_total")
        assert made[(("result", "error"),)] >= 0
        if not detailed:  # the poll's probe alone (and the NVML calls that failed)
            assert set(counts) == {(("call", "probe"),)}
            assert set(made) == {(("result", "error"),)}
        else:  # start-up's pieces and each NVML function too, and the calls that succeeded
            assert made[(("result", "ok"),)] > 0
            assert counts[(("call", "init"),)] == 1
            assert counts[(("call", "discover"),)] == 2  # one per GPU, each on its own worker
            assert counts[(("call", "nvmlDeviceGetTemperature"),)] >= 2
        errors = samples(text, "gpuagent_nvml_call_errors_total")
        assert errors[(("call", "probe"),)] == 0
        await run.fault({"gpu": 1, "fault": "lost"})
        text = await run.metrics_until(
            lambda t: probe_count(t, "gpuagent_nvml_call_errors_total") >= 1
        )
        assert samples(text, "gpuagent_nvml_call_errors_total")[(("call", "probe"),)] >= 1
