"""The agent's few calls to the API server, through lightkube (the only module importing it).

Objects go in and out as the API's JSON (``dict``), so the domain builds and reads them without
depending on a client library. Every failure is one of two errors: :class:`ApiUnreachable` (no
answer: connection refused, timeout, TLS) or :class:`ApiError` (an HTTP status from the server).

Why lightkube (compared on this machine, Python 3.11, beside the agent's own imports):

============================  ==========  ==========  =============================================
client                        installed   import RSS  typing / maintenance
============================  ==========  ==========  =============================================
lightkube 1.0.1               4.2 MB      +6.1 MiB    typed models and generic client methods,
(+ httpx2, anyio, msgspec)                            py.typed; release 2026-08; token file re-read
kubernetes-asyncio 36.1.0     48.7 MB     +37.2 MiB   generated OpenAPI client; release 2026-06
kr8s 0.20.15                  (+43 MB     +17.0 MiB   dynamic Box objects; pulls cryptography and
                              of deps)                python-box; release 2026-01
============================  ==========  ==========  =============================================
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
from lightkube import ApiError as _LightkubeApiError
from lightkube import AsyncClient, ConfigError, KubeConfig
from lightkube.core.client import FieldSelector
from lightkube.resources import core_v1, events_v1
from lightkube.resources.core_v1 import Node, NodeStatus
from lightkube.resources.resource_v1 import ResourceClaim, ResourceSlice
from lightkube.types import PatchType

from gpuagent.overrides import lightkube_http

__all__ = ["ApiError", "ApiUnreachable", "KubeApi", "KubeConfigError"]

FIELD_MANAGER = "gpuagent"


class ApiUnreachable(Exception):
    """The API server did not answer (connection refused, timeout, TLS failure)."""


class ApiError(Exception):
    """The API server answered with an error status (``code``: 403, 404, 409, 422, …);
    ``retry_after``: the seconds its ``Retry-After`` header asked for (429, 503), if any."""

    def __init__(self, code: int, message: str, retry_after: float | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.retry_after = retry_after


class KubeConfigError(Exception):
    """No usable configuration: the kubeconfig file is missing or invalid, or the agent does not
    run in a pod with a service-account token."""


def load_config(kubeconfig: Path | None) -> KubeConfig:
    """``kubeconfig`` (its current context) or the pod's in-cluster service account."""
    try:
        if kubeconfig is not None:
            return KubeConfig.from_file(kubeconfig)
        return KubeConfig.from_service_account()
    except (ConfigError, KeyError, OSError, ValueError, TypeError) as exc:
        where = str(kubeconfig) if kubeconfig is not None else "in-cluster service account"
        raise KubeConfigError(f"{where}: {exc}") from None


