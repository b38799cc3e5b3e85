"""The CDI spec: valid against the CDI schema, names matching Allocate, written atomically."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from referencing import Registry
from referencing.jsonschema import DRAFT7
from support.driverroot import LIBDIR, LIBRARY_PATHS, VERSION, can_mknod, make_driver_root
from support.nodes import gpu, gpu_uuid, mig, mig_uuid, node

from gpuagent.domain.containers import (
    CDI_KIND,
    CONTROL_NODES,
    ContainerSettings,
    DeviceListStrategy,
    allocate,
)
from gpuagent.domain.devices import IdStrategy
from gpuagent.domain.resources import MigStrategy, ResourceSettings, build_resources
from gpuagent.domain.snapshot import Snapshot
from gpuagent.domain.timeslicing import ReplicaRule, TimeSlicing
from gpuagent.nodefiles.cdi import (
    SPEC_FILE_NAME,
    TOOLKIT_KIND,
    build_spec,
    minimum_version,
    render_spec,
    sync_spec,
    toolkit_devices,
)
from gpuagent.nodefiles.driverfiles import DriverFiles, DriverRoot

SCHEMA_DIR = Path(__file__).parents[1] / "data" / "cdi-schema"
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


ROOT = "/run/nvidia/driver"


def driver(tmp_path: Path, **kwargs: Any) -> DriverFiles:
    """The files of a fake driver laid out under ``tmp_path`` (DRM nodes when running as root)."""
    make_driver_root(tmp_path, bus_ids=(NODE.gpus[0].pci_bus_id,), **kwargs)
    root = DriverRoot(tmp_path, kernel_release="6.1.0", firmware_class_path=tmp_path / "none")
    return root.find(VERSION, [g.pci_bus_id for g in NODE.gpus])


def full_spec(tmp_path: Path, **kwargs: Any) -> dict[str, Any]:
    return spec_of(NODE, dev_root=ROOT, driver=driver(tmp_path), **kwargs)


@pytest.mark.parametrize("with_driver", [False, True], ids=["nodes-only", "with-driver"])
def test_spec_validates_against_the_cdi_schema(tmp_path: Path, with_driver: bool) -> None:
    spec = full_spec(tmp_path) if with_driver else spec_of(NODE)
    validator().validate(spec)
    # What the upstream schema does not check: known keys only, env entries as strings.
    assert set(spec) == {"cdiVersion", "kind", "devices", "containerEdits"}
    assert spec["containerEdits"]["env"] == ["NVIDIA_VISIBLE_DEVICES=void"]
    assert set(spec["containerEdits"]) <= {"env", "deviceNodes", "mounts", "hooks"}
    for device in spec["devices"]:
        assert set(device) == {"name", "containerEdits"}
        assert set(device["containerEdits"]) <= {"deviceNodes", "hooks"}
        for edit in device["containerEdits"]["deviceNodes"]:
            assert set(edit) <= {"path", "hostPath"}


def test_the_schema_copy_rejects_a_broken_spec() -> None:
    with pytest.raises(jsonschema.ValidationError):
        validator().validate({"cdiVersion": "0.5.0", "kind": CDI_KIND, "devices": [{}]})


def test_spec_header_and_device_names() -> None:
    spec = spec_of(NODE)
    assert (spec["cdiVersion"], spec["kind"]) == ("0.5.0", "k8s.device-plugin.nvidia.com/gpu")
    assert [d["name"] for d in spec["devices"]] == [
        gpu_uuid(0), "0",
        gpu_uuid(1), "1", mig_uuid(1, 7), "1:0", mig_uuid(1, 3), "1:1",
        gpu_uuid(2), "2",
        "all",
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("names", "dev_root", "version"),
    [((IdStrategy.UUID,), "/", "0.3.0"),  # names start with a letter, no hostPath
     ((IdStrategy.UUID,), ROOT, "0.5.0"),  # hostPath (added in 0.5.0)
     ((IdStrategy.INDEX,), "/", "0.5.0"),  # names starting with a digit (0.5.0)
     ((IdStrategy.UUID, IdStrategy.INDEX), "/", "0.5.0")],
)  # fmt: skip
def test_cdi_version_is_the_lowest_that_expresses_the_spec(
    names: tuple[IdStrategy, ...], dev_root: str, version: str
) -> None:
    assert spec_of(NODE, names=names, dev_root=dev_root)["cdiVersion"] == version


@pytest.mark.parametrize(
    ("change", "version"),
    [({}, "0.3.0"),
     ({"annotations": {"a": "b"}}, "0.6.0"),
     ({"kind": "vendor.com/gpu.shared"}, "0.6.0"),
     ({"devices": [{"name": "x", "annotations": {"a": "b"}, "containerEdits": {}}]}, "0.6.0"),
     ({"devices": [{"name": "0", "containerEdits": {}}]}, "0.5.0"),
     ({"containerEdits": {"deviceNodes": [{"path": "/dev/x", "hostPath": "/h/dev/x"}]}}, "0.5.0"),
     ({"containerEdits": {"mounts": [{"hostPath": "/a", "containerPath": "/a", "type": "bind"}]}},
      "0.4.0")],
)  # fmt: skip
def test_minimum_version_rules(change: dict[str, Any], version: str) -> None:
    spec = {"kind": "vendor.com/gpu", "devices": [{"name": "gpu0", "containerEdits": {}}]}
    assert minimum_version({**spec, **change}) == version


def test_driver_files_are_mounted_read_only_from_the_driver_root(tmp_path: Path) -> None:
    spec = full_spec(tmp_path)
    mounts = spec["containerEdits"]["mounts"]
    assert all(m["options"] == ["ro", "nosuid", "nodev", "rbind", "rprivate"] for m in mounts)
    # Host paths under the driver root, links followed inside it (/var/run -> /run there).
    host = {m["containerPath"]: m["hostPath"] for m in mounts}
    assert (
        host.pop("/var/run/nvidia-persistenced/socket") == f"{ROOT}/run/nvidia-persistenced/socket"
    )
    assert all(h == ROOT + c for c, h in host.items())
    assert [m["containerPath"] for m in mounts] == [
        *LIBRARY_PATHS,
        "/usr/bin/nvidia-smi",
        "/usr/sbin/nvidia-persistenced",
        "/usr/bin/nvidia-cuda-mps-control",
        "/var/run/nvidia-persistenced/socket",
        "/tmp/nvidia-mps",
        f"/lib/firmware/nvidia/{VERSION}/gsp_ga10x.bin",
        f"/lib/firmware/nvidia/{VERSION}/gsp_tu10x.bin",
    ]


def test_hooks_as_nvidia_ctk_spells_them(tmp_path: Path) -> None:
    spec = full_spec(tmp_path)
    symlinks, ldcache = spec["containerEdits"]["hooks"]
    assert symlinks["hookName"] == ldcache["hookName"] == "createContainer"
    assert symlinks["path"] == ldcache["path"] == "/usr/bin/nvidia-ctk"
    assert symlinks["args"][:3] == ["nvidia-ctk", "hook", "create-symlinks"]
    links = symlinks["args"][3:]
    assert links[0::2] == ["--link"] * (len(links) // 2)
    assert f"libcuda.so.1::{LIBDIR}/libcuda.so" in links[1::2]
    assert f"libcuda.so.{VERSION}::{LIBDIR}/libcuda.so.1" in links[1::2]
    assert ldcache["args"] == [
        "nvidia-ctk", "hook", "update-ldcache",
        "--folder", LIBDIR, "--folder", f"{LIBDIR}/vdpau",
    ]  # fmt: skip


def test_hooks_as_nvidia_cdi_hook_spells_them(tmp_path: Path) -> None:
    spec = full_spec(tmp_path, hook_path="/usr/local/nvidia/toolkit/nvidia-cdi-hook")
    hooks = spec["containerEdits"]["hooks"]
    assert [h["path"] for h in hooks] == ["/usr/local/nvidia/toolkit/nvidia-cdi-hook"] * 2
    assert [h["args"][:2] for h in hooks] == [
        ["nvidia-cdi-hook", "create-symlinks"],
        ["nvidia-cdi-hook", "update-ldcache"],
    ]


def test_without_driver_libraries_no_hooks(tmp_path: Path) -> None:
    files = DriverRoot(tmp_path / "empty").find(VERSION)
    spec = spec_of(NODE, driver=files)
    assert spec["containerEdits"]["mounts"] == []
    assert "hooks" not in spec["containerEdits"]


@pytest.mark.skipif(not can_mknod(), reason="DRM device nodes need root (mknod)")
def test_a_gpu_brings_its_drm_nodes_and_by_path_links(tmp_path: Path) -> None:
    spec = full_spec(tmp_path)
    (device,) = [d for d in spec["devices"] if d["name"] == "0"]
    edits = device["containerEdits"]
    assert [n["path"] for n in edits["deviceNodes"]] == [
        "/dev/nvidia0", "/dev/dri/card1", "/dev/dri/renderD128",
    ]  # fmt: skip
    (hook,) = edits["hooks"]
    address = "0000:18:00.0"
    assert hook["args"] == [
        "nvidia-ctk", "hook", "create-symlinks",
        "--link", f"../card1::/dev/dri/by-path/pci-{address}-card",
        "--link", f"../renderD128::/dev/dri/by-path/pci-{address}-render",
    ]  # fmt: skip
    (every,) = [d for d in spec["devices"] if d["name"] == "all"]
    assert every["containerEdits"]["hooks"] == edits["hooks"]
    (other,) = [d for d in spec["devices"] if d["name"] == "1"]
    assert "hooks" not in other["containerEdits"]


def test_toolkit_devices_read_from_its_specs(tmp_path: Path) -> None:
    etc, run = tmp_path / "etc-cdi", tmp_path / "run-cdi"
    etc.mkdir()
    run.mkdir()
    assert toolkit_devices((etc, run)) is None
    (run / "nvidia.yaml").write_text(
        "cdiVersion: 0.5.0\nkind: nvidia.com/gpu\ndevices:\n"
        "- name: '0'\n  containerEdits: {}\n- name: GPU-abc\n  containerEdits: {}\n"
        "- name: all\n  containerEdits: {}\n"
    )
    (etc / "other.json").write_text(
        json.dumps({"kind": "example.com/x", "devices": [{"name": "9"}]})
    )
    (etc / "broken.yaml").write_text(": : :")
    (etc / "ignored.txt").write_text("kind: nvidia.com/gpu")
    assert toolkit_devices((etc, run)) == frozenset({"0", "GPU-abc", "all"})


def test_toolkit_kind_names_the_toolkits_devices() -> None:
    resources = build_resources(NODE, ResourceSettings())
    settings = ContainerSettings(strategies=(DeviceListStrategy.CDI_CRI,), cdi_kind=TOOLKIT_KIND)
    resource = resources.resources[0]
    device = next(d for d in resource.devices if d.healthy)
    assert allocate(resource, [device.id], settings).cdi_devices == (f"nvidia.com/gpu={device.id}",)


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
