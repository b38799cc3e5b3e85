"""Whether the agent has API-server credentials at all, told without importing the client (the
node condition and events are on by default exactly where it has)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

__all__ = ["SERVICE_ACCOUNT", "missing"]

#: Where a pod's service-account token is mounted.
SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")


def missing(
    kubeconfig: Path | None,
    *,
    environ: Mapping[str, str] = os.environ,
    account: Path = SERVICE_ACCOUNT,
    named: str = "--kubeconfig",
) -> str | None:
    """Why the agent has no credentials (``--kubeconfig``, given as ``named``, else the pod's
    service account), or ``None`` when it has some (whether they are valid is found when they
    are loaded)."""
    if kubeconfig is not None:
        return None if kubeconfig.is_file() else f"{named} {kubeconfig}: no such file"
    if not environ.get("KUBERNETES_SERVICE_HOST"):
        return "not in a pod (KUBERNETES_SERVICE_HOST unset) and no --kubeconfig"
    if not (account / "token").is_file():
        return f"no service-account token in {account} (automountServiceAccountToken: false?)"
    return None
