"""Saying what the store knows about the GPUs where Kubernetes looks: the Node condition
``GPUHealthy``, events on the Node and on the pods holding a failing GPU, and (optional) the
``nvidia.com/gpu-unhealthy`` taint.

One task per agent, never awaited by anything else: an API server that is slow or down delays
only these writes. On each store change the snapshot is projected
(:func:`~gpuagent.domain.nodehealth.project`); when the projection changes, the model
(:class:`~gpuagent.domain.nodehealth.NodeHealthModel`) works out what to write, and the writes go
out in batches paced by :class:`~gpuagent.kube.pacer.Pacer`: a change of a GPU's health (a cause
that appears or clears) at once, whatever was written before, unless that GPU's cause flaps (it
changed within a minute of its last change going out) or the budget of early writes (as many as
the node has GPUs, two back a minute) is spent; every other change at once after a quiet spell,
then at most once per window. An event never written before is news too, on a GPU that flaps as
well; a written event's series is brought up to date at most every 5 minutes, 16 series a minute
per node (:class:`~gpuagent.domain.nodehealth.SeriesPacing`). Through an outage only the latest
state of each object is kept, and the first batch after it goes out after a random delay (the
backoff's full jitter); whether the API server is reached goes into the store's counters as soon
as a call fails or works again (``gpuagent_kube_backing_off``).

At start the Node is read once: its UID (for events), the condition as a previous agent left it
(an unchanged condition keeps its ``lastTransitionTime`` and is not written again) and its taints.
Every call goes through the pacer, which counts it.

The package by what it owns: :mod:`.writer` (the loop: the view followed, the batches paced, the
Node read, whether the API server is reached), one small writer per thing written —
:mod:`.condition`, :mod:`.taint`, :mod:`.events` (with the events API's discovery) — and
:mod:`.objects` (what they call the API server about, and what they share).
"""

from gpuagent.kube.nodehealth.events import EVENTS_API
from gpuagent.kube.nodehealth.writer import NodeHealthWriter

__all__ = ["EVENTS_API", "NodeHealthWriter"]
