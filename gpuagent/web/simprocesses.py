"""``/sim/processes``: processes on simulated GPUs (only in simulation).

* ``POST /sim/processes`` ``{"gpu": i, "pid": p, "memory_mib": m, "sm_util": percent}``, optional
  ``"gpu_instance"``, ``"compute_instance"`` (MIG) and ``"type"`` (``compute``, ``graphics``,
  ``mps``): starts the process on that GPU (or updates it) → 200 with the process as JSON;
  400 for a malformed body or value (too much memory included), 404 for an unknown GPU.
* ``DELETE /sim/processes/<pid>``: the process exits, on every GPU → 200 with what was removed;
  404 when no such process runs, 400 for a pid that is not a number.
* ``GET /sim/processes``: every simulated process.
"""

from __future__ import annotations

import json
from typing import Protocol

import structlog
from aiohttp import web

__all__ = ["SimulatedProcesses", "add_process_routes"]

log = structlog.get_logger("gpuagent.http")

_REQUIRED = ("gpu", "pid", "memory_mib", "sm_util")
_OPTIONAL = ("gpu_instance", "compute_instance", "type")


class SimulatedProcesses(Protocol):
    """The simulated driver's process table."""

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
    ) -> dict[str, object]: ...

    def remove_process(self, pid: int) -> list[dict[str, object]]: ...

    def processes(self) -> list[dict[str, object]]: ...


def add_process_routes(app: web.Application, simulator: SimulatedProcesses) -> None:
    async def listing(request: web.Request) -> web.Response:
        return web.json_response(simulator.processes())

    async def start(request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(400, "body must be a JSON object")
        if not isinstance(body, dict):
            return _error(400, "body must be a JSON object")
        missing = [k for k in _REQUIRED if k not in body]
        if missing:
            return _error(400, f"missing keys: {', '.join(missing)}")
        unknown = set(body) - {*_REQUIRED, *_OPTIONAL}
        if unknown:
            return _error(400, f"unknown keys: {', '.join(sorted(map(str, unknown)))}")
        try:
            process = simulator.add_process(
                body["gpu"],
                body["pid"],
                body["memory_mib"],
                body["sm_util"],
                gpu_instance=body.get("gpu_instance"),
                compute_instance=body.get("compute_instance"),
                kind=body.get("type", "compute"),
            )
        except LookupError as exc:
            return _error(404, str(exc))
        except ValueError as exc:
            return _error(400, str(exc))
        log.info("simulated process started", **{k: process[k] for k in ("gpu", "pid")})
        return web.json_response(process)

    async def stop(request: web.Request) -> web.Response:
        text = request.match_info["pid"]
        if not (text.isascii() and text.isdecimal()) or len(text) > 10:
            return _error(400, f"pid must be a whole number, got {text[:32]!r}")
        try:
            removed = simulator.remove_process(int(text))
        except LookupError as exc:
            return _error(404, str(exc))
        log.info("simulated process ended", pid=int(text))
        return web.json_response(removed)

    app.router.add_get("/sim/processes", listing)
    app.router.add_post("/sim/processes", start)
    app.router.add_delete("/sim/processes/{pid}", stop)


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)