class KubeApi:
    """An API server connection for one node: its DRA driver, its health (condition, events,
    taint)."""

    def __init__(self, config: KubeConfig, *, timeout: float = 10.0) -> None:
        self._client = AsyncClient(
            config=config,
            timeout=httpx2.Timeout(timeout),
            field_manager=FIELD_MANAGER,
            trust_env=False,
        )

    async def close(self) -> None:
        await self._client.close()

    async def node_uid(self, node: str) -> str:
        node_obj = await self._call(self._client.get(Node, node))
        uid = node_obj.metadata.uid if node_obj.metadata is not None else None
        if not uid:
            raise ApiError(500, f"node {node} has no UID")
        return str(uid)

    async def claim(self, namespace: str, name: str) -> dict[str, Any]:
        obj = await self._call(self._client.get(ResourceClaim, name, namespace=namespace))
        return dict(obj.to_dict())

    async def slices(self, node: str, driver: str) -> list[dict[str, Any]]:
        """This node's slices of ``driver`` (field selectors the API server indexes)."""
        fields: FieldSelector = {"spec.nodeName": node, "spec.driver": driver}
        with _translated():
            return [
                dict(obj.to_dict()) async for obj in self._client.list(ResourceSlice, fields=fields)
            ]

    async def create_slice(self, manifest: dict[str, Any]) -> str:
        """Create a slice; its ``resourceVersion`` as stored (for the next replace)."""
        return _version(await self._call(self._client.create(ResourceSlice.from_dict(manifest))))

    async def replace_slice(self, manifest: dict[str, Any]) -> str:
        """Replace a slice (409 if ``metadata.resourceVersion`` is not the stored one); its new
        ``resourceVersion``."""
        return _version(await self._call(self._client.replace(ResourceSlice.from_dict(manifest))))

    async def delete_slice(self, name: str) -> None:
        await self._call(self._client.delete(ResourceSlice, name))

    # ----- the node's health (gpuagent/kube/nodehealth/) ----------------------------------------
    async def node(self, name: str) -> dict[str, Any]:
        obj = await self._call(self._client.get(Node, name))
        return dict(obj.to_dict())

    async def patch_node_status(self, name: str, patch: dict[str, Any]) -> None:
        """A strategic-merge patch of ``nodes/<name>/status``."""
        await self._call(
            self._client.patch(NodeStatus, name, patch, patch_type=PatchType.STRATEGIC)
        )

    async def patch_node(self, name: str, patch: dict[str, Any]) -> None:
        """A JSON merge patch of the Node (with ``metadata.resourceVersion`` in it, a conflict
        is refused with 409)."""
        await self._call(self._client.patch(Node, name, patch, patch_type=PatchType.MERGE))

    async def serves(self, group_version: str) -> bool:
        """Whether the server offers ``group_version`` (``events.k8s.io/v1``), by discovery.

        lightkube has no discovery call: the GET goes through its HTTP client (the same
        connection, credentials and TLS; :func:`gpuagent.overrides.lightkube_http`). Discovery is
        open to every authenticated client.
        """
        http = lightkube_http(self._client)
        try:
            response = await http.get(f"/apis/{group_version}")
        except httpx2.TransportError as exc:
            raise ApiUnreachable(f"{type(exc).__name__}: {exc}") from None
        if response.status_code == 404:
            return False
        if response.status_code >= 400:
            raise ApiError(response.status_code, response.reason_phrase, _retry_after(response))
        return True

    async def create_event(self, manifest: dict[str, Any]) -> None:
        """Create an event, ``events.k8s.io/v1`` or core ``v1`` as ``manifest`` says."""
        if manifest["apiVersion"] == "v1":
            await self._call(self._client.create(core_v1.Event.from_dict(manifest)))
        else:
            await self._call(self._client.create(events_v1.Event.from_dict(manifest)))

    async def patch_event(
        self, api_version: str, namespace: str, name: str, patch: dict[str, Any]
    ) -> None:
        """A JSON merge patch of an event (its series)."""
        kind = events_v1.Event if api_version != "v1" else core_v1.Event
        await self._call(
            self._client.patch(kind, name, patch, namespace=namespace, patch_type=PatchType.MERGE)
        )

    @staticmethod
    async def _call(call: Any) -> Any:
        with _translated():
            return await call


@contextlib.contextmanager
def _translated() -> Iterator[None]:
    """The client's errors as this module's: the API server's Status, an error body that is not
    one (a proxy's), or no answer at all."""
    try:
        yield
    except _LightkubeApiError as exc:
        raise _api_error(exc) from None
    except httpx2.HTTPStatusError as exc:  # an error body that is not a Status (a proxy)
        raise _status_error(exc.response) from None
    except httpx2.TransportError as exc:
        raise ApiUnreachable(f"{type(exc).__name__}: {exc}") from None


def _version(obj: Any) -> str:
    meta = getattr(obj, "metadata", None)
    return str(getattr(meta, "resourceVersion", None) or "")


def _api_error(exc: _LightkubeApiError) -> ApiError:
    status = exc.status
    code = int(status.code) if status.code else exc.response.status_code
    return ApiError(code, (status.message or str(exc))[:512], _retry_after(exc.response))


def _status_error(response: httpx2.Response) -> ApiError:
    return ApiError(response.status_code, response.reason_phrase, _retry_after(response))


def _retry_after(response: httpx2.Response | None) -> float | None:
    """``Retry-After`` in seconds (the API server sends seconds; an HTTP date is not used)."""
    if response is None:
        return None
    value = response.headers.get("Retry-After", "").strip()
    try:
        seconds = float(value)
    except ValueError:
        return None
    return seconds if 0 <= seconds < 86_400 else None
