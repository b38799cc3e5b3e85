"""An API-server stand-in (aiohttp) for the DRA side: Nodes and ResourceClaims to read,
ResourceSlices to write, every write checked as the API server would check it.

Each object the agent writes is validated against the ``resource.k8s.io/v1`` OpenAPI schema
(kubernetes-validate's bundled schemas, strict: unknown fields fail) for the oldest Kubernetes that
serves the API (1.34) and the newest bundled, and against the API server's own rules that no
schema expresses (names, attribute keys and values, limits, taints: ``validate_slice``). A write
that fails is refused with 422 and recorded in :attr:`FakeApiServer.invalid`, so a test can
assert there were none.

``stop()`` closes the listener and every connection (the agent then sees "connection refused"),
``start()`` serves again on the same port.
"""

from __future__ import annotations

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

__all__ = ["FakeApiServer", "claim", "validate_slice"]

K8S_VERSIONS = ("1.34.0", kubernetes_validate.latest_version())
RESOURCE = "/apis/resource.k8s.io/v1"

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
    tainted = any(d.get("taints") for d in devices)
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


def claim(
    namespace: str,
    name: str,
    uid: str,
    results: list[tuple[str, str, str, str]] | None,
    *,
    config: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """A ResourceClaim; ``results`` are ``(request, driver, pool, device)``, ``None`` =
    not allocated."""
    requests = sorted({r[0].split("/")[0] for r in results or []}) or ["gpu"]
    obj: dict[str, Any] = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace, "uid": uid, "resourceVersion": "1"},
        "spec": {
            "devices": {
                "requests": [
                    {"name": r, "exactly": {"deviceClassName": "gpu.nvidia.com"}} for r in requests
                ]
            }
        },
    }
    if results is not None:
        obj["status"] = {
            "allocation": {
                "devices": {
                    "results": [
                        {"request": r, "driver": d, "pool": p, "device": dev}
                        for r, d, p, dev in results
                    ],
                    **({"config": config} if config else {}),
                }
            }
        }
    return obj


@dataclass
class FakeApiServer:
    node: str
    node_uid: str = "0c7d2a4e-6f0b-4c1a-9d3e-5b8f2a1c7e90"
    claims: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    slices: dict[str, dict[str, Any]] = field(default_factory=dict)
    writes: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    invalid: list[tuple[str, list[str]]] = field(default_factory=list)
    requests: list[tuple[str, str]] = field(default_factory=list)
    port: int = 0
    _runner: web.AppRunner | None = None
    _versions: Any = field(default_factory=lambda: itertools.count(100))

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
        app = web.Application()
        app.router.add_get("/api/v1/nodes/{name}", self._get_node)
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

    async def _get_node(self, request: web.Request) -> web.Response:
        self.requests.append(("GET", request.path))
        name = request.match_info["name"]
        if name != self.node:
            return self._status(404, "NotFound", f'nodes "{name}" not found')
        return _json({"apiVersion": "v1", "kind": "Node",
                                  "metadata": {"name": name, "uid": self.node_uid}})  # fmt: skip

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
        errors = validate_slice(obj)
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


def _json(body: object, status: int = 200) -> web.Response:
    """JSON as the API server sends it: ``Content-Type: application/json``, no charset."""
    return web.Response(
        body=json.dumps(body).encode(), status=status, content_type="application/json", charset=None
    )


def _field(obj: Mapping[str, Any], path: str) -> object:
    value: object = obj
    for part in path.split("."):
        value = value.get(part) if isinstance(value, Mapping) else None
    return value
