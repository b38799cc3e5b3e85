"""Each build grants exactly its row of the grants table, no more; the service account's writes
are pinned to the agent's own node; the DRA overlay and the components grant only what they use.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from deploy.grants import expected_grants, grants_of
from deploy.kustomize import (
    ALL_BUILDS,
    KUSTOMIZATIONS,
    build,
    container,
    daemonset,
    effective_settings,
    kustomize,
    manifest_env,
    only,
)


@pytest.mark.parametrize("name", ALL_BUILDS)
def test_each_build_grants_exactly_its_table_row(name: str) -> None:
    """The base grants the device plugin, health, labels and metrics what they need and nothing
    else (no host namespace, no runtime socket, no host /); each overlay and the accounting
    component add exactly their row. A grant that appears, goes or changes fails here."""
    assert grants_of(build(name)) == expected_grants(name)


def test_the_base_grants_no_host_namespace_runtime_socket_or_host_root() -> None:
    grants = grants_of(build("base"))
    assert grants.host_namespaces == frozenset()
    hosts = {host for host, _, _ in grants.host_paths}
    assert "/" not in hosts
    assert not {h for h in hosts if "containerd" in h or "crio" in h or h.endswith(".sock")}
    assert (grants.privileged, grants.escalation) == (False, False)
    # A token, for the node condition and events only: no read of secrets, pods or anything
    # else; writes to the Node's status and events, pinned to the own node by admission policy.
    assert grants.token
    assert {resource for _, resource, _ in grants.rbac} == {"nodes", "nodes/status", "events"}
    assert {(r, verb) for _, r, verb in grants.rbac if r.startswith("nodes")} == {
        ("nodes", "get"), ("nodes/status", "patch"),
    }  # fmt: skip


@pytest.mark.parametrize(
    ("change", "seen"),
    [
        (lambda pod, ctr: pod.update(hostNetwork=True), "host_namespaces"),
        (lambda pod, ctr: pod.update(hostIPC=True), "host_namespaces"),
        (lambda pod, ctr: ctr["securityContext"]["capabilities"].update(add=["NET_ADMIN"]),
         "capabilities"),
        (lambda pod, ctr: ctr["securityContext"].update(privileged=True), "privileged"),
        (lambda pod, ctr: ctr["securityContext"].update(allowPrivilegeEscalation=True),
         "escalation"),
        (lambda pod, ctr: ctr["volumeMounts"][-1].update(readOnly=True), "host_paths"),
        (lambda pod, ctr: pod["volumes"].append(
            {"name": "x", "hostPath": {"path": "/run/containerd"}}), "host_paths"),
        (lambda pod, ctr: ctr["ports"][0].update(hostPort=9400), "host_ports"),
        (lambda pod, ctr: ctr["securityContext"].update(runAsUser=1000), "run_as_users"),
        (lambda pod, ctr: pod.update(automountServiceAccountToken=False), "token"),
        (lambda pod, ctr: pod["volumes"].append({"name": "t", "projected": {"sources": []}}),
         "volume_kinds"),
    ],
)  # fmt: skip
def test_the_grants_table_sees_a_changed_grant(change: Any, seen: str) -> None:
    docs = build("base")
    _, pod, _ = daemonset(docs)
    (ctr,) = pod["containers"]
    change(pod, ctr)
    found, expected = grants_of(docs), expected_grants("base")
    assert getattr(found, seen) != getattr(expected, seen)


def test_the_grants_table_sees_a_changed_rbac_rule() -> None:
    docs = build("dra")
    (role,) = [
        d for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"] == "gpuagent-dra"
    ]
    role["rules"][0]["verbs"].append("list")
    assert grants_of(docs).rbac - expected_grants("dra").rbac == {
        ("resource.k8s.io", "resourceclaims", "list")
    }


# ----- the DRA overlay ----------------------------------------------------------------------------


def test_dra_overlay_grants_only_what_the_dra_side_uses_to_its_own_service_account(
    tmp_path: Path,
) -> None:
    docs = build("dra")
    settings = effective_settings(docs, tmp_path)
    assert settings.dra_gpus == "all"
    _, pod, _ = daemonset(docs)
    account = pod["serviceAccountName"]
    namespace = only(docs, "DaemonSet")["metadata"]["namespace"]
    env = manifest_env(container(docs))
    assert env["NODE_NAME"] == "test-node", "the pool is the node: NODE_NAME from spec.nodeName"
    # RBAC: exactly the rules of the grants table (test_each_build_grants_exactly_its_table_row),
    # through a binding of this service account only.
    (role,) = [
        d for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"] == "gpuagent-dra"
    ]
    (binding,) = [
        d
        for d in docs
        if d["kind"] == "ClusterRoleBinding" and d["roleRef"]["name"] == "gpuagent-dra"
    ]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account, "namespace": namespace}
    ]
    # The admission policy binds this service account's slice writes to its own node.
    (policy,) = [d for d in docs if d["metadata"]["name"] == "gpuagent-dra-resourceslices"
                 and d["kind"] == "ValidatingAdmissionPolicy"]  # fmt: skip
    (condition,) = policy["spec"]["matchConditions"]
    assert f"system:serviceaccount:{namespace}:{account}" in condition["expression"]
    assert "authentication.kubernetes.io/node-name" in str(policy["spec"]["variables"])
    bindings = [d for d in docs if d["kind"] == "ValidatingAdmissionPolicyBinding"]
    assert policy["metadata"]["name"] in {b["spec"]["policyName"] for b in bindings}
    # NVIDIA's DeviceClasses, for the driver name the agent publishes under.
    classes = {d["metadata"]["name"]: d for d in docs if d["kind"] == "DeviceClass"}
    assert set(classes) == {"gpu.nvidia.com", "mig.nvidia.com"}
    for device_class in classes.values():
        (selector,) = device_class["spec"]["selectors"]
        assert f"device.driver == '{settings.dra_driver_name}'" in selector["cel"]["expression"]


# ----- the node condition and events --------------------------------------------------------------


def _policies(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    bound = {
        d["spec"]["policyName"] for d in docs if d["kind"] == "ValidatingAdmissionPolicyBinding"
    }
    policies = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ValidatingAdmissionPolicy"}
    assert set(policies) <= bound, "every policy is bound"
    return policies


@pytest.mark.parametrize("name", ["base", "base+taint-unhealthy-node"])
def test_every_write_the_token_allows_is_pinned_to_the_agents_own_node(name: str) -> None:
    """Each rule that writes (nodes/status, events, nodes with the taint component) has an
    admission policy for this service account that compares the token's node name with what the
    request changes, and denies with 403 (the agent says so once and goes on)."""
    docs = build(name)
    pod = only(docs, "DaemonSet")["spec"]["template"]["spec"]
    user = f"system:serviceaccount:kube-system:{pod['serviceAccountName']}"
    covered: set[tuple[str, str]] = set()
    for policy in _policies(docs).values():
        spec = policy["spec"]
        (condition,) = spec["matchConditions"]
        assert user in condition["expression"]
        assert "authentication.kubernetes.io/node-name" in str(spec["variables"])
        assert spec["failurePolicy"] == "Fail"
        assert all(v.get("reason") == "Forbidden" for v in spec["validations"])
        for rule in spec["matchConstraints"]["resourceRules"]:
            covered |= {(g, r) for g in rule["apiGroups"] for r in rule["resources"]}
    writes = {(g, r) for g, r, verb in grants_of(docs).rbac if verb in ("create", "patch")}
    dra = {("resource.k8s.io", "resourceslices")}
    assert writes - dra <= covered, writes - covered


def test_the_status_policy_lets_only_the_gpuhealthy_condition_change() -> None:
    policy = _policies(build("base"))["gpuagent-node-status"]
    text = json.dumps(policy["spec"])
    assert "c.type != 'GPUHealthy'" in text
    for pinned in ("capacity", "allocatable", "addresses", "labels", "annotations"):
        assert pinned in text, pinned
    (rule,) = policy["spec"]["matchConstraints"]["resourceRules"]
    assert rule["resources"] == ["nodes/status"]


def test_the_taint_component_switches_the_taint_on_and_pins_it(tmp_path: Path) -> None:
    docs = build("base+taint-unhealthy-node")
    assert effective_settings(docs, tmp_path).taint_unhealthy_node is True
    assert effective_settings(build("base"), tmp_path).taint_unhealthy_node is False
    text = json.dumps(_policies(docs)["gpuagent-node-taint"]["spec"])
    assert "nvidia.com/gpu-unhealthy" in text
    assert "NoSchedule" in text


@pytest.mark.parametrize("overlay", sorted(set(KUSTOMIZATIONS) - {"dra"}))
def test_the_dynamic_mig_component_does_not_build_without_the_dra_overlay(overlay: str) -> None:
    """MIG made on demand serves DRA's claims: on an overlay without DRA it would add
    CAP_SYS_ADMIN for nothing (and the agent refuses --dra-mig dynamic without a DRA GPU)."""
    result = kustomize(f"{overlay}+dra-mig-dynamic")
    assert result.returncode != 0
    assert "DeviceClass.v1.resource.k8s.io/mig.nvidia.com" in result.stderr


@pytest.mark.parametrize("overlay", sorted(set(KUSTOMIZATIONS) - {"dra"}))
def test_the_dra_shares_component_does_not_build_without_the_dra_overlay(overlay: str) -> None:
    """DRA shares are GPUs served through DRA: on an overlay without DRA the component would grant
    what MPS needs for nothing (and the agent refuses --dra-sharing mps without a DRA GPU)."""
    result = kustomize(f"{overlay}+dra-shares")
    assert result.returncode != 0
    assert "DeviceClass.v1.resource.k8s.io/gpu.nvidia.com" in result.stderr


def test_the_dra_shares_component_switches_sharing_on_with_what_mps_needs() -> None:
    ctr = container(build("dra+dra-shares"))
    env = {e["name"]: e.get("value") for e in ctr["env"]}
    assert env["GPUAGENT_DRA_SHARING"] == "mps"
    assert env["NVIDIA_DRIVER_CAPABILITIES"] == "compute,utility"
    assert {m["name"]: m["mountPath"] for m in ctr["volumeMounts"]}["mps-shm"] == "/dev/shm"
    assert "GPUAGENT_DRA_SHARING" not in {e["name"] for e in container(build("dra"))["env"]}


def test_the_dynamic_mig_component_switches_it_on_with_the_runtimes_mig_capabilities() -> None:
    env = {e["name"]: e.get("value") for e in container(build("dra+dra-mig-dynamic"))["env"]}
    assert env["GPUAGENT_DRA_MIG"] == "dynamic"
    assert env["NVIDIA_MIG_CONFIG_DEVICES"] == env["NVIDIA_MIG_MONITOR_DEVICES"] == "all"
    assert "GPUAGENT_DRA_MIG" not in {e["name"] for e in container(build("dra"))["env"]}
