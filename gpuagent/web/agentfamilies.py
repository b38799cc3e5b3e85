"""The agent's own families, rendered on every scrape: the kubelet, configuration reloads,
pod-resources, NVML calls, the DRA side and the node-health writer (per-container accounting's are
in :mod:`gpuagent.web.usage`) — but for the DRA side's state read off the snapshot
(:func:`dra_state_families`), rendered with the device part, once per snapshot version.

By default they are what an operator acts on — states, errors, the poll's cost — in a few series
a node (a fleet pays for every one of them on every node). ``detailed``
(``--detailed-agent-metrics``) adds the breakdowns and activity counters for a closer look: each
NVML function and the start-up's pieces, API requests by object, request and event counts.
"""

from __future__ import annotations

from collections.abc import Callable

from gpuagent.domain.snapshot import Snapshot
from gpuagent.state.counters import (
    ApiReach,
    DraCounters,
    KubeCounters,
    NvmlCallStats,
    PodResourcesStats,
    ReloadStats,
)
from gpuagent.web.exposition import Family, Single, format_value, label_pairs, single, singles

__all__ = [
    "config_families",
    "dra_families",
    "dra_state_families",
    "kube_families",
    "nvml_families",
    "pod_resources_families",
]


#: The pieces of NVML work timed as a whole (the rest of the names are NVML functions); the poll's
#: probe of a GPU is what the default families time.
NVML_WORK = frozenset({"init", "discover", "probe"})
PROBE = "probe"


def config_families(generation: int, reloads: ReloadStats, *, detailed: bool) -> list[Family]:
    """Whether the last reload was applied (what an operator acts on: a refused configuration);
    ``detailed``: the generation and the reloads by result too."""
    last = single("gpuagent_config_last_reload_successful", "gauge",
                  "Whether the last configuration reload was applied (1; also before any) or "
                  "refused as invalid (0).", (), 1 if reloads.last_successful else 0)  # fmt: skip
    if not detailed:
        return [last]
    total = Family(
        "gpuagent_config_reloads_total",
        "counter",
        "Configuration reloads (SIGHUP or a changed config file), by result: changed (applied), "
        "unchanged (nothing to apply), invalid (refused; the running configuration stays).",
    )
    for result in ("changed", "unchanged", "invalid"):
        total.add((("result", result),), getattr(reloads, result))
    current = single("gpuagent_config_generation", "gauge",
                     "Reloads that changed the running configuration since the agent started.",
                     (), generation)  # fmt: skip
    return [current, last, total]


def dra_families(
    dra: DraCounters | None, reach: ApiReach | None, *, detailed: bool
) -> list[Family]:
    """The DRA side's counts; ``reach``: what its slice publisher last said of the API server.
    (What the snapshot says of DRA is :func:`dra_state_families`'.)"""
    if dra is None:
        return []
    up = single("gpuagent_dra_api_up", "gauge",
                "Whether the last ResourceSlice publication reached the API server (1) or not "
                "(0).", (), 1 if reach is not None and reach.up else 0)  # fmt: skip
    out = [up, *singles(_DRA + (_DRA_DETAILED if detailed else ()), dra)]
    if detailed:
        gone = Family(
            "gpuagent_dra_gone_devices_total",
            "counter",
            "Devices of claims prepared before that were gone when the kubelet asked again (a "
            "reboot, a driver reload, a MIG device destroyed behind the agent's back), by "
            "result: prepared_again (a MIG device made again at its placement, or found under a "
            "new UUID), refused (the claim refused: its placement taken, its device no longer "
            "offered).",
        )
        gone.add((("result", "prepared_again"),), dra.gone_prepared_again)
        gone.add((("result", "refused"),), dra.gone_refused)
        out.append(gone)
    return out


