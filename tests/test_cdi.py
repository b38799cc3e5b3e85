"""The CDI spec: valid against the CDI schema, names matching Allocate, written atomically."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from referencing import Registry
from referencing.jsonschema import DRAFT7
from support.nodes import gpu, gpu_uuid, mig, mig_uuid, node

from gpuagent.cdi import CDI_VERSION, SPEC_FILE_NAME, build_spec, render_spec, sync_spec
from gpuagent.domain.containers import (
    CDI_KIND,
    CONTROL_NODES,
    ContainerSettings,
    DeviceListStrategy,
    allocate,
)
from gpuagent.domain.devices import IdStrategy, Snapshot
from gpuagent.domain.resources import MigStrategy, ResourceSettings, build_resources
from gpuagent.domain.timeslicing import ReplicaRule, TimeSlicing

SCHEMA_DIR = Path(__file__).parent / "data" / "cdi-schema"
NODE = node(
    gpu(0, numa=0),
    gpu(1, numa=0, migs=[mig(1, 7), mig(1, 3, "2g.20gb")]),
    gpu(2, numa=1, healthy=False),
)


def validator() -> jsonschema.protocols.Validator:
    schema = json.loads((SCHEMA_DIR / "schema.json").read_text())
    defs = json.loads((SCHEMA_DIR / "defs.json").read_text())
    # schema.json refers to "defs.json#/definitions/…", resolved against the copy beside it.
    registry: Registry[Any] = Registry().with_resource("defs.json", DRAFT7.create_resource(defs))
    return jsonschema.Draft7Validator(schema, registry=registry)


def spec_of(snapshot: Snapshot, **kwargs: Any) -> dict[str, Any]:
    spec = build_spec(snapshot, **kwargs)
    assert spec is not None
    return spec


def test_spec_validates_against_the_cdi_schema() -> None:
    spec = spec_of(NODE)
    validator().validate(spec)
    # What the upstream schema does not check: known keys only, env entries as strings.
    assert set(spec) == {"cdiVersion", "kind", "devices", "containerEdits"}
    assert spec["containerEdits"]["env"] == ["NVIDIA_VISIBLE_DEVICES=void"]
    for device in spec["devices"]:
        assert set(device) == {"name", "containerEdits"}
        assert set(device["containerEdits"]) == {"deviceNodes"}
        for edit in device["containerEdits"]["deviceNodes"]:
            assert set(edit) == {"path", "hostPath"}


def test_the_schema_copy_rejects_a_broken_spec() -> None:
    with pytest.raises(jsonschema.ValidationError):
        validator().validate({"cdiVersion": CDI_VERSION, "kind": CDI_KIND, "devices": [{}]})


def test_spec_header_and_device_names() -> None:
    spec = spec_of(NODE)
    assert (spec["cdiVersion"], spec["kind"]) == ("0.6.0", "k8s.device-plugin.nvidia.com/gpu")
    assert [d["name"] for d in spec["devices"]] == [
        gpu_uuid(0), "0",
        gpu_uuid(1), "1", mig_uuid(1, 7), "1:0", mig_uuid(1, 3), "1:1",
        gpu_uuid(2), "2",
        "all",
    ]  # fmt: skip


def nodes_of(spec: dict[str, Any], name: str) -> list[tuple[str, str]]:
    (device,) = [d for d in spec["devices"] if d["name"] == name]
    return [(n["path"], n["hostPath"]) for n in device["containerEdits"]["deviceNodes"]]


def test_device_nodes_under_the_dev_root() -> None:
    spec = spec_of(NODE, dev_root="/run/nvidia/driver", control_nodes=["/dev/nvidiactl"])
    root = "/run/nvidia/driver"
    assert nodes_of(spec, "0") == [("/dev/nvidia0", f"{root}/dev/nvidia0")]
    assert nodes_of(spec, "1:0") == [
        ("/dev/nvidia1", f"{root}/dev/nvidia1"),
        ("/dev/nvidia-caps/nvidia-cap117", f"{root}/dev/nvidia-caps/nvidia-cap117"),
        ("/dev/nvidia-caps/nvidia-cap217", f"{root}/dev/nvidia-caps/nvidia-cap217"),
    ]
    assert [p for p, _ in nodes_of(spec, "all")] == [
        "/dev/nvidia0", "/dev/nvidia1",
        "/dev/nvidia-caps/nvidia-cap117", "/dev/nvidia-caps/nvidia-cap217",
        "/dev/nvidia-caps/nvidia-cap113", "/dev/nvidia-caps/nvidia-cap213",
        "/dev/nvidia2",
    ]  # fmt: skip
    assert spec["containerEdits"]["deviceNodes"] == [
        {"path": "/dev/nvidiactl", "hostPath": f"{root}/dev/nvidiactl"}
    ]


def test_control_nodes_in_nvidias_order() -> None:
    spec = spec_of(NODE, control_nodes=reversed(CONTROL_NODES))
    assert [n["path"] for n in spec["containerEdits"]["deviceNodes"]] == list(CONTROL_NODES)


def test_one_naming_only() -> None:
    spec = spec_of(NODE, names=(IdStrategy.INDEX,))
    assert [d["name"] for d in spec["devices"]] == ["0", "1", "1:0", "1:1", "2", "all"]


@pytest.mark.parametrize("id_strategy", list(IdStrategy), ids=lambda s: s.value)
@pytest.mark.parametrize("mig_strategy", [MigStrategy.NONE, MigStrategy.MIXED],
                         ids=lambda s: s.value)  # fmt: skip
@pytest.mark.parametrize("replicas", [0, 2])
def test_every_cdi_name_allocate_returns_is_in_the_spec(
    id_strategy: IdStrategy, mig_strategy: MigStrategy, replicas: int
) -> None:
    names = {f"{CDI_KIND}={d['name']}" for d in spec_of(NODE)["devices"]}
    sharing = TimeSlicing(
        resources=tuple(ReplicaRule(n, replicas) for n in ("gpu", "mig-1g.10gb")) if replicas
        else ()
    )  # fmt: skip
    resources = build_resources(
        NODE, ResourceSettings(mig_strategy=mig_strategy, time_slicing=sharing)
    )
    settings = ContainerSettings(strategies=(DeviceListStrategy.CDI_CRI,), id_strategy=id_strategy)
    asked = 0
    for resource in resources.resources:
        for device in resource.devices:
            if device.healthy:
                asked += 1
                assert set(allocate(resource, [device.id], settings).cdi_devices) <= names
    assert asked >= 1


def test_spec_ignores_health_and_telemetry() -> None:
    sick = node(gpu(0, numa=0, healthy=False), *NODE.gpus[1:])
    assert build_spec(sick) == build_spec(NODE)


def test_no_gpus_no_spec() -> None:
    assert build_spec(node()) is None


# ----- writing ------------------------------------------------------------------------------------
def test_sync_writes_once_and_only_on_change(tmp_path: Path) -> None:
    cdi_dir = tmp_path / "cdi"
    spec = spec_of(NODE)
    assert sync_spec(spec, cdi_dir) is True
    path = cdi_dir / SPEC_FILE_NAME
    assert path.name == "k8s.device-plugin.nvidia.com-gpu.json"
    assert json.loads(path.read_text()) == spec
    assert path.read_bytes() == render_spec(spec)
    before = path.stat()
    assert sync_spec(spec_of(NODE), cdi_dir) is False
    after = path.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert sync_spec(spec_of(node(gpu(0))), cdi_dir) is True
    assert path.stat().st_ino != before.st_ino  # replaced by rename, never rewritten in place
    assert sorted(p.name for p in cdi_dir.iterdir()) == [SPEC_FILE_NAME]
    assert oct(path.stat().st_mode & 0o777) == oct(0o644)


def test_sync_without_gpus_removes_the_spec(tmp_path: Path) -> None:
    assert sync_spec(spec_of(NODE), tmp_path) is True
    assert sync_spec(None, tmp_path) is True
    assert list(tmp_path.iterdir()) == []
    assert sync_spec(None, tmp_path) is False
