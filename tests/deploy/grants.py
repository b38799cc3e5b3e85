"""What each kustomize build grants the agent (host paths, capabilities, RBAC, ...): the table of
what the base and each overlay and component may grant, and what a build's objects do grant.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from deploy.kustomize import only

HostPath = tuple[str, str, bool]  # (host path, where the container sees it, read-only)
Rule = tuple[str, str, str]  # (API group, resource, verb), or ("", "<non-resource URL>", verb)


@dataclass(frozen=True)
class Grants:
    """What a build grants the agent: on the node (namespaces, privileges, host paths and ports,
    its uid) and in the cluster (a service-account token, RBAC)."""

    host_namespaces: frozenset[str] = frozenset()  # of "pid", "network", "ipc"
    privileged: bool = False
    escalation: bool = False  # allowPrivilegeEscalation not false
    capabilities: frozenset[str] = frozenset()  # added (every one is dropped first)
    host_paths: frozenset[HostPath] = frozenset()
    host_ports: frozenset[int] = frozenset()
    run_as_users: frozenset[int | None] = frozenset({0})
    volume_kinds: frozenset[str] = frozenset({"configMap", "hostPath"})
    token: bool = False
    rbac: frozenset[Rule] = frozenset()

    def plus(self, other: Grants) -> Grants:
        """Both grants (``other``'s flags and sets added to this one's)."""
        return Grants(
            self.host_namespaces | other.host_namespaces,
            self.privileged or other.privileged,
            self.escalation or other.escalation,
            self.capabilities | other.capabilities,
            self.host_paths | other.host_paths,
            self.host_ports | other.host_ports,
            self.run_as_users,
            self.volume_kinds | other.volume_kinds,
            self.token or other.token,
            self.rbac | other.rbac,
        )


def _same(path: str, read_only: bool) -> HostPath:
    return (path, path, read_only)


BASE_GRANTS = Grants(
    # The node condition GPUHealthy and GPU health events (admission-policy.yaml narrows each to
    # the agent's own node; docs/install.md says what the token can do).
    token=True,
    rbac=frozenset(
        {
            ("", "nodes", "get"),
            ("", "nodes/status", "patch"),
            ("events.k8s.io", "events", "create"),
            ("events.k8s.io", "events", "patch"),
            ("", "events", "create"),
            ("", "events", "patch"),
        }
    ),
    host_paths=frozenset(
        {
            # The plugin socket is created here, beside the kubelet's kubelet.sock.
            _same("/var/lib/kubelet/device-plugins", False),
            # The kubelet's pod-resources socket (connecting needs no write access).
            _same("/var/lib/kubelet/pod-resources", True),
            # node-feature-discovery's feature file (GPU feature discovery's labels).
            _same("/etc/kubernetes/node-feature-discovery/features.d", False),
        }
    ),
)
# What each overlay adds to the base.
OVERLAY_GRANTS = {
    "base": Grants(),
    "time-slicing": Grants(),
    "prometheus-operator": Grants(),
    "mig-mixed": Grants(capabilities=frozenset({"SYS_ADMIN"}), escalation=True),
    # The MPS root (its pipe directories are mounted into the containers) and its shared memory
    # at /dev/shm; CAP_SYS_ADMIN for the GPUs' compute mode.
    "mps": Grants(
        capabilities=frozenset({"SYS_ADMIN"}),
        escalation=True,
        host_paths=frozenset(
            {_same("/run/nvidia/mps", False), ("/run/nvidia/mps/shm", "/dev/shm", False)}
        ),
    ),
    "cdi": Grants(
        host_paths=frozenset({_same("/var/run/cdi", False), ("/", "/driver-root", True)})
    ),
    "dra": Grants(
        host_paths=frozenset(
            {
                _same("/var/lib/kubelet/plugins_registry", False),
                _same("/var/lib/kubelet/plugins", False),
            }
        ),
        rbac=frozenset(
            {
                ("resource.k8s.io", "resourceclaims", "get"),
                ("", "nodes", "get"),
                *(
                    ("resource.k8s.io", "resourceslices", verb)
                    for verb in ("get", "list", "create", "update", "delete")
                ),
            }
        ),
    ),
}
# What the accounting component adds: the host's PID namespace and the log links, read-only.
ACCOUNTING_GRANTS = Grants(
    host_namespaces=frozenset({"pid"}),
    host_paths=frozenset({_same("/var/log/containers", True)}),
)
OVERLAY_GRANTS["accounting"] = ACCOUNTING_GRANTS
# What the taint component adds: patch on Nodes (their spec holds the taints), narrowed by its
# admission policy to the one taint of the agent's own node.
TAINT_GRANTS = Grants(rbac=frozenset({("", "nodes", "patch")}))
# What the dynamic-MIG component adds (on the dra overlay): CAP_SYS_ADMIN, which making MIG
# devices takes, and so no refusal of privilege escalation.
MIG_DYNAMIC_GRANTS = Grants(capabilities=frozenset({"SYS_ADMIN"}), escalation=True)
COMPONENT_GRANTS = {
    "accounting": ACCOUNTING_GRANTS,
    "taint-unhealthy-node": TAINT_GRANTS,
    "dra-mig-dynamic": MIG_DYNAMIC_GRANTS,
    # DRA shares through MPS (on the dra overlay): what the mps overlay adds.
    "dra-shares": OVERLAY_GRANTS["mps"],
}


def expected_grants(name: str) -> Grants:
    overlay, _, component = name.partition("+")
    grants = BASE_GRANTS.plus(OVERLAY_GRANTS[overlay])
    return grants.plus(COMPONENT_GRANTS[component]) if component else grants


def grants_of(docs: list[dict[str, Any]]) -> Grants:
    """What the build's DaemonSet and RBAC grant, read from the objects as the API server would."""
    ds = only(docs, "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    pod_sc = pod.get("securityContext", {})
    keys = {"pid": "hostPID", "network": "hostNetwork", "ipc": "hostIPC"}
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    containers = [*pod.get("initContainers", []), *pod["containers"]]
    host_paths: set[HostPath] = set()
    mounted: set[str] = set()
    caps: set[str] = set()
    ports: set[int] = set()
    users: set[int | None] = set()
    privileged = escalation = False
    for ctr in containers:
        sc = ctr.get("securityContext", {})
        privileged |= bool(sc.get("privileged"))
        escalation |= sc.get("allowPrivilegeEscalation") is not False
        assert sc.get("capabilities", {}).get("drop") == ["ALL"], ctr["name"]
        caps |= set(sc.get("capabilities", {}).get("add", []))
        users.add(sc.get("runAsUser", pod_sc.get("runAsUser")))
        ports |= {p["hostPort"] for p in ctr.get("ports", []) if "hostPort" in p}
        for mount in ctr.get("volumeMounts", []):
            mounted.add(mount["name"])
            volume = volumes[mount["name"]]
            if "hostPath" in volume:
                path, read_only = volume["hostPath"]["path"], bool(mount.get("readOnly"))
                host_paths.add((path, mount["mountPath"], read_only))
    # A host path in the pod but in no container is still the pod's: listed as unseen.
    for name, volume in volumes.items():
        if "hostPath" in volume and name not in mounted:
            host_paths.add((volume["hostPath"]["path"], "", True))
    account = pod["serviceAccountName"]
    accounts = [d for d in docs if d["kind"] == "ServiceAccount"]
    (sa,) = [d for d in accounts if d["metadata"]["name"] == account]
    token = pod.get("automountServiceAccountToken", sa.get("automountServiceAccountToken", True))
    namespace = ds["metadata"]["namespace"]
    roles = {(d["kind"], d["metadata"]["name"]): d for d in docs if d["kind"].endswith("Role")}
    rules: set[Rule] = set()
    for binding in (d for d in docs if d["kind"].endswith("RoleBinding")):
        subjects = binding.get("subjects", [])
        if {"kind": "ServiceAccount", "name": account, "namespace": namespace} not in subjects:
            continue
        role = roles[(binding["roleRef"]["kind"], binding["roleRef"]["name"])]
        for rule in role["rules"]:
            for verb in rule["verbs"]:
                rules |= {("", url, verb) for url in rule.get("nonResourceURLs", [])}
                rules |= {
                    (group, resource, verb)
                    for group in rule.get("apiGroups", [])
                    for resource in rule.get("resources", [])
                }
    return Grants(
        host_namespaces=frozenset(ns for ns, key in keys.items() if pod.get(key)),
        privileged=privileged,
        escalation=escalation,
        capabilities=frozenset(caps),
        host_paths=frozenset(host_paths),
        host_ports=frozenset(ports),
        run_as_users=frozenset(users),
        volume_kinds=frozenset(k for v in volumes.values() for k in v if k != "name"),
        token=bool(token),
        rbac=frozenset(rules),
    )
