"""An API-server stand-in (aiohttp): for the DRA side, Nodes and ResourceClaims to read and
ResourceSlices to write; for the node-health writer, the Node's status (strategic-merge patches
of ``nodes/status``) and spec (merge patches, with a ``resourceVersion`` precondition), and
Events (``events.k8s.io/v1``, or core ``v1`` when the server is told not to serve that group,
``events_api=False``). Every write is checked as the API server would check it.

Each object the agent writes is validated against the ``resource.k8s.io/v1`` OpenAPI schema
(kubernetes-validate's bundled schemas, strict: unknown fields fail) for the oldest Kubernetes that
serves the API (1.34) and the newest bundled, and against the API server's own rules that no
schema expresses (names, attribute keys and values, limits, taints: ``validate_slice``). A write
that fails is refused with 422 and recorded in :attr:`FakeApiServer.invalid`, so a test can
assert there were none.

Nodes and Events are validated the same way (the Node after each patch, as stored; events against
the API server's own rules too: ``validate_event``, and on update, what ``events.k8s.io/v1``
keeps immutable). Every request is recorded in :attr:`FakeApiServer.requests` (verb, path), so a
test counts them; :attr:`FakeApiServer.refuse` answers chosen requests 403, ``node_present=False``
makes the Node 404, :attr:`FakeApiServer.throttle` answers the next N writes 429 with
``Retry-After``, and :meth:`FakeApiServer.hold` keeps every answer back until released.

``stop()`` closes the listener and every connection (the agent then sees "connection refused"),
``start()`` serves again on the same port.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import itertools
import json
import re
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import yaml
from aiohttp import web

from .requestpolicy import capacity_errors

__all__ = ["FakeApiServer", "claim", "validate_event", "validate_slice"]

K8S_VERSIONS = ("1.34.0", kubernetes_validate.latest_version())
RESOURCE = "/apis/resource.k8s.io/v1"
EVENTS = "/apis/events.k8s.io/v1"
#: The kubelet's own conditions on the stored Node (the node-health writer must leave them be).
KUBELET_CONDITIONS = tuple(
    {"type": kind, "status": status, "reason": reason, "message": message,
     "lastHeartbeatTime": "2026-01-01T00:00:00Z", "lastTransitionTime": "2026-01-01T00:00:00Z"}
    for kind, status, reason, message in (
        ("MemoryPressure", "False", "KubeletHasSufficientMemory",
         "kubelet has sufficient memory available"),
        ("DiskPressure", "False", "KubeletHasNoDiskPressure", "kubelet has no disk pressure"),
        ("PIDPressure", "False", "KubeletHasSufficientPID", "kubelet has sufficient PID available"),
        ("Ready", "True", "KubeletReady", "kubelet is posting ready status"),
    )
)  # fmt: skip

_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_C_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SEMVER = re.compile(
    r"(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(-[0-9A-Za-z-]+(\.[0-9A-Za-z-]+)*)?(\+[0-9A-Za-z-]+(\.[0-9A-Za-z-]+)*)?"
)
_QUANTITY = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+|Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE])?")
_LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
_QUALIFIED = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")


def _subdomain(value: object, limit: int = 253) -> bool:
    return isinstance(value, str) and len(value) <= limit and bool(_DNS_SUBDOMAIN.fullmatch(value))


def _attribute_name(name: str) -> bool:
    domain, slash, ident = name.rpartition("/")
    if slash and not _subdomain(domain, 63):
        return False
    return len(ident) <= 32 and bool(_C_IDENTIFIER.fullmatch(ident))


def _label_key(key: str) -> bool:
    prefix, slash, name = key.rpartition("/")
    if slash and not _subdomain(prefix):
        return False
    return 0 < len(name) <= 63 and bool(_QUALIFIED.fullmatch(name))


def validate_slice(obj: Mapping[str, Any]) -> list[str]:
    """The API server's validation of a ResourceSlice beyond the schema (resource.k8s.io/v1)."""
    errors: list[str] = []
    meta, spec = obj.get("metadata", {}), obj.get("spec", {})
    if not _subdomain(meta.get("name")):
        errors.append(f"metadata.name {meta.get('name')!r} is not a DNS subdomain")
    if not _subdomain(spec.get("driver"), 63):
        errors.append(f"spec.driver {spec.get('driver')!r} is not a DNS subdomain of <= 63")
    pool = spec.get("pool", {})
    if not isinstance(pool.get("name"), str) or not pool["name"] or len(pool["name"]) > 253:
        errors.append("spec.pool.name is required, <= 253 characters")
    if not isinstance(pool.get("generation"), int) or pool["generation"] < 0:
        errors.append("spec.pool.generation must be >= 0")
    if not isinstance(pool.get("resourceSliceCount"), int) or pool["resourceSliceCount"] < 1:
        errors.append("spec.pool.resourceSliceCount must be > 0")
    where = [
        k for k in ("nodeName", "nodeSelector", "allNodes", "perDeviceNodeSelection") if spec.get(k)
    ]
    if len(where) != 1:
        errors.append(
            f"exactly one of nodeName, nodeSelector, allNodes, perDeviceNodeSelection: {where}"
        )
    devices = spec.get("devices") or []
    errors += _counter_errors(spec)
    tainted = any(d.get("taints") or d.get("consumesCounters") for d in devices)
    if len(devices) > (64 if tainted else 128):
        errors.append(f"{len(devices)} devices: more than {64 if tainted else 128}")
    names = [d.get("name") for d in devices]
    if len(set(names)) != len(names):
        errors.append("device names are not unique")
    for i, device in enumerate(devices):
        at = f"spec.devices[{i}]"
        if not (
            isinstance(device.get("name"), str)
            and len(device["name"]) <= 63
            and _DNS_LABEL.fullmatch(device["name"])
        ):
            errors.append(f"{at}.name {device.get('name')!r} is not a DNS label")
        attributes, capacity = device.get("attributes") or {}, device.get("capacity") or {}
        if len(attributes) + len(capacity) > 32:
            errors.append(f"{at}: more than 32 attributes and capacities")
        for name, value in attributes.items():
            if not _attribute_name(name):
                errors.append(
                    f"{at}.attributes[{name}]: not a C identifier with an optional domain"
                )
            set_ = [
                k
                for k in ("bool", "int", "string", "version")
                if k in value and value[k] is not None
            ]
            if len(set_) != 1:
                errors.append(f"{at}.attributes[{name}]: exactly one value must be set, got {set_}")
            if "string" in value and len(value["string"]) > 64:
                errors.append(f"{at}.attributes[{name}]: string longer than 64")
            if "version" in value and not (
                len(value["version"]) <= 64 and _SEMVER.fullmatch(value["version"])
            ):
                errors.append(f"{at}.attributes[{name}]: {value['version']!r} is not semver 2.0.0")
        for name, value in capacity.items():
            if not _attribute_name(name):
                errors.append(f"{at}.capacity[{name}]: bad name")
            if not _QUANTITY.fullmatch(str(value.get("value", ""))):
                errors.append(f"{at}.capacity[{name}]: {value.get('value')!r} is not a quantity")
        errors += capacity_errors(at, device)
        taints = device.get("taints") or []
        if len(taints) > 4:
            errors.append(f"{at}: more than 4 taints")
        for taint in taints:
            if not _label_key(taint.get("key", "")):
                errors.append(f"{at}.taints: key {taint.get('key')!r} is not a label name")
            if (
                not _LABEL_VALUE.fullmatch(taint.get("value", ""))
                or len(taint.get("value", "")) > 63
            ):
                errors.append(f"{at}.taints: value {taint.get('value')!r} is not a label value")
            if taint.get("effect") not in ("NoSchedule", "NoExecute", "None"):
                errors.append(f"{at}.taints: effect {taint.get('effect')!r}")
    for owner in meta.get("ownerReferences") or []:
        if not owner.get("uid") or not owner.get("name"):
            errors.append("ownerReferences need a name and a uid")
    return errors


