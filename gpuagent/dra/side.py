"""The DRA side of the agent, assembled: devices from the store, claims from the API server,
the kubelet plugin's sockets, and the ResourceSlice publisher — two named tasks for the agent to
supervise. What each part knows (the plugin's registration, the slices published, the counts) it
puts in the store, where /readyz and /metrics read it. Nothing here talks to the kubelet's
device-plugin side, so an unreachable API server never touches it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Mapping
from pathlib import Path
from typing import Any

import structlog

from gpuagent.domain.claims import ClaimUnavailable
from gpuagent.domain.dra import DraDevice
from gpuagent.domain.drasharing import served_devices
from gpuagent.domain.snapshot import Snapshot
from gpuagent.dra.claims import ClaimFiles
from gpuagent.dra.dynamic import DynamicMig, MigDriver
from gpuagent.dra.endpoint import DraEndpoint, EndpointTiming
from gpuagent.dra.health import DeviceHealthStreams, HealthV1, HealthV1Alpha1
from gpuagent.dra.service import (
    SUPPORTED_SERVICES,
    ClaimPreparer,
    DraConfig,
    DraPluginV1,
    DraPluginV1Beta1,
    NodeSpecSource,
)
from gpuagent.dra.stats import DraStats
from gpuagent.kube.client import ApiError, ApiUnreachable, KubeApi, KubeConfigError, load_config
from gpuagent.kube.slices import Backoff, Coalescing, SlicePublisher
from gpuagent.overrides.grpc import IServable
from gpuagent.state.clock import Clock
from gpuagent.state.store import DeviceStore, per_snapshot

__all__ = ["DraSide", "KubeConfigError"]

log = structlog.get_logger("gpuagent.dra")


class DraSide:
    """Everything DRA, for one node, under the store's plan (``plan.dra``): a reload changes
    which devices are offered, never the driver name (a restart does)."""

    def __init__(
        self,
        store: DeviceStore,
        *,
        node: str,
        plugins_dir: Path,
        registry_dir: Path,
        cdi_dir: Path,
        kubeconfig: Path | None,
        stopping: asyncio.Event,
        node_spec: NodeSpecSource,
        endpoint_timing: EndpointTiming = EndpointTiming(),
        backoff: Backoff = Backoff(),
        coalescing: Coalescing = Coalescing(),
        api_timeout: float = 10.0,
        health_resend_s: float = 20.0,
        proc_root: Path = Path("/proc"),  # where the kernel's boot ID is read
        clock: Clock | None = None,
    ) -> None:
        self._store = store
        # Once per snapshot, shared by the publisher, the health streams and the preparer (a new
        # plan is a new snapshot: they re-derive the devices by themselves).
        self._devices = per_snapshot(_devices)
        plan = store.plan.dra
        self.node = node
        # Raises KubeConfigError: no kubeconfig, or not in a pod (checked once, at start).
        self.api = KubeApi(load_config(kubeconfig), timeout=api_timeout)
        config = DraConfig(driver=plan.driver, pool=node)
        self.stats = DraStats()
        self.preparer = ClaimPreparer(
            store,
            self._devices,
            self._read_claim,
            ClaimFiles(plugins_dir / plan.driver, cdi_dir, plan.driver, proc_root),
            config,
            node_spec=node_spec,
            stats=self.stats,
        )
        streams = DeviceHealthStreams(
            store, self._devices, config, stopping, resend_s=health_resend_s
        )
        self.endpoint = DraEndpoint(
            _services(self.preparer, streams),
            driver=plan.driver,
            supported=SUPPORTED_SERVICES,
            plugins_dir=plugins_dir,
            registry_dir=registry_dir,
            timing=endpoint_timing,
            on_state=store.set_dra_registration,
        )
        self.publisher = SlicePublisher(
            store, self._devices, self.api, node=node, driver=plan.driver,
            backoff=backoff, coalescing=coalescing, clock=clock,
        )  # fmt: skip

    async def _read_claim(self, namespace: str, name: str) -> Mapping[str, Any]:
        try:
            return await self.api.claim(namespace, name)
        except (ApiUnreachable, ApiError) as exc:
            raise ClaimUnavailable(str(exc)) from None

    def tasks(self) -> Mapping[str, Callable[[], Coroutine[Any, Any, None]]]:
        """The long-lived tasks, by name, for the agent to spawn and supervise."""
        return {"dra-plugin": self._serve, "dra-slices": self.publisher.run}

    def manage_mig(self, driver: MigDriver) -> None:
        """MIG devices are made on prepare through ``driver`` (``--dra-mig dynamic``; set before
        the tasks start)."""
        self.preparer.mig = DynamicMig(driver, self._store)

    async def _serve(self) -> None:
        await self.preparer.load()
        async with asyncio.TaskGroup() as tasks:
            # The sweep waits for the GPUs to be described, then holds the claims while the
            # orphans are destroyed, so no prepare races it; the kubelet is served meanwhile.
            tasks.create_task(self.preparer.sweep())
            tasks.create_task(self.endpoint.run())

    async def close(self) -> None:
        await self.api.close()
        if self.preparer.mig is not None:
            self.preparer.mig.close()


def _services(preparer: ClaimPreparer, streams: DeviceHealthStreams) -> list[IServable]:
    """The kubelet plugin's services: DRAPlugin v1 and v1beta1, DRAResourceHealth v1 and
    v1alpha1."""
    v1 = DraPluginV1(preparer)
    return [v1, DraPluginV1Beta1(v1), HealthV1(streams), HealthV1Alpha1(streams)]


def _devices(snapshot: Snapshot) -> tuple[DraDevice, ...]:
    """The node's DRA devices as served (whole GPUs shared under ``--dra-sharing mps``)."""
    return served_devices(snapshot, snapshot.plan.dra)
