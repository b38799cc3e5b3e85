"""What the node-health writers call the API server about (:class:`ApiObject`), and what they
share (:class:`NodeApi`): the connection, the pacer every call goes through, the Node's name and
the model of what to write."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from gpuagent.domain.nodehealth import NodeHealthModel
from gpuagent.kube.client import KubeApi
from gpuagent.kube.pacer import Pacer

__all__ = ["ApiObject", "NodeApi", "Part", "event_key"]


class ApiObject(StrEnum):
    """An object of the node-health writers' calls: what each call is counted under
    (``gpuagent_kube_requests_total{object=…}``) and what a refusal holds back (the events
    are held back by namespace: :func:`event_key`)."""

    DISCOVERY = "discovery"  # whether the API server serves events.k8s.io/v1
    NODE = "node"  # the Node, read
    CONDITION = "node_condition"
    TAINT = "node_taint"
    EVENT = "event"


def event_key(namespace: str) -> str:
    """What a refusal of an event in ``namespace`` holds back (that namespace's events)."""
    return f"{ApiObject.EVENT}:{namespace}"


@dataclass(frozen=True, slots=True)
class NodeApi:
    """What every node-health writer writes through."""

    api: KubeApi
    pacer: Pacer
    node: str  # the Node's name
    model: NodeHealthModel


class Part(Protocol):
    """One thing the node-health writer writes (the condition, the taint, the events)."""

    @property
    def object(self) -> ApiObject:
        """What its calls are counted under, and a refusal holds it back under."""
        ...

    def wanted(self) -> bool:
        """Whether it has something to write now."""
        ...

    async def write(self) -> bool:
        """Write what it has; whether it wrote (a write opens the pacer's window). Raises
        :class:`~gpuagent.kube.pacer.CallFailed` (``retry``) when the server is down."""
        ...
