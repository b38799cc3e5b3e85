"""Fixtures of the end-to-end tests: the kubelet's pod-resources stand-in."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from support.fake_podresources import FakePodResources
from support.grpcstubs import StubModules


@pytest.fixture
def pod_resources(short_tmp_path: Path, grpc_stubs: StubModules) -> Iterator[FakePodResources]:
    """The pod-resources stand-in, listing nothing until a test says what is held."""
    with FakePodResources(short_tmp_path / "pod-resources" / "kubelet.sock", grpc_stubs) as fake:
        yield fake