def _counters_errors(at: str, counters: object) -> list[str]:
    if not isinstance(counters, Mapping) or not counters:
        return [f"{at}.counters: required"]
    errors = [f"{at}.counters: more than 32"] if len(counters) > 32 else []
    for name, value in counters.items():
        if not (len(name) <= 63 and _DNS_LABEL.fullmatch(name)):
            errors.append(f"{at}.counters[{name}]: not a DNS label")
        if not _QUANTITY.fullmatch(str((value or {}).get("value", ""))):
            errors.append(f"{at}.counters[{name}]: {value!r} is not a quantity")
    return errors


def _counter_errors(spec: Mapping[str, Any]) -> list[str]:
    """Partitionable devices as 1.37 validates them (pkg/apis/resource/validation): a slice holds
    devices or shared counters, never both; at most 8 counter sets of at most 32 counters, DNS
    labels; a device consumes from at most 2 sets, once each, at most 32 counters."""
    errors: list[str] = []
    sets = spec.get("sharedCounters") or []
    devices = spec.get("devices") or []
    if sets and devices:
        errors.append("only one of devices and sharedCounters may be set")
    if len(sets) > 8:
        errors.append(f"{len(sets)} counter sets: more than 8")
    names = [c.get("name") for c in sets]
    if len(set(names)) != len(names):
        errors.append("counter set names are not unique")
    for i, counter_set in enumerate(sets):
        at = f"spec.sharedCounters[{i}]"
        name = counter_set.get("name")
        if not (isinstance(name, str) and len(name) <= 63 and _DNS_LABEL.fullmatch(name)):
            errors.append(f"{at}.name {name!r} is not a DNS label")
        errors += _counters_errors(at, counter_set.get("counters"))
    for i, device in enumerate(devices):
        uses = device.get("consumesCounters") or []
        at = f"spec.devices[{i}].consumesCounters"
        if len(uses) > 2:
            errors.append(f"{at}: more than 2")
        if len({u.get("counterSet") for u in uses}) != len(uses):
            errors.append(f"{at}: a counter set named twice")
        for j, use in enumerate(uses):
            errors += _counters_errors(f"{at}[{j}]", use.get("counters"))
    return errors


