"""Objects as the API-server stand-in holds them, and the API server's ways with them: a
ResourceClaim as the scheduler leaves it (:func:`claim`), the kubelet's own conditions on a Node
(:data:`KUBELET_CONDITIONS`), a merge patch applied as the API server applies it, strategic or not
(:func:`merged`), a field selector's path looked up (:func:`field_value`), and what an event is
about (:func:`regarding`).
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Mapping
from typing import Any

__all__ = ["KUBELET_CONDITIONS", "claim", "field_value", "merged", "regarding"]

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


def regarding(event: Mapping[str, Any]) -> dict[str, Any]:
    found: dict[str, Any] = event.get("regarding") or event.get("involvedObject") or {}
    return found


# Lists a strategic-merge patch merges by a key (the rest are replaced whole).
_MERGE_KEYS = {"status.conditions": "type", "status.addresses": "type"}


def merged(target: Any, patch: Any, path: str) -> Any:
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
                    items[same[0]] = merged(items[same[0]], item, where)
                else:
                    items.append(copy.deepcopy(item))
            out[key] = items
        else:
            out[key] = merged(out.get(key), value, where)
    return out


def field_value(obj: Mapping[str, Any], path: str) -> object:
    value: object = obj
    for part in path.split("."):
        value = value.get(part) if isinstance(value, Mapping) else None
    return value
