"""Nothing is advertised before it can be used: with a CDI strategy the kubelet hears of a device
only once the CDI spec on disk defines it.

The kubelet is the grpcio stand-in; it looks at the spec file the moment ``Register`` arrives and
the moment each ``ListAndWatch`` message does (on its own threads, before it records either), so
the order is seen as the kubelet would live it: at the start, for a GPU described late (its
identity unreadable at first, as after a driver hiccup), and for a reload that turns a CDI
strategy on (where ``Allocate`` starts answering with CDI names).
"""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from typing import Any

import pynvml
from support.fake_kubelet import FakeKubelet
from support.grpcstubs import StubModules

from e2e.agentrun import running_agent
from gpuagent.domain.containers import CDI_KIND
from gpuagent.gpu.sim import SimDriver, node_from_count
from gpuagent.nodefiles.cdi import SPEC_FILE_NAME

T = 10.0


class SpecWitness:
    """What the spec file defined at each moment the kubelet heard something."""

    def __init__(self, spec_file: Path) -> None:
        self.spec_file = spec_file
        self._lock = threading.Lock()
        self.seen: list[tuple[str, frozenset[str] | None, tuple[str, ...]]] = []

    def __call__(self, what: str, message: Any) -> None:
        ids = tuple(d.ID for d in message.devices) if what == "update" else ()
        with self._lock:
            self.seen.append((what, self.names(), ids))

    def names(self) -> frozenset[str] | None:
        """The device names the spec on disk defines, or None while there is no spec."""
        try:
            spec = json.loads(self.spec_file.read_text())
        except FileNotFoundError:
            return None
        return frozenset(d["name"] for d in spec["devices"])

    def offered_before_defined(
        self, since: int = 0
    ) -> list[tuple[str, frozenset[str] | None, tuple[str, ...]]]:
        """Every moment (from the ``since``-th on) the kubelet heard of the plugin, or of a
        device, that the spec lacked."""
        with self._lock:
            return [
                (what, names, ids)
                for what, names, ids in self.seen[since:]
                if names is None or not set(ids) <= names
            ]


def cdi_args(cdi_dir: Path, *more: str) -> tuple[str, ...]:
    return ("--device-list-strategy", "cdi-cri", "--cdi-spec-dir", str(cdi_dir), *more)


async def test_the_spec_is_on_disk_before_the_plugin_registers(
    device_plugin_dir: Path, short_tmp_path: Path, grpc_stubs: StubModules
) -> None:
    cdi_dir = short_tmp_path / "cdi"
    witness = SpecWitness(cdi_dir / SPEC_FILE_NAME)
    with FakeKubelet(device_plugin_dir, grpc_stubs, observe=witness) as kubelet:
        async with running_agent(device_plugin_dir, ("--simulate", "2", *cdi_args(cdi_dir))):
            (reg,) = await asyncio.to_thread(kubelet.wait_for_registrations, 1, T)
            first = await asyncio.to_thread(reg.next_update, T)
            assert len(first.devices) == 2
            assert witness.seen[0][0] == "register"
            assert witness.offered_before_defined() == []


async def test_a_gpu_described_late_reaches_the_kubelet_after_its_spec(
    device_plugin_dir: Path, short_tmp_path: Path, grpc_stubs: StubModules
) -> None:
    cdi_dir = short_tmp_path / "cdi"
    witness = SpecWitness(cdi_dir / SPEC_FILE_NAME)
    sim = SimDriver(node_from_count(2))
    sim.fail("nvmlDeviceGetUUID", pynvml.NVML_ERROR_UNKNOWN, gpu=1)  # GPU 1 cannot be named
    with FakeKubelet(device_plugin_dir, grpc_stubs, observe=witness) as kubelet:
        async with running_agent(device_plugin_dir, cdi_args(cdi_dir), simulator=sim):
            (reg,) = await asyncio.to_thread(kubelet.wait_for_registrations, 1, T)
            assert len((await asyncio.to_thread(reg.next_update, T)).devices) == 1
            assert witness.offered_before_defined() == []
            before = len(witness.seen)
            sim.clear_failures()  # named at the next poll: a device to add
            await asyncio.to_thread(reg.wait_until, lambda u: len(u.devices) == 2, T)
            assert len(witness.seen) > before
            assert witness.offered_before_defined(since=before) == []


async def test_a_reload_to_a_cdi_strategy_writes_the_spec_before_allocate_names_it(
    device_plugin_dir: Path, short_tmp_path: Path, grpc_stubs: StubModules
) -> None:
    cdi_dir = short_tmp_path / "cdi"
    config = short_tmp_path / "gpuagent.yaml"
    config.write_text("version: v1\n")
    spec_file = cdi_dir / SPEC_FILE_NAME
    args = ("--simulate", "2", "--config", str(config), "--cdi-spec-dir", str(cdi_dir))
    with FakeKubelet(device_plugin_dir, grpc_stubs) as kubelet:
        async with running_agent(device_plugin_dir, args, config_check_interval=3600) as run:
            (reg,) = await asyncio.to_thread(kubelet.wait_for_registrations, 1, T)
            ids = [d.ID for d in (await asyncio.to_thread(reg.next_update, T)).devices]
            assert not spec_file.exists()  # envvar: no spec

            config.write_text("version: v1\ndevice-list-strategy: cdi-cri\n")
            assert await run.agent.reload() == []
            response = await asyncio.to_thread(kubelet.allocate, [ids[0]])
            (container,) = response.container_responses
            (name,) = [d.name for d in container.cdi_devices]
            assert name == f"{CDI_KIND}={ids[0]}"
            defined = SpecWitness(spec_file).names()  # as the runtime would resolve it now
            assert defined is not None
            assert ids[0] in defined


async def test_a_spec_that_cannot_be_written_offers_nothing_and_says_why(
    device_plugin_dir: Path, short_tmp_path: Path, grpc_stubs: StubModules
) -> None:
    """The kubelet still gets the plugin (capacity 0, not a stale count) and /readyz the cause."""
    blocked = short_tmp_path / "cdi"
    blocked.write_text("a file where the spec directory should be\n")
    with FakeKubelet(device_plugin_dir, grpc_stubs) as kubelet:
        async with running_agent(device_plugin_dir, ("--simulate", "2", *cdi_args(blocked))) as run:
            (reg,) = await asyncio.to_thread(kubelet.wait_for_registrations, 1, T)
            assert len((await asyncio.to_thread(reg.next_update, T)).devices) == 0
            status, body = await run.get("/readyz")
            assert status == 503
            assert body.startswith("CDI spec not written (devices it lacks are not offered): ")
