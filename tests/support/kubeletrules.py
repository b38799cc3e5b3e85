"""What the kubelet's device manager accepts in a ``Register``, and how its Go code words a
refusal: the API versions it serves, the resource-name check (``v1helper.IsExtendedResourceName``
over ``k8s.io/apimachinery``'s qualified names), Go's ``%q`` and gRPC status text.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["SUPPORTED_VERSIONS", "go_status_text", "is_extended_resource_name", "refusal"]

SUPPORTED_VERSIONS = ("v1beta1",)

# k8s.io/apimachinery/pkg/util/validation
_DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_DNS1123_SUBDOMAIN_MAX = 253
_QUALIFIED_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
_QUALIFIED_NAME_MAX = 63

# google.golang.org/grpc/codes: Code.String()
_GO_CODE_NAMES = {
    "OK": "OK",
    "CANCELLED": "Canceled",
    "UNKNOWN": "Unknown",
    "INVALID_ARGUMENT": "InvalidArgument",
    "DEADLINE_EXCEEDED": "DeadlineExceeded",
    "NOT_FOUND": "NotFound",
    "ALREADY_EXISTS": "AlreadyExists",
    "PERMISSION_DENIED": "PermissionDenied",
    "RESOURCE_EXHAUSTED": "ResourceExhausted",
    "FAILED_PRECONDITION": "FailedPrecondition",
    "ABORTED": "Aborted",
    "OUT_OF_RANGE": "OutOfRange",
    "UNIMPLEMENTED": "Unimplemented",
    "INTERNAL": "Internal",
    "UNAVAILABLE": "Unavailable",
    "DATA_LOSS": "DataLoss",
    "UNAUTHENTICATED": "Unauthenticated",
}


def go_status_text(code: Any, details: str) -> str:
    """How Go formats a gRPC status error: ``rpc error: code = Unavailable desc = ...``."""
    name = _GO_CODE_NAMES.get(code.name, code.name)
    return f"rpc error: code = {name} desc = {details}"


def _go_quote(value: str) -> str:
    """Go's ``%q`` for the strings that occur here (printable text)."""
    escaped = value.replace("\\", "\\\\").replace('"', '\\"')
    escaped = "".join(ch if ch.isprintable() else f"\\x{ord(ch):02x}" for ch in escaped)
    return f'"{escaped}"'


def _is_qualified_name(value: str) -> bool:
    parts = value.split("/")
    if len(parts) == 1:
        name = parts[0]
    elif len(parts) == 2:
        prefix, name = parts
        if (
            not prefix
            or len(prefix) > _DNS1123_SUBDOMAIN_MAX
            or not _DNS1123_SUBDOMAIN.fullmatch(prefix)
        ):
            return False
    else:
        return False
    return 0 < len(name) <= _QUALIFIED_NAME_MAX and bool(_QUALIFIED_NAME.fullmatch(name))


def is_extended_resource_name(name: str) -> bool:
    """``v1helper.IsExtendedResourceName``: the kubelet's check of a resource name.

    Not native (contains ``/`` and no ``kubernetes.io/``), no ``requests.`` prefix, and
    ``"requests." + name`` is a qualified name.
    """
    if "/" not in name or "kubernetes.io/" in name:
        return False
    if name.startswith("requests."):
        return False
    return _is_qualified_name("requests." + name)


def refusal(version: str, resource_name: str) -> str | None:
    """Why the kubelet refuses a ``Register`` of ``version`` for ``resource_name`` (its words),
    or None when it accepts it."""
    if version not in SUPPORTED_VERSIONS:
        supported = "[" + " ".join(_go_quote(v) for v in SUPPORTED_VERSIONS) + "]"
        return (
            f"requested API version {_go_quote(version)} is not supported by "
            f"kubelet. Supported version is {supported}"
        )
    if not is_extended_resource_name(resource_name):
        return f"the ResourceName {_go_quote(resource_name)} is invalid"
    return None
