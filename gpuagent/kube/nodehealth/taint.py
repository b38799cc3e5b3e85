"""The Node's ``nvidia.com/gpu-unhealthy`` taint (``NoSchedule``), on while every GPU of the node
is unhealthy: added or removed by a patch of the Node's taints made against the Node as just
read (its ``resourceVersion``), leaving every other taint as it is."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import structlog

from gpuagent.domain.nodehealth import TAINT_KEY
from gpuagent.kube.nodehealth.objects import ApiObject, NodeApi
from gpuagent.kube.pacer import CallFailed

__all__ = ["TaintWriter", "has_taint"]

log = structlog.get_logger("gpuagent.kube")


class TaintWriter:
    """Keeps the taint as the model wants it, once the Node is read (:meth:`found`)."""

    object = ApiObject.TAINT

    def __init__(self, target: NodeApi) -> None:
        self._target = target
        self._has: bool | None = None  # whether the Node has the taint, as last seen (None: unread)

    def found(self, node: Mapping[str, Any]) -> None:
        """The Node as read at start."""
        self._has = has_taint(node)

    def wanted(self) -> bool:
        model = self._target.model
        return (
            self._has is not None and model.view is not None and (self._has != model.taint_wanted())
        )

    async def write(self) -> bool:
        target = self._target
        wanted = target.model.taint_wanted()
        if target.model.view is None or self._has == wanted:
            return False
        # The Node again, for its resourceVersion (and taints others changed meanwhile).
        node = await target.pacer.call(ApiObject.NODE, target.api.node(target.node))
        self._has = has_taint(node)
        if self._has == wanted:
            return False
        taints = [t for t in node.get("spec", {}).get("taints") or [] if t["key"] != TAINT_KEY]
        if wanted:
            taints.append({"key": TAINT_KEY, "effect": "NoSchedule"})
        patch = {
            "metadata": {"resourceVersion": node["metadata"]["resourceVersion"]},
            "spec": {"taints": taints or None},
        }
        try:
            await target.pacer.call(self.object, target.api.patch_node(target.node, patch))
        except CallFailed as exc:
            if exc.kind == "retry":
                raise
            return True  # a conflict (the Node changed meanwhile) is tried again next window
        self._has = wanted
        log.info("node taint " + ("added" if wanted else "removed"), taint=TAINT_KEY)
        return True


def has_taint(node: Mapping[str, Any]) -> bool:
    """Whether ``node`` (as read) has the taint."""
    return any(t.get("key") == TAINT_KEY for t in node.get("spec", {}).get("taints") or [])