_QUALIFIED_NAME = re.compile(
    r"(([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*)/)?"
    r"([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9]"
)
# What an update through events.k8s.io/v1 may not change (apis/core/validation/events.go).
_EVENT_IMMUTABLE = ("regarding", "involvedObject", "reason", "note", "message", "type", "action",
                    "related", "reportingController", "reportingComponent", "reportingInstance",
                    "eventTime")  # fmt: skip


def validate_event(obj: Mapping[str, Any], *, core: bool = False) -> list[str]:
    """The API server's validation of a new-style event (``eventTime`` set) beyond the schema:
    events.k8s.io/v1, or core v1 (``core``: ``reportingComponent``, ``message``,
    ``involvedObject``)."""
    errors: list[str] = []
    meta = obj.get("metadata", {})
    if not _subdomain(meta.get("name")):
        errors.append(f"metadata.name {meta.get('name')!r} is not a DNS subdomain")
    namespace = meta.get("namespace", "")
    regarding = obj.get("involvedObject" if core else "regarding") or {}
    if not regarding.get("namespace") and namespace not in ("default", "kube-system"):
        errors.append(f"an event about a cluster-scoped object lives in default, not {namespace}")
    if regarding.get("namespace") and regarding["namespace"] != namespace:
        errors.append("regarding.namespace does not match the event's namespace")
    if not obj.get("eventTime"):
        errors.append("eventTime is required")
    if obj.get("type") not in ("Normal", "Warning"):
        errors.append(f"type {obj.get('type')!r} is not Normal or Warning")
    controller = obj.get("reportingComponent" if core else "reportingController") or ""
    if not controller or not _QUALIFIED_NAME.fullmatch(controller):
        errors.append(f"reportingController {controller!r} is not a qualified name")
    for name, limit in (("reportingInstance", 128), ("action", 128), ("reason", 128)):
        value = obj.get(name) or ""
        if not value or len(value) > limit:
            errors.append(f"{name} is required, at most {limit} characters")
    if len(obj.get("message" if core else "note") or "") > 1024:
        errors.append("note: at most 1024 characters")
    series = obj.get("series")
    if series is not None and (series.get("count", 0) < 2 or not series.get("lastObservedTime")):
        errors.append("series.count must be >= 2, with series.lastObservedTime")
    for old in ("firstTimestamp", "lastTimestamp", "count") if not core else ():
        if obj.get(old):
            errors.append(f"{old} must be unset")
    return errors