def dra_state_families(snapshot: Snapshot) -> list[Family]:
    """What the snapshot says of the DRA side (none while DRA is off): its plugin's registration
    and the GPUs its published slices lack. Of the snapshot alone, so in the device part,
    rendered once per snapshot version (finding the GPUs builds the node's DRA devices)."""
    registration = snapshot.dra_registration
    if registration is None:
        return []
    return [
        single("gpuagent_dra_unpublished_gpus", "gauge",
               "GPUs given to DRA whose devices are in no published ResourceSlice, so offered "
               "through neither API.", (), len(snapshot.unpublished_dra_gpus())),
        single("gpuagent_dra_registered", "gauge",
               "Whether the kubelet accepted the DRA plugin (1) or not (0).", (),
               1 if registration.registered else 0),
    ]  # fmt: skip


def kube_families(
    kube: KubeCounters | None, reach: ApiReach | None, *, detailed: bool
) -> list[Family]:
    """The node-health writer's; ``reach``: what it last said of the API server."""
    if kube is None:
        return []
    backing_off = single("gpuagent_kube_backing_off", "gauge",
                         "Whether the node-health writer waits for the API server (1: "
                         "unreachable, throttling or failing) or not (0).", (),
                         1 if reach is not None and reach.backing_off else 0)  # fmt: skip
    requests = Family(
        "gpuagent_kube_requests_total",
        "counter",
        "API server requests of the node-health writer (GPUHealthy condition, events, taint), "
        "by result (ok, unreachable, throttled, server_error, forbidden, not_found, conflict, "
        "invalid); with --detailed-agent-metrics also by object (node_condition, node_taint, "
        "event, node, discovery).",
    )
    if detailed:
        for obj, result, count in kube.requests:
            requests.add((("object", obj), ("result", result)), count)
    else:
        by_result: dict[str, int] = {}
        for _, result, count in kube.requests:
            by_result[result] = by_result.get(result, 0) + count
        for result, count in sorted(by_result.items()):
            requests.add((("result", result),), count)
    out = [requests, backing_off, *singles(_KUBE + (_KUBE_DETAILED if detailed else ()), kube)]
    if detailed and kube.condition_written_at is not None:
        out.append(
            single("gpuagent_node_condition_last_write_timestamp_seconds", "gauge",
                   "Unix time the GPUHealthy node condition was last written.", (),
                   round(kube.condition_written_at, 3))
        )  # fmt: skip
    return out


def nvml_families(calls: tuple[NvmlCallStats, ...], *, detailed: bool) -> list[Family]:
    """Every NVML function call by result, and the time and failures of the poll's probe of a
    GPU (``detailed``: of every NVML function and piece of work, by ``call``)."""
    if not calls:
        return []
    made = Family(
        "gpuagent_nvml_calls_total",
        "counter",
        "Calls of NVML functions that failed (result=error; with --detailed-agent-metrics also "
        "those that succeeded, result=ok); which function failed is in the log (and in "
        "gpuagent_nvml_call_errors_total with --detailed-agent-metrics).",
    )
    functions = [c for c in calls if c.call not in NVML_WORK]
    failed = sum(c.errors for c in functions)
    made.add((("result", "error"),), failed)
    if detailed:  # an activity counter
        made.add((("result", "ok"),), sum(c.count for c in functions) - failed)
    seconds = Family(
        "gpuagent_nvml_call_duration_seconds",
        "summary",
        "Time spent in NVML work: the poll's probe of a GPU (call=probe); with "
        "--detailed-agent-metrics also start-up's pieces and each NVML function.",
    )
    errors = Family(
        "gpuagent_nvml_call_errors_total",
        "counter",
        "NVML work that failed: probes of a GPU (call=probe); with --detailed-agent-metrics "
        "also start-up's pieces and each NVML function.",
    )
    for stats in sorted(calls, key=lambda s: s.call):
        if not detailed and stats.call != PROBE:
            continue
        block = "{" + label_pairs((("call", stats.call),)) + "}"
        seconds.samples.append(f"{seconds.name}_sum{block} {format_value(stats.seconds)}\n")
        seconds.samples.append(f"{seconds.name}_count{block} {stats.count}\n")
        errors.add(block, stats.errors)
    return [made, seconds, errors]


