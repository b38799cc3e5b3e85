"""What Kubernetes is told about this node's GPUs: the ``GPUHealthy`` Node condition, Events on
the Node and on the pods that hold a failing GPU, and the optional ``nvidia.com/gpu-unhealthy``
taint — as pure values built from a :class:`~gpuagent.domain.devices.NodeState`.

:func:`project` reduces a snapshot to a :class:`NodeHealthView`: the unhealthy GPUs and MIG
devices with their conditions, and the pods holding them. A writer acts only when that view
changes (a poll that changes a temperature changes nothing here). :class:`NodeHealthModel` folds
successive views into what should be written:

- the **condition**: ``True``/``AllGPUsHealthy``, or ``False`` with the worst cause's reason
  (:data:`REASONS`, worst first) and a message naming each affected device (index, UUID, MIG
  instance), its evidence (XID number and catalog meaning, the catalog's or the driver's
  recommended action) and since when it has been unhealthy (a time, never a duration: the message
  changes only when the facts do);
- **events**: one when a device turns unhealthy (with its evidence) and one when it recovers, on
  the Node; one on each pod holding the device when it turns unhealthy. An event that repeats (a
  device flapping) is folded into the existing event's series (count, last time), never written
  again as a new event; the series is brought up to date at a slow cadence (:mod:`.series`). At
  most :data:`MAX_EVENTS` are kept (pending or written); past that the
  oldest written ones are forgotten first, then the oldest pending ones are dropped and counted.

The package by what it owns: :mod:`.view` (the projection), :mod:`.condition` (the condition and
the words for a device's evidence), :mod:`.events` (events, their names and manifests),
:mod:`.series` (how often a written series is updated) and :mod:`.model` (the fold of successive
views into what to write).
"""

from gpuagent.domain.nodehealth.condition import (
    CONDITION_TYPE,
    HEALTHY_REASON,
    MAX_LISTED,
    REASONS,
    ConditionReport,
    condition_patch,
    condition_report,
    evidence,
    worst_reason,
)
from gpuagent.domain.nodehealth.events import (
    NOTE_LIMIT,
    REPORTING_CONTROLLER,
    EventKey,
    EventRecord,
    Regarding,
    event_manifest,
    event_name,
    series_patch,
)
from gpuagent.domain.nodehealth.model import MAX_EVENTS, TAINT_KEY, NodeHealthModel
from gpuagent.domain.nodehealth.series import SERIES_INTERVAL, SeriesPacing
from gpuagent.domain.nodehealth.view import (
    DeviceRef,
    Fault,
    NodeHealthView,
    faults_by_cause,
    project,
)

__all__ = [
    "CONDITION_TYPE",
    "HEALTHY_REASON",
    "MAX_EVENTS",
    "MAX_LISTED",
    "NOTE_LIMIT",
    "REASONS",
    "REPORTING_CONTROLLER",
    "SERIES_INTERVAL",
    "TAINT_KEY",
    "ConditionReport",
    "DeviceRef",
    "EventKey",
    "EventRecord",
    "Fault",
    "NodeHealthModel",
    "NodeHealthView",
    "Regarding",
    "SeriesPacing",
    "condition_patch",
    "condition_report",
    "evidence",
    "event_manifest",
    "event_name",
    "faults_by_cause",
    "project",
    "series_patch",
    "worst_reason",
]
