"""The API server's options: credentials, and what the node-health writer tells Kubernetes."""

from __future__ import annotations

from gpuagent.config.option import Option
from gpuagent.config.values import parse_bool, parse_heartbeat, parse_path

KUBECONFIG = Option(
    "kubeconfig",
    parse_path,
    "API server access for DRA, the node condition and events (default: the pod's in-cluster "
    "service account)",
    "FILE",
    default=None,
)
NODE_CONDITION = Option(
    "node-condition",
    parse_bool,
    "write the Node condition GPUHealthy: True (AllGPUsHealthy), or False with the worst cause "
    "and each failing GPU (default true where the agent has API credentials)",
    is_bool=True,
    default=None,
)
EVENTS = Option(
    "events",
    parse_bool,
    "Events on the Node for each GPU that turns unhealthy or recovers, and on each pod holding "
    "a GPU that fails (default true where the agent has API credentials)",
    is_bool=True,
    default=None,
)
TAINT_UNHEALTHY_NODE = Option(
    "taint-unhealthy-node",
    parse_bool,
    "taint the Node nvidia.com/gpu-unhealthy:NoSchedule while every GPU of it is unhealthy; "
    "needs patch on nodes (manifests/components/taint-unhealthy-node) (default false)",
    is_bool=True,
    default=False,
)
NODE_CONDITION_HEARTBEAT = Option(
    "node-condition-heartbeat",
    parse_heartbeat,
    "seconds between writes of an unchanged GPUHealthy condition (its lastHeartbeatTime), 60 "
    "to 86400; at rest the condition costs two requests an hour (default 1800)",
    "SECONDS",
    default=1800.0,
)
