"""Fixtures shared by the whole test suite."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from pathlib import Path

import pytest
import uvloop
from hypothesis import HealthCheck, settings
from support import grpcstubs
from support.clock import FakeClock
from support.fake_apiserver import FakeApiServer
from support.fake_kubelet import FakeKubelet
from support.fake_podresources import FakePodResources
from support.grpcstubs import CriStubs, DraStubs, StubModules

# Hypothesis times each example (a 200 ms deadline) and its data generation (the too_slow health
# check): timed assertions, which a loaded CI machine can fail by chance. A test that is slow or
# hangs is caught by pytest-timeout; speed is measured by the bench scripts.
settings.register_profile(
    "gpuagent", deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True
)
settings.load_profile("gpuagent")


def pytest_configure(config: pytest.Config) -> None:
    """Agents the suite starts (in process or as subprocesses) see no ``GPUAGENT_*`` variables.

    The agent refuses unknown ones, and a developer's shell must not change what a test sees;
    tests that need one pass it explicitly.
    """
    for name in [n for n in os.environ if n.startswith("GPUAGENT_")]:
        del os.environ[name]


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    """Run every async test (and its async fixtures) once on each event loop.

    pytest-asyncio 1.5 parametrizes each async test over the returned factories; the test ids
    get an ``[asyncio]`` / ``[uvloop]`` suffix. A test can pick a subset with
    ``@pytest.mark.asyncio(loop_factories=["uvloop"])``.
    """
    return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every async test checks, first set up and last torn down, that it left no task behind."""
    for item in items:
        if item.get_closest_marker("asyncio") is not None and isinstance(item, pytest.Function):
            item.fixturenames.insert(0, "no_task_left_behind")


@pytest.fixture
async def no_task_left_behind() -> AsyncIterator[None]:
    """Fail a test that leaves a task pending on its loop (as kopf's suite does): a task nobody
    awaits is a leak, or an error nobody sees. Each such task is cancelled before failing."""
    before = asyncio.all_tasks()
    yield
    for _ in range(3):  # tasks cancelled at the very end get their turn to finish
        await asyncio.sleep(0)
    me = asyncio.current_task()
    left = [t for t in asyncio.all_tasks() - before if t is not me and not t.done()]
    for task in left:
        task.cancel()
    await asyncio.gather(*left, return_exceptions=True)
    if left:
        names = ", ".join(sorted(f"{t.get_name()} ({t.get_coro()!r})" for t in left))
        pytest.fail(f"the test left {len(left)} task(s) pending: {names}", pytrace=False)


@pytest.fixture(scope="session")
def grpc_stubs() -> StubModules:
    """grpcio stubs for the kubelet's device-plugin and pod-resources protos."""
    return grpcstubs.kubelet_stubs()


@pytest.fixture(scope="session")
def cri_stubs() -> CriStubs:
    """grpcio stubs for the CRI proto (the container runtime stand-in)."""
    return grpcstubs.cri_stubs()


@pytest.fixture(scope="session")
def dra_stubs() -> DraStubs:
    """grpcio stubs for the DRA protos (the plugin watcher stand-in)."""
    return grpcstubs.dra_stubs()


@pytest.fixture
def clock() -> FakeClock:
    """A clock that moves only when the test sets ``clock.now`` (it starts at 1000 s)."""
    return FakeClock()


@pytest.fixture
def short_tmp_path() -> Iterator[Path]:
    """A short directory under /tmp: Unix socket paths must stay under 108 bytes."""
    path = Path(tempfile.mkdtemp(prefix="ga-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def device_plugin_dir(short_tmp_path: Path) -> Path:
    """Where the kubelet and the plugins put their sockets (created by ``FakeKubelet.start``)."""
    return short_tmp_path / "device-plugins"


@pytest.fixture
def fake_kubelet(device_plugin_dir: Path, grpc_stubs: StubModules) -> Iterator[FakeKubelet]:
    """A started kubelet stand-in on ``device_plugin_dir/kubelet.sock``; stopped afterwards."""
    with FakeKubelet(device_plugin_dir, grpc_stubs) as kubelet:
        yield kubelet


@pytest.fixture
def pod_resources(short_tmp_path: Path, grpc_stubs: StubModules) -> Iterator[FakePodResources]:
    """The kubelet's pod-resources stand-in, listing nothing until a test says what is held."""
    with FakePodResources(short_tmp_path / "pod-resources" / "kubelet.sock", grpc_stubs) as fake:
        yield fake


@pytest.fixture
def node_name() -> str:
    """The node the agent runs on in tests (its NODE_NAME); a directory's conftest may say
    another."""
    return "test-node"


@pytest.fixture
async def apiserver(node_name: str) -> AsyncIterator[FakeApiServer]:
    """The API-server stand-in, serving the Node ``node_name``."""
    server = FakeApiServer(node=node_name)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()