def claim(
    namespace: str,
    name: str,
    uid: str,
    results: list[tuple[str, str, str, str]] | None,
    *,
    config: list[dict[str, Any]] | None = None,
    consumed: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A ResourceClaim; ``results`` are ``(request, driver, pool, device)``, ``None`` =
    not allocated. ``consumed``: each request asked for these capacities of a device that allows
    multiple allocations, and each result consumed them (``consumedCapacity``, with a
    ``shareID``), as a scheduler with consumable capacity (KEP-5075) allocates it."""
    requests = sorted({r[0].split("/")[0] for r in results or []}) or ["gpu"]
    exactly: dict[str, Any] = {"deviceClassName": "gpu.nvidia.com"}
    if consumed is not None:
        exactly["capacity"] = {"requests": dict(consumed)}
    obj: dict[str, Any] = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace, "uid": uid, "resourceVersion": "1"},
        "spec": {"devices": {"requests": [{"name": r, "exactly": exactly} for r in requests]}},
    }
    if results is not None:
        shared = {} if consumed is None else {"consumedCapacity": dict(consumed)}
        obj["status"] = {
            "allocation": {
                "devices": {
                    "results": [
                        {"request": r, "driver": d, "pool": p, "device": dev, **shared,
                         **({"shareID": _share_id(uid, i)} if shared else {})}
                        for i, (r, d, p, dev) in enumerate(results)
                    ],
                    **({"config": config} if config else {}),
                }
            }
        }  # fmt: skip
    return obj


def _share_id(claim_uid: str, index: int) -> str:
    """A result's shareID: a UUID, as the scheduler gives one (derived, so tests are stable)."""
    digest = hashlib.sha256(f"{claim_uid}/{index}".encode()).hexdigest()
    return f"{digest[:8]}-{digest[8:12]}-4{digest[13:16]}-8{digest[17:20]}-{digest[20:32]}"


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
        for version in K8S_VERSIONS:  # the test's own data is valid too
            kubernetes_validate.validate(obj, version, strict=True)
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
            new["status"] = _merged(new["status"], patch.get("status", {}), "status")
        else:  # the Node: its spec and metadata; a status in the patch is ignored
            new = _merged(new, {k: v for k, v in patch.items() if k != "status"}, "")
        new["metadata"]["resourceVersion"] = str(next(self._versions))
        errors = []
        for version in K8S_VERSIONS:
            try:
                kubernetes_validate.validate(new, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                errors.append(f"schema {version}: {exc.message}")
        if errors:
            self.invalid.append(("patch node", errors))
            return self._status(422, "Invalid", "; ".join(errors))
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
            new = _merged(copy.deepcopy(old), await request.json(), "")
            refused = self._check_event("patch event", new, core=core)
            if refused is not None:
                return refused
            changed = [k for k in _EVENT_IMMUTABLE if new.get(k) != old.get(k)]
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
            (e for e in self.events.values() if _regarding(e).get("kind") == "Node"),
            key=lambda e: e["eventTime"],
        )

    def pod_events(self, namespace: str, pod: str) -> list[dict[str, Any]]:
        return [
            e for e in self.events.values()
            if _regarding(e).get("kind") == "Pod" and _regarding(e).get("name") == pod
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
            if all(_field(s, path) == value for path, value in selector.items())
        ]  # fmt: skip
        body = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSliceList",
                "metadata": {"resourceVersion": "1"}, "items": items}  # fmt: skip
        return _json(body)

    def _check(self, verb: str, obj: dict[str, Any]) -> web.Response | None:
        return self._invalid(verb, obj, validate_slice(obj))

    def _invalid(self, verb: str, obj: dict[str, Any], errors: list[str]) -> web.Response | None:
        """``errors`` found by the object's own checks, and those of the Kubernetes schemas: a 422
        (recorded in :attr:`invalid`), or ``None`` when there are none."""
        for version in K8S_VERSIONS:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                errors.append(f"schema {version}: {exc.message}")
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
                    elif _bytes(value["value"]) > _bytes(held[counter]):
                        errors.append(f"{name}: consumes more {counter} than there is")
        return errors


def _bytes(quantity: str) -> int:
    """An integer quantity (``81152Mi``, ``132``) as a number."""
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}
    for suffix, unit in units.items():
        if quantity.endswith(suffix):
            return int(quantity[: -len(suffix)]) * unit
    return int(quantity)


def _json(body: object, status: int = 200) -> web.Response:
    """JSON as the API server sends it: ``Content-Type: application/json``, no charset."""
    return web.Response(
        body=json.dumps(body).encode(), status=status, content_type="application/json", charset=None
    )


def _regarding(event: Mapping[str, Any]) -> dict[str, Any]:
    found: dict[str, Any] = event.get("regarding") or event.get("involvedObject") or {}
    return found


# Lists a strategic-merge patch merges by a key (the rest are replaced whole).
_MERGE_KEYS = {"status.conditions": "type", "status.addresses": "type"}


def _merged(target: Any, patch: Any, path: str) -> Any:
    """``patch`` applied to ``target``: a JSON merge patch, with the strategic merge of the
    lists in :data:`_MERGE_KEYS` (items merged on their key, the others kept)."""
    if not isinstance(patch, dict) or not isinstance(target, dict):
        return copy.deepcopy(patch)
    out = dict(target)
    for key, value in patch.items():
        if key.startswith("$"):
            raise ValueError(f"patch directive {key} is not supported by the fake")
        where = f"{path}.{key}" if path else key
        if value is None:
            out.pop(key, None)
        elif where in _MERGE_KEYS and isinstance(value, list):
            merge_key = _MERGE_KEYS[where]
            items = [dict(item) for item in out.get(key) or []]
            for item in value:
                same = [i for i, old in enumerate(items) if old.get(merge_key) == item[merge_key]]
                if same:
                    items[same[0]] = _merged(items[same[0]], item, where)
                else:
                    items.append(copy.deepcopy(item))
            out[key] = items
        else:
            out[key] = _merged(out.get(key), value, where)
    return out


def _field(obj: Mapping[str, Any], path: str) -> object:
    value: object = obj
    for part in path.split("."):
        value = value.get(part) if isinstance(value, Mapping) else None
    return value
