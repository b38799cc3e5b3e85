"""``/sim/processes`` and ``/sim/faults`` over HTTP, on the simulated driver."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web
from structlog.testing import capture_logs

from gpuagent.gpu.sim import SimDriver, node_from_mapping
from gpuagent.web.simulation import add_simulation_routes


@pytest.fixture
async def base_url() -> AsyncIterator[str]:
    node = node_from_mapping(
        {"version": "v1", "gpus": [{"name": "H100"}, {"name": "H100", "mig": ["3g.40gb"]}]}
    )
    app = web.Application()
    add_simulation_routes(app, SimDriver(node))
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def test_start_list_and_end(base_url: str) -> None:
    async with aiohttp.ClientSession() as http:
        body = {"gpu": 0, "pid": 4242, "memory_mib": 1024, "sm_util": 35}
        async with http.post(base_url + "/sim/processes", json=body) as r:
            assert r.status == 200
            started = await r.json()
        assert started == body | {
            "gpu_instance": None,
            "compute_instance": None,
            "type": "compute",
            "name": "python3",
        }
        mig = {"gpu": 1, "pid": 7, "memory_mib": 10, "sm_util": 0, "gpu_instance": 2}
        async with http.post(base_url + "/sim/processes", json=mig) as r:
            assert r.status == 200, await r.text()
        async with http.get(base_url + "/sim/processes") as r:
            assert [(p["gpu"], p["pid"]) for p in await r.json()] == [(0, 4242), (1, 7)]
        async with http.delete(base_url + "/sim/processes/4242") as r:
            assert r.status == 200
            assert [p["pid"] for p in await r.json()] == [4242]
        async with http.delete(base_url + "/sim/processes/4242") as r:
            assert r.status == 404
        async with http.get(base_url + "/sim/processes") as r:
            assert [p["pid"] for p in await r.json()] == [7]


PROCESSES, FAULTS = "/sim/processes", "/sim/faults"


@pytest.mark.parametrize(
    ("path", "body", "status", "needle"),
    [
        (PROCESSES, b"not json", 400, "JSON object"),
        (PROCESSES, b"[1, 2]", 400, "JSON object"),
        (PROCESSES, b'{"gpu": 0, "pid": 1, "memory_mib": 1}', 400, "missing keys: sm_util"),
        (PROCESSES, b'{"gpu": 0, "pid": 1, "memory_mib": 1, "sm_util": 1, "x": 1}', 400,
         "unknown keys: x"),
        (PROCESSES, b'{"gpu": 5, "pid": 1, "memory_mib": 1, "sm_util": 1}', 404,
         "no simulated GPU 5"),
        (PROCESSES, b'{"gpu": "0", "pid": 1, "memory_mib": 1, "sm_util": 1}', 400, "'gpu'"),
        (PROCESSES, b'{"gpu": 0, "pid": -1, "memory_mib": 1, "sm_util": 1}', 400, "'pid'"),
        (PROCESSES, b'{"gpu": 0, "pid": 1, "memory_mib": 1e12, "sm_util": 1}', 400,
         "out of memory"),
        (PROCESSES, b'{"gpu": 1, "pid": 1, "memory_mib": 1, "sm_util": 1}', 400, "MIG mode"),
        # /sim/faults shares the body checks (a JSON object, known keys).
        (FAULTS, b'{"gpu": 0, "fault": "lost", "x": 1, "y": 2}', 400, "unknown keys: x, y"),
        (FAULTS, b'{"gpu": 0, "fault": "nope"}', 400, "nope"),
        (FAULTS, b'{"gpu": 9, "fault": "lost"}', 404, "no simulated GPU with index 9"),
        (FAULTS, b'{"gpu": 0, "fault": "lost"}', 200, ""),
    ],
)  # fmt: skip
async def test_requests(base_url: str, path: str, body: bytes, status: int, needle: str) -> None:
    async with (
        aiohttp.ClientSession() as http,
        http.post(base_url + path, data=body) as r,
    ):
        assert r.status == status
        assert needle in (await r.json()).get("error", "")


@pytest.mark.parametrize("pid", ["abc", "-1", "1" * 40, "%F0%9F%98%80"])
async def test_bad_pid_on_delete(base_url: str, pid: str) -> None:
    async with (
        aiohttp.ClientSession() as http,
        http.delete(base_url + "/sim/processes/" + pid) as r,
    ):
        assert r.status == 400


@pytest.mark.parametrize(
    "fault",
    [
        {"gpu": 0, "fault": "lost"},
        {"gpu": 0, "fault": "xid", "xid": 79},
        {"gpu": 1, "fault": "xid", "xid": 31, "gpu_instance": 2, "compute_instance": 0},
        {"gpu": 0, "fault": "hang", "seconds": 0.001},
        {"gpu": 0, "fault": "call_error", "symbol": "nvmlDeviceGetName", "error": "timeout"},
        {"gpu": 0, "fault": "recovery_action", "action": "gpu_reset"},
    ],
    ids=lambda f: str(f["fault"]),
)
async def test_an_injected_fault_is_logged_with_its_own_fields(
    base_url: str, fault: dict[str, object]
) -> None:
    with capture_logs() as logs:
        async with (
            aiohttp.ClientSession() as http,
            http.post(base_url + FAULTS, json=fault) as r,
        ):
            assert r.status == 200, await r.text()
    (line,) = [e for e in logs if e["event"] == "fault injected"]
    assert {k: v for k, v in line.items() if k not in ("event", "log_level")} == fault