def pod_resources_families(
    snapshot: Snapshot,
    stats: PodResourcesStats | None,
    device_ids: int,
    monotonic: Callable[[], float],
    wall: Callable[[], float],
    *,
    detailed: bool,
) -> list[Family]:
    if stats is None:
        return []
    pods = snapshot.pods
    out = [
        single("gpuagent_pod_resources_up", "gauge",
               "Whether the last pod-resources List succeeded (1) or not (0).", (),
               1 if pods.refreshed_at is not None and not pods.error else 0),
        single("gpuagent_pod_resources_socket_present", "gauge",
               "Whether the kubelet pod-resources socket exists (1) or not (0).", (),
               1 if stats.socket_present else 0),
        single("gpuagent_pod_resources_errors_total", "counter",
               "pod-resources List calls that failed (socket absent, kubelet down, error).",
               (), stats.errors),
    ]  # fmt: skip
    if detailed:
        out += [
            single("gpuagent_pod_resources_requests_total", "counter",
                   "pod-resources List calls made.", (), stats.requests),
            single("gpuagent_pod_resources_devices", "gauge",
                   "Device IDs in the last known pod-resources mapping.", (), device_ids),
        ]  # fmt: skip
    if pods.refreshed_at is not None:
        age = max(0.0, monotonic() - pods.refreshed_at)
        out.append(
            single("gpuagent_pod_resources_age_seconds", "gauge",
                   "Seconds since the pod attribution was last refreshed successfully.",
                   (), round(age, 3))
        )  # fmt: skip
        if detailed:
            out.append(
                single("gpuagent_pod_resources_last_success_timestamp_seconds", "gauge",
                       "Unix time of the last successful pod-resources List.", (),
                       round(wall() - age, 3))
            )  # fmt: skip
    return out


_DRA: tuple[Single[DraCounters], ...] = (
    (
        "gpuagent_dra_api_errors_total",
        "counter",
        "ResourceSlice publications that failed (API server unreachable or refusing).",
        lambda d: d.api_errors,
    ),
    (
        "gpuagent_dra_prepare_errors_total",
        "counter",
        "Claims NodePrepareResources could not prepare.",
        lambda d: d.prepare_errors,
    ),
)
_DRA_DETAILED: tuple[Single[DraCounters], ...] = (
    (
        "gpuagent_dra_slice_writes_total",
        "counter",
        "ResourceSlices created or replaced.",
        lambda d: d.slice_writes,
    ),
    (
        "gpuagent_dra_slice_generation",
        "gauge",
        "Generation of the node's ResourceSlice pool as last published.",
        lambda d: d.slice_generation,
    ),
    (
        "gpuagent_dra_devices",
        "gauge",
        "Devices this node serves through DRA.",
        lambda d: d.devices,
    ),
    (
        "gpuagent_dra_prepared_claims",
        "gauge",
        "ResourceClaims prepared on this node (checkpointed).",
        lambda d: d.prepared_claims,
    ),
    (
        "gpuagent_dra_prepares_total",
        "counter",
        "Claims prepared by NodePrepareResources.",
        lambda d: d.prepares,
    ),
    (
        "gpuagent_dra_unprepares_total",
        "counter",
        "Claims unprepared by NodeUnprepareResources.",
        lambda d: d.unprepares,
    ),
)

_KUBE: tuple[Single[KubeCounters], ...] = (
    (
        "gpuagent_kube_events_dropped_total",
        "counter",
        "Events given up: over the pending bound, their namespace gone, or refused as invalid.",
        lambda k: k.events_dropped,
    ),
)
_KUBE_DETAILED: tuple[Single[KubeCounters], ...] = (
    (
        "gpuagent_kube_events_pending",
        "gauge",
        "Events (or repeats of one) waiting to be written.",
        lambda k: k.events_pending,
    ),
)
