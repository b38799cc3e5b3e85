"""NVIDIA's sharing.timeSlicing block, as the config file spells it, into the domain."""

from __future__ import annotations

import pytest

from gpuagent.config import parse_sharing, sharing_block
from gpuagent.domain.errors import SettingError
from gpuagent.domain.timeslicing import ReplicaRule


def test_full_block() -> None:
    block = {
        "timeSlicing": {
            "renameByDefault": True,
            "failRequestsGreaterThanOne": True,
            "resources": [
                {"name": "nvidia.com/gpu", "replicas": 4, "devices": [0, "1"]},
                {"name": "gpu", "replicas": 2, "devices": "all", "rename": "gpu.small"},
            ],
        }
    }
    sliced = parse_sharing(block).time_slicing
    assert sliced.rename_by_default
    assert sliced.fail_requests_greater_than_one
    assert sliced.resources[0] == ReplicaRule("nvidia.com/gpu", 4, ("0", "1"))
    assert sliced.resources[1].replicas == 2


@pytest.mark.parametrize(
    ("block", "key"),
    [
        pytest.param({"timeSlicing": []}, "sharing.timeSlicing", id="not-a-mapping"),
        pytest.param({"timeSlicing": {"replicas": 2}}, "sharing.timeSlicing", id="unknown-key"),
        pytest.param({"timeSlicing": {"resources": {}}}, "sharing.timeSlicing.resources",
                     id="resources-not-a-list"),
        pytest.param({"timeSlicing": {"resources": [{}]}},
                     "sharing.timeSlicing.resources[0].name", id="no-name"),
        pytest.param({"timeSlicing": {"resources": [{"name": "gpu", "replicas": "4"}]}},
                     "sharing.timeSlicing.resources[0].replicas", id="replicas-text"),
        pytest.param({"timeSlicing": {"resources": [{"name": "gpu", "replicas": 1}]}},
                     "sharing.timeSlicing.resources[0].replicas", id="one-replica"),
        pytest.param({"timeSlicing": {"resources": [{"name": "gpu", "replicas": 2,
                                                     "devices": [True]}]}},
                     "sharing.timeSlicing.resources[0].devices", id="bad-device"),
        pytest.param({"timeSlicing": {"renameByDefault": "yes"}},
                     "sharing.timeSlicing.renameByDefault", id="flag-not-bool"),
    ],
)  # fmt: skip
def test_errors_name_the_key(block: dict[str, object], key: str) -> None:
    with pytest.raises(SettingError) as info:
        parse_sharing(block)
    assert info.value.key.startswith(key)


def test_nvidias_mps_block() -> None:
    """NVIDIA's MPS example (its README), as written for its plugin."""
    block = {
        "mps": {
            "renameByDefault": True,
            "resources": [{"name": "nvidia.com/gpu", "replicas": 10}],
        }
    }
    sharing = parse_sharing(block)
    assert sharing.strategy == "mps"
    assert sharing.mps.rename_by_default
    assert sharing.mps.fail_requests_greater_than_one  # NVIDIA's default for MPS
    assert sharing.mps.resources == (ReplicaRule("nvidia.com/gpu", 10),)
    assert sharing.replication.resources == sharing.mps.resources
    assert sharing_block(sharing) == {
        "mps": {
            "renameByDefault": True,
            "failRequestsGreaterThanOne": True,
            "resources": [{"name": "nvidia.com/gpu", "replicas": 10}],
        }
    }
    relaxed = parse_sharing({"mps": {"failRequestsGreaterThanOne": False, "resources": []}})
    assert not relaxed.mps.fail_requests_greater_than_one
    assert relaxed.strategy == "none"


@pytest.mark.parametrize(
    ("block", "key"),
    [
        pytest.param({"mps": "all"}, "sharing.mps", id="not-a-mapping"),
        pytest.param({"mps": {"replicas": 2}}, "sharing.mps", id="unknown-key"),
        pytest.param({"mps": {"resources": [{"name": "gpu", "replicas": 64}]}},
                     "sharing.mps.resources[0].replicas", id="past-48-clients"),
        pytest.param({"mps": {"resources": [{"name": "gpu", "replicas": 2, "devices": ["0:0"]}]}},
                     "sharing.mps.resources[0].devices", id="mig-device"),
        pytest.param({"mps": {"resources": [{"name": "gpu", "replicas": 2}]},
                      "timeSlicing": {"resources": [{"name": "gpu", "replicas": 2}]}},
                     "sharing", id="both"),
        pytest.param({"mps": {"renameByDefault": 1}}, "sharing.mps.renameByDefault",
                     id="flag-not-bool"),
    ],
)  # fmt: skip
def test_mps_errors_name_the_key(block: dict[str, object], key: str) -> None:
    with pytest.raises(SettingError) as info:
        parse_sharing(block)
    assert info.value.key == key
