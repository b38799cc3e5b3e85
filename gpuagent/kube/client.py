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

from pathlib import Path
from typing import Any

import httpx2
from lightkube import ApiError as _LightkubeApiError
from lightkube import AsyncClient, ConfigError, KubeConfig
from lightkube.core.client import FieldSelector
from lightkube.resources.core_v1 import Node
from lightkube.resources.resource_v1 import ResourceClaim, ResourceSlice

__all__ = ["ApiError", "ApiUnreachable", "KubeApi", "KubeConfigError"]

FIELD_MANAGER = "gpuagent"


class ApiUnreachable(Exception):
    """The API server did not answer (connection refused, timeout, TLS failure)."""


class ApiError(Exception):
    """The API server answered with an error status (``code``: 403, 404, 409, 422, …)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


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
    """An API server connection for one node's DRA driver."""

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
        out: list[dict[str, Any]] = []
        try:
            async for obj in self._client.list(ResourceSlice, fields=fields):
                out.append(dict(obj.to_dict()))
        except _LightkubeApiError as exc:
            raise _api_error(exc) from None
        except httpx2.HTTPStatusError as exc:  # an error body that is not a Status (a proxy)
            raise ApiError(exc.response.status_code, exc.response.reason_phrase) from None
        except httpx2.TransportError as exc:
            raise ApiUnreachable(f"{type(exc).__name__}: {exc}") from None
        return out

    async def create_slice(self, manifest: dict[str, Any]) -> None:
        await self._call(self._client.create(ResourceSlice.from_dict(manifest)))

    async def replace_slice(self, manifest: dict[str, Any]) -> None:
        await self._call(self._client.replace(ResourceSlice.from_dict(manifest)))

    async def delete_slice(self, name: str) -> None:
        await self._call(self._client.delete(ResourceSlice, name))

    @staticmethod
    async def _call(call: Any) -> Any:
        try:
            return await call
        except _LightkubeApiError as exc:
            raise _api_error(exc) from None
        except httpx2.HTTPStatusError as exc:  # an error body that is not a Status (a proxy)
            raise ApiError(exc.response.status_code, exc.response.reason_phrase) from None
        except httpx2.TransportError as exc:
            raise ApiUnreachable(f"{type(exc).__name__}: {exc}") from None


def _api_error(exc: _LightkubeApiError) -> ApiError:
    status = exc.status
    code = int(status.code) if status.code else exc.response.status_code
    return ApiError(code, (status.message or str(exc))[:512])
