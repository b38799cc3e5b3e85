"""``/sim/*``: the simulated driver's controls, served only in simulation.

* ``GET /sim/gpus``: the simulated GPUs and their state (MIG instances' GPU and compute instance
  IDs included).
* ``POST /sim/faults`` ``{"gpu": i, "fault": kind, ...}``: a fault in the driver (the kinds and
  their parameters in DESIGN.md and the README) → 200 with the GPU's new state; 404 for an unknown
  GPU, 400 for a malformed body or an unknown kind (the error lists every kind).
* ``POST /sim/processes`` ``{"gpu": i, "pid": p, "memory_mib": m, "sm_util": percent}``, optional
  ``"gpu_instance"``, ``"compute_instance"`` (MIG), ``"type"`` (``compute``, ``graphics``,
  ``mps``), ``"name"`` (what ``nvmlSystemGetProcessName`` answers) and ``"mps"``
  (``{"pipe_directory": dir}``, optionally the client's own ``"pinned_mem_limit_mib"`` and
  ``"active_thread_percentage"``: a client of the MPS daemon on that pipe directory; typed
  ``mps`` without it, of CUDA's default ``/tmp/nvidia-mps``; with no daemon answering there, a
  plain compute process, as CUDA falls back): starts the process on that GPU (or updates it) →
  200 with the process as JSON; 409 with the CUDA error (``{"error", "cuda_error"}``) when the
  driver refuses it — past an MPS client's pinned memory limit (``cudaErrorMemoryAllocation``),
  past its server's clients on that GPU (``cudaErrorMpsMaxClientsReached``), or a GPU whose
  exclusive compute mode another process holds (``cudaErrorDevicesUnavailable``); 400 for a
  malformed body or value (more memory than the GPU has included), 404 for an unknown GPU.
* ``DELETE /sim/processes/<pid>``: the process exits, on every GPU → 200 with what was removed;
  404 when no such process runs, 400 for a pid that is not a number.
* ``GET /sim/processes``: every simulated process.
"""

from __future__ import annotations

import asyncio
import json
from typing import Protocol

import structlog
from aiohttp import web

__all__ = ["SimulatorControl", "add_simulation_routes"]

log = structlog.get_logger("gpuagent.http")

_REQUIRED = ("gpu", "pid", "memory_mib", "sm_util")
_OPTIONAL = ("gpu_instance", "compute_instance", "type", "name", "mps")
# Parameters of /sim/faults beside gpu, fault and xid (the simulator checks their values).
_FAULT_PARAMETERS = ("seconds", "symbol", "error", "action", "gpu_instance", "compute_instance")


class SimulatorControl(Protocol):
    """The simulated driver's controls: its GPUs' state, fault injection, its process table."""

    def describe(self) -> list[dict[str, object]]: ...

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
    ) -> dict[str, object]: ...

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
    ) -> dict[str, object]: ...

    def remove_process(self, pid: int) -> list[dict[str, object]]: ...

    def processes(self) -> list[dict[str, object]]: ...


def add_simulation_routes(app: web.Application, simulator: SimulatorControl) -> None:
    """Serve ``/sim/gpus``, ``/sim/faults`` and ``/sim/processes`` for ``simulator``."""

    async def gpus(request: web.Request) -> web.Response:
        return web.json_response(simulator.describe())

    async def faults(request: web.Request) -> web.Response:
        body = await _json_object(request, {"gpu", "fault", "xid", *_FAULT_PARAMETERS})
        if isinstance(body, web.Response):
            return body
        gpu, fault, xid = body.get("gpu"), body.get("fault"), body.get("xid")
        if not isinstance(gpu, int) or isinstance(gpu, bool):
            return _error(400, "'gpu' must be an integer GPU index")
        if not isinstance(fault, str):
            return _error(400, "'fault' must be a string naming the fault")
        if xid is not None and (not isinstance(xid, int) or isinstance(xid, bool)):
            return _error(400, "'xid' must be an integer")
        try:
            state = simulator.inject(gpu, fault, xid, **{k: body.get(k) for k in _FAULT_PARAMETERS})
        except LookupError:
            return _error(404, f"no simulated GPU with index {gpu}")
        except ValueError as exc:
            return _error(400, str(exc))
        # The fault as injected: its own fields, none it does not take.
        log.info("fault injected", **{k: v for k, v in body.items() if v is not None})
        return web.json_response(state)

    app.router.add_get("/sim/gpus", gpus)
    app.router.add_post("/sim/faults", faults)
    _add_process_routes(app, simulator)


def _add_process_routes(app: web.Application, simulator: SimulatorControl) -> None:
    """``/sim/processes``: list, start (or update) and end simulated processes."""

    async def listing(request: web.Request) -> web.Response:
        return web.json_response(simulator.processes())

    async def start(request: web.Request) -> web.Response:
        body = await _json_object(request, {*_REQUIRED, *_OPTIONAL})
        if isinstance(body, web.Response):
            return body
        missing = [k for k in _REQUIRED if k not in body]
        if missing:
            return _error(400, f"missing keys: {', '.join(missing)}")
        try:
            # Off the loop: an MPS client's start asks its daemon over a socket.
            process = await asyncio.to_thread(
                simulator.add_process,
                body["gpu"],
                body["pid"],
                body["memory_mib"],
                body["sm_util"],
                gpu_instance=body.get("gpu_instance"),
                compute_instance=body.get("compute_instance"),
                kind=body.get("type", "compute"),
                name=body.get("name", "python3"),
                mps_client=body.get("mps"),
            )
        except LookupError as exc:
            return _error(404, str(exc))
        except ValueError as exc:
            cuda_error = getattr(exc, "cuda_error", None)  # the driver refused it
            if isinstance(cuda_error, str):
                log.info("simulated process refused", pid=body.get("pid"), error=str(exc))
                refused = {"error": str(exc), "cuda_error": cuda_error}
                return web.json_response(refused, status=409)
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


async def _json_object(request: web.Request, keys: set[str]) -> dict[str, object] | web.Response:
    """The request's JSON object body, or the 400 response that says it is not one or that it
    has keys other than ``keys``."""
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return _error(400, "body must be a JSON object")
    if not isinstance(body, dict):
        return _error(400, "body must be a JSON object")
    unknown = set(body) - keys
    if unknown:
        return _error(400, f"unknown keys: {', '.join(sorted(map(str, unknown)))}")
    return body


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)
