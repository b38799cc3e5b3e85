"""An API-server stand-in (aiohttp): for the DRA side, Nodes and ResourceClaims to read and
ResourceSlices to write; for the node-health writer, the Node's status (strategic-merge patches
of ``nodes/status``) and spec (merge patches, with a ``resourceVersion`` precondition), and
Events (``events.k8s.io/v1``, or core ``v1`` when the server is told not to serve that group,
``events_api=False``). Every write is checked as the API server would check it.

Each object the agent writes (the Node after each patch, as stored) is validated as
:mod:`support.apivalidation` says: against the Kubernetes schemas and the API server's own rules
that no schema expresses (``validate_slice``, ``validate_event``, and on an event's update, what
``events.k8s.io/v1`` keeps immutable). A write that fails is refused with 422 and recorded in
:attr:`FakeApiServer.invalid`, so a test can assert there were none. The objects' shapes and the
patches' semantics are in :mod:`support.apiobjects`.

Every request is recorded in :attr:`FakeApiServer.requests` (verb, path), so a test counts
them; :attr:`FakeApiServer.refuse` answers chosen requests 403, ``node_present=False`` makes the
Node 404, :attr:`FakeApiServer.throttle` answers the next N writes 429 with ``Retry-After``, and
:meth:`FakeApiServer.hold` keeps every answer back until released.

``stop()`` closes the listener and every connection (the agent then sees "connection refused"),
``start()`` serves again on the same port.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import json
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from aiohttp import web

from .apiobjects import KUBELET_CONDITIONS, claim, field_value, merged, regarding
from .apivalidation import (
    EVENT_IMMUTABLE,
    K8S_VERSIONS,
    schema_errors,
    validate_event,
    validate_slice,
)
from .requestpolicy import quantity_value

__all__ = [
    "K8S_VERSIONS",
    "KUBELET_CONDITIONS",
    "RESOURCE",
    "FakeApiServer",
    "claim",
    "validate_event",
    "validate_slice",
]

RESOURCE = "/apis/resource.k8s.io/v1"
EVENTS = "/apis/events.k8s.io/v1"


@dataclass
class FakeApiServer:
    node: str
    node_uid: str = "0c7d2a4e-6f0b-4c1a-9d3e-5b8f2a1c7e90"
    claims: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    slices: dict[str, dict[str, Any]] = field(default_factory=dict)
    writes: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    invalid: list[tuple[str, list[str]]] = field(default_factory=list)
    requests: list[tuple[str, str]] = field(default_factory=list)
    # The node-health side: the Node as stored (None: not made yet), events by (namespace, name).
    node_object: dict[str, Any] | None = None
    node_present: bool = True
    events: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    events_api: bool = True
    # Requests answered 403, as "VERB path-suffix" (e.g. "PATCH nodes/status", "POST events").
    refuse: set[str] = field(default_factory=set)
    # The next N writes (PATCH, POST, PUT, DELETE) are answered 429 with Retry-After: retry_after.
    throttle: int = 0
    retry_after: int = 5
    port: int = 0
    _runner: web.AppRunner | None = None
    _versions: Any = field(default_factory=lambda: itertools.count(100))
    _released: asyncio.Event | None = None

    def add_claim(self, obj: dict[str, Any]) -> None:
        errors = schema_errors(obj)  # the test's own data is valid too
        assert not errors, errors
        meta = obj["metadata"]
        self.claims[(meta["namespace"], meta["name"])] = obj

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def kubeconfig(self, path: Path) -> Path:
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "test", "cluster": {"server": self.url}}],
            "users": [{"name": "agent", "user": {"token": "node-token"}}],
            "contexts": [{"name": "test", "context": {"cluster": "test", "user": "agent"}}],
            "current-context": "test",
        }
        path.write_text(yaml.safe_dump(config), encoding="utf-8")
        return path

    # ----- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        app = web.Application(middlewares=[self._gate])
        app.router.add_get("/api/v1/nodes/{name}", self._get_node)
        app.router.add_patch("/api/v1/nodes/{name}/status", self._patch_node_status)
        app.router.add_patch("/api/v1/nodes/{name}", self._patch_node)
        app.router.add_get(EVENTS, self._discover_events)
        for prefix, core in ((EVENTS, False), ("/api/v1", True)):
            app.router.add_post(prefix + "/namespaces/{ns}/events", self._event_creator(core))
            app.router.add_patch(
                prefix + "/namespaces/{ns}/events/{name}", self._event_patcher(core)
            )
        app.router.add_get(RESOURCE + "/namespaces/{ns}/resourceclaims/{name}", self._get_claim)
        app.router.add_get(RESOURCE + "/resourceslices", self._list_slices)
        app.router.add_post(RESOURCE + "/resourceslices", self._create_slice)
        app.router.add_put(RESOURCE + "/resourceslices/{name}", self._replace_slice)
        app.router.add_delete(RESOURCE + "/resourceslices/{name}", self._delete_slice)
        runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=0.1)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", self.port, reuse_address=True)
        await site.start()
        if not self.port:
            self.port = runner.addresses[0][1]
        self._runner = runner

    async def stop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    # ----- handlers ----------------------------------------------------------------------------
    @staticmethod
    def _status(code: int, reason: str, message: str) -> web.Response:
        body = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                "message": message, "reason": reason, "code": code}  # fmt: skip
        return _json(body, status=code)

    def hold(self) -> None:
        """Answer nothing until :meth:`release` (an API server that accepts and hangs)."""
        self._released = asyncio.Event()

    def release(self) -> None:
        if self._released is not None:
            self._released.set()
            self._released = None

    @web.middleware
    async def _gate(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if self._released is not None:
            await self._released.wait()
        suffix = "/".join(request.path.split("/")[-2:])
        tail = request.path.rsplit("/", 1)[-1]
        if f"{request.method} {suffix}" in self.refuse or f"{request.method} {tail}" in self.refuse:
            self.requests.append((request.method, request.path))
            return self._status(403, "Forbidden", f"{request.method} {request.path} forbidden")
        if self.throttle and request.method in ("PATCH", "POST", "PUT", "DELETE"):
            self.throttle -= 1
            self.requests.append((request.method, request.path))
            throttled = self._status(429, "TooManyRequests", "too many requests")
            throttled.headers["Retry-After"] = str(self.retry_after)
            return throttled
        response: web.StreamResponse = await handler(request)
        return response

    def node_stored(self) -> dict[str, Any]:
        """The Node as stored (made on first use: the kubelet's conditions, no taints)."""
        if self.node_object is None:
            self.node_object = {
                "apiVersion": "v1", "kind": "Node",
                "metadata": {"name": self.node, "uid": self.node_uid, "resourceVersion": "1",
                             "labels": {"kubernetes.io/hostname": self.node}},
                "spec": {},
                "status": {"conditions": [dict(c) for c in KUBELET_CONDITIONS]},
            }  # fmt: skip
        return self.node_object

    def condition(self, kind: str = "GPUHealthy") -> dict[str, Any] | None:
        """The Node's condition of type ``kind``, as stored."""
        found = [c for c in self.node_stored()["status"]["conditions"] if c["type"] == kind]
        return found[0] if found else None

    def kubelet_conditions(self) -> list[dict[str, Any]]:
        return [c for c in self.node_stored()["status"]["conditions"] if c["type"] != "GPUHealthy"]

    async def _get_node(self, request: web.Request) -> web.Response:
        self.requests.append(("GET", request.path))
        name = request.match_info["name"]
        if name != self.node or not self.node_present:
            return self._status(404, "NotFound", f'nodes "{name}" not found')
        return _json(self.node_stored())

    async def _patch_node_status(self, request: web.Request) -> web.Response:
        self.requests.append(("PATCH", request.path))
        if request.content_type != "application/strategic-merge-patch+json":
            return self._status(415, "UnsupportedMediaType", request.content_type)
        return await self._patch_node_with(request, strategic=True)

    async def _patch_node(self, request: web.Request) -> web.Response:
        self.requests.append(("PATCH", request.path))
        if request.content_type != "application/merge-patch+json":
            return self._status(415, "UnsupportedMediaType", request.content_type)
        return await self._patch_node_with(request, strategic=False)

    async def _patch_node_with(self, request: web.Request, *, strategic: bool) -> web.Response:
        name = request.match_info["name"]
        if name != self.node or not self.node_present:
            return self._status(404, "NotFound", f'nodes "{name}" not found')
        patch = await request.json()
        old = self.node_stored()
        wanted = patch.get("metadata", {}).get("resourceVersion")
        if wanted is not None and wanted != old["metadata"]["resourceVersion"]:
            return self._status(409, "Conflict", "the object has been modified")
        new = copy.deepcopy(old)
        if strategic:  # nodes/status: only the status changes (the status strategy resets spec)
            new["status"] = merged(new["status"], patch.get("status", {}), "status")
        else:  # the Node: its spec and metadata; a status in the patch is ignored
            new = merged(new, {k: v for k, v in patch.items() if k != "status"}, "")
        new["metadata"]["resourceVersion"] = str(next(self._versions))
        refused = self._invalid("patch node", new, [])
        if refused is not None:
            return refused
        self.node_object = new
        return _json(new)

    async def _discover_events(self, request: web.Request) -> web.Response:
        self.requests.append(("GET", request.path))
        if not self.events_api:
            return web.Response(status=404, text="404 page not found")
        return _json({"kind": "APIResourceList", "apiVersion": "v1", "groupVersion":
                      "events.k8s.io/v1", "resources": [{"name": "events", "namespaced": True,
                      "kind": "Event", "verbs": ["create", "get", "list", "patch"]}]})  # fmt: skip

    def _check_event(self, verb: str, obj: dict[str, Any], *, core: bool) -> web.Response | None:
        return self._invalid(verb, obj, validate_event(obj, core=core))

    def _event_creator(self, core: bool) -> Any:
        async def create(request: web.Request) -> web.Response:
            self.requests.append(("POST", request.path))
            if not core and not self.events_api:
                return web.Response(status=404, text="404 page not found")
            obj = await request.json()
            namespace = request.match_info["ns"]
            if obj.get("metadata", {}).get("namespace", namespace) != namespace:
                return self._status(400, "BadRequest", "namespace does not match the path")
            refused = self._check_event("create event", obj, core=core)
            if refused is not None:
                return refused
            key = (namespace, obj["metadata"]["name"])
            if key in self.events:
                return self._status(409, "AlreadyExists", "already exists")
            obj["metadata"]["resourceVersion"] = str(next(self._versions))
            self.events[key] = obj
            return _json(obj, status=201)

        return create

    def _event_patcher(self, core: bool) -> Any:
        async def patch(request: web.Request) -> web.Response:
            self.requests.append(("PATCH", request.path))
            key = (request.match_info["ns"], request.match_info["name"])
            old = self.events.get(key)
            if old is None:
                return self._status(404, "NotFound", f'events "{key[1]}" not found')
            if request.content_type != "application/merge-patch+json":
                return self._status(415, "UnsupportedMediaType", request.content_type)
            new = merged(copy.deepcopy(old), await request.json(), "")
            refused = self._check_event("patch event", new, core=core)
            if refused is not None:
                return refused
            changed = [k for k in EVENT_IMMUTABLE if new.get(k) != old.get(k)]
            if changed and not core:
                self.invalid.append(("patch event", [f"{k} is immutable" for k in changed]))
                return self._status(422, "Invalid", f"immutable: {changed}")
            new["metadata"]["resourceVersion"] = str(next(self._versions))
            self.events[key] = new
            return _json(new)

        return patch

    def node_events(self) -> list[dict[str, Any]]:
        """Events about the Node, oldest first."""
        return sorted(
            (e for e in self.events.values() if regarding(e).get("kind") == "Node"),
            key=lambda e: e["eventTime"],
        )

    def pod_events(self, namespace: str, pod: str) -> list[dict[str, Any]]:
        return [
            e for e in self.events.values()
            if regarding(e).get("kind") == "Pod" and regarding(e).get("name") == pod
            and e["metadata"]["namespace"] == namespace
        ]  # fmt: skip

    async def _get_claim(self, request: web.Request) -> web.Response:
        self.requests.append(("GET", request.path))
        key = (request.match_info["ns"], request.match_info["name"])
        if key not in self.claims:
            return self._status(
                404, "NotFound", f'resourceclaims.resource.k8s.io "{key[1]}" not found'
            )
        return _json(self.claims[key])

    async def _list_slices(self, request: web.Request) -> web.Response:
        self.requests.append(("LIST", request.path_qs))
        selector = dict(
            part.split("=", 1)
            for part in urllib.parse.unquote(request.query.get("fieldSelector", "")).split(",")
            if part
        )
        items = [
            s for s in self.slices.values()
            if all(field_value(s, path) == value for path, value in selector.items())
        ]  # fmt: skip
        body = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSliceList",
                "metadata": {"resourceVersion": "1"}, "items": items}  # fmt: skip
        return _json(body)

    def _check(self, verb: str, obj: dict[str, Any]) -> web.Response | None:
        return self._invalid(verb, obj, validate_slice(obj))

    def _invalid(self, verb: str, obj: dict[str, Any], errors: list[str]) -> web.Response | None:
        """``errors`` found by the object's own checks, and those of the Kubernetes schemas: a 422
        (recorded in :attr:`invalid`), or ``None`` when there are none."""
        errors += schema_errors(obj)
        if errors:
            self.invalid.append((verb, errors))
            return self._status(422, "Invalid", "; ".join(errors))
        return None

    def _stored(self, obj: dict[str, Any]) -> dict[str, Any]:
        obj["metadata"]["resourceVersion"] = str(next(self._versions))
        obj["metadata"].setdefault("uid", f"slice-{obj['metadata']['resourceVersion']}")
        for device in obj["spec"].get("devices") or []:
            for taint in device.get("taints") or []:
                taint.setdefault("timeAdded", "2026-01-01T00:00:00Z")
        self.slices[obj["metadata"]["name"]] = obj
        return obj

    async def _received(
        self, verb: str, request: web.Request
    ) -> tuple[dict[str, Any], web.Response | None]:
        """A write as it arrives: recorded, then checked (the refusal, if any)."""
        obj = await request.json()
        self.requests.append((verb.upper(), request.path))
        self.writes.append((verb, obj))
        return obj, self._check(verb, obj)

    async def _create_slice(self, request: web.Request) -> web.Response:
        obj, refused = await self._received("create", request)
        if refused is not None:
            return refused
        if obj["metadata"]["name"] in self.slices:
            return self._status(409, "AlreadyExists", "already exists")
        return _json(self._stored(obj), status=201)

    async def _replace_slice(self, request: web.Request) -> web.Response:
        obj, refused = await self._received("replace", request)
        if refused is not None:
            return refused
        old = self.slices.get(request.match_info["name"])
        if old is None:
            return self._status(404, "NotFound", "not found")
        if obj["metadata"].get("resourceVersion") != old["metadata"]["resourceVersion"]:
            return self._status(409, "Conflict", "the object has been modified")
        obj["metadata"]["uid"] = old["metadata"]["uid"]
        return _json(self._stored(obj))

    async def _delete_slice(self, request: web.Request) -> web.Response:
        self.requests.append(("DELETE", request.path))
        obj = self.slices.pop(request.match_info["name"], None)
        if obj is None:
            return self._status(404, "NotFound", "not found")
        return _json(obj)

    # ----- views for tests ---------------------------------------------------------------------
    def devices(self) -> dict[str, dict[str, Any]]:
        """Every published device by name, across the node's slices."""
        return {d["name"]: d for s in self.slices.values() for d in s["spec"].get("devices") or []}

    def generation(self) -> int:
        return max((s["spec"]["pool"]["generation"] for s in self.slices.values()), default=0)

    def counter_sets(self) -> dict[str, dict[str, str]]:
        """Every counter set of the node's pool: name → counter → value."""
        return {
            c["name"]: {k: v["value"] for k, v in c["counters"].items()}
            for s in self.slices.values()
            for c in s["spec"].get("sharedCounters") or []
        }

    def pool_errors(self) -> list[str]:
        """What the scheduler would find wrong across the pool's slices: a device consuming
        from a counter set the pool lacks, or a counter the set does not hold, or more of it."""
        sets = self.counter_sets()
        errors = []
        for name, device in self.devices().items():
            for use in device.get("consumesCounters") or []:
                held = sets.get(use["counterSet"])
                if held is None:
                    errors.append(f"{name}: no counter set {use['counterSet']}")
                    continue
                for counter, value in use["counters"].items():
                    if counter not in held:
                        errors.append(f"{name}: {use['counterSet']} has no {counter}")
                    elif quantity_value(value["value"]) > quantity_value(held[counter]):
                        errors.append(f"{name}: consumes more {counter} than there is")
        return errors


def _json(body: object, status: int = 200) -> web.Response:
    """JSON as the API server sends it: ``Content-Type: application/json``, no charset."""
    return web.Response(
        body=json.dumps(body).encode(), status=status, content_type="application/json", charset=None
    )
