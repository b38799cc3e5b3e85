"""The API server's validation of what the agent writes, for the API-server stand-in: the
Kubernetes OpenAPI schemas (kubernetes-validate's bundled ones, strict: unknown fields fail) for the
oldest Kubernetes that serves ``resource.k8s.io/v1`` (1.34) and the newest bundled
(:func:`schema_errors`), and the API server's own rules that no schema expresses: a
ResourceSlice's names, attribute keys and values, limits, taints and counters
(:func:`validate_slice`), a new-style Event's (:func:`validate_event`) and what an update through
``events.k8s.io/v1`` keeps immutable (:data:`EVENT_IMMUTABLE`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]

from .requestpolicy import capacity_errors

__all__ = ["EVENT_IMMUTABLE", "K8S_VERSIONS", "schema_errors", "validate_event", "validate_slice"]

K8S_VERSIONS = ("1.34.0", kubernetes_validate.latest_version())

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
EVENT_IMMUTABLE = ("regarding", "involvedObject", "reason", "note", "message", "type", "action",
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


def schema_errors(obj: Mapping[str, Any]) -> list[str]:
    """What the schemas of each of :data:`K8S_VERSIONS` find wrong with ``obj`` (strict)."""
    errors = []
    for version in K8S_VERSIONS:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            errors.append(f"schema {version}: {exc.message}")
    return errors
