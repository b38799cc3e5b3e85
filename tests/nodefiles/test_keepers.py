"""Keeping the node's CDI spec current: the agent's own, or the container toolkit's devices."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs
from support.clock import ManualClock
from support.driverroot import LIBDIR, VERSION, make_driver_root
from support.nodes import gpu, gpu_uuid, mig, mig_uuid, node
from support.waiting import eventually

from gpuagent.config import load_settings
from gpuagent.config.planning import driver_root_as_read, make_plan
from gpuagent.domain.backoff import Backoff
from gpuagent.domain.containers import TOOLKIT_CDI_KIND, ContainerSettings, DeviceListStrategy
from gpuagent.domain.devices import CdiSpec, Condition, Gpu, GpuHealth, IdStrategy, Telemetry
from gpuagent.domain.health import DISCOVERY
from gpuagent.domain.plan import Plan
from gpuagent.domain.serving import ServingPolicy, spec_devices
from gpuagent.domain.snapshot import Snapshot
from gpuagent.nodefiles import cdidriver, cdikeeper, labelkeeper
from gpuagent.nodefiles.cdi import SPEC_FILE_NAME
from gpuagent.nodefiles.cdicontent import CdiTarget, expected_toolkit_names
from gpuagent.nodefiles.cdikeeper import CdiSpecKeeper, write_cdi
from gpuagent.nodefiles.described import DescribedDevices, described_devices
from gpuagent.nodefiles.labelkeeper import LabelTarget, NodeFiles
from gpuagent.state.store import DeviceStore

NODE = node(gpu(0), gpu(1, migs=[mig(1, 7)]), driver=VERSION)


def test_write_mode_writes_the_driver_into_the_spec(tmp_path: Path) -> None:
    make_driver_root(tmp_path / "mnt")
    target = CdiTarget(
        spec_dir=tmp_path / "cdi",
        driver_root="/run/nvidia/driver",
        read_root=tmp_path / "mnt",
        hook_path="/usr/local/nvidia/toolkit/nvidia-ctk",
    )
    assert write_cdi(NODE, ContainerSettings(), target) is True
    spec = json.loads((tmp_path / "cdi" / SPEC_FILE_NAME).read_text())
    mounts = {m["containerPath"]: m["hostPath"] for m in spec["containerEdits"]["mounts"]}
    # Read where the agent sees the root, written as the host sees it.
    lib = f"{LIBDIR}/libcuda.so.{VERSION}"
    assert mounts[lib] == f"/run/nvidia/driver{lib}"
    assert {h["path"] for h in spec["containerEdits"]["hooks"]} == {
        "/usr/local/nvidia/toolkit/nvidia-ctk"
    }
    assert write_cdi(NODE, ContainerSettings(), target) is False


def test_write_mode_without_driver_files_warns(tmp_path: Path) -> None:
    target = CdiTarget(spec_dir=tmp_path / "cdi", read_root=tmp_path / "empty")
    with capture_logs() as logs:
        assert write_cdi(NODE, ContainerSettings(), target) is True
    assert [e["event"] for e in logs if e["log_level"] == "warning"] == [
        "driver libraries not found; CDI containers get device nodes only"
    ]


def toolkit_spec(directory: Path, names: list[str]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    devices = [{"name": n, "containerEdits": {}} for n in names]
    (directory / "nvidia.yaml").write_text(
        json.dumps({"cdiVersion": "0.5.0", "kind": "nvidia.com/gpu", "devices": devices})
    )


@pytest.mark.parametrize(
    ("strategy", "names"),
    [(IdStrategy.UUID, [gpu_uuid(0), gpu_uuid(1), mig_uuid(1, 7)]),
     (IdStrategy.INDEX, ["0", "1", "1:0"])],
)  # fmt: skip
def test_expected_toolkit_names(strategy: IdStrategy, names: list[str]) -> None:
    settings = ContainerSettings(id_strategy=strategy, cdi_kind=TOOLKIT_CDI_KIND)
    assert expected_toolkit_names(NODE, settings) == names


def test_toolkit_mode_removes_the_agents_spec_and_checks_the_toolkits(tmp_path: Path) -> None:
    cdi = tmp_path / "cdi"
    write_cdi(NODE, ContainerSettings(), CdiTarget(spec_dir=cdi, read_root=tmp_path))
    assert (cdi / SPEC_FILE_NAME).exists()
    toolkit = tmp_path / "etc-cdi"
    target = CdiTarget(spec_dir=cdi, mode="toolkit", toolkit_dirs=(toolkit,))
    settings = ContainerSettings(cdi_kind=TOOLKIT_CDI_KIND)
    with capture_logs() as logs:
        assert write_cdi(NODE, settings, target) is True
    assert not (cdi / SPEC_FILE_NAME).exists()
    assert [e["event"] for e in logs] == [
        "no NVIDIA container toolkit CDI spec found; containers will not start "
        "(run nvidia-ctk cdi generate, or set cdi-spec: write)"
    ]
    toolkit_spec(toolkit, ["0", "1", gpu_uuid(0), gpu_uuid(1), "all"])
    with capture_logs() as logs:
        assert write_cdi(NODE, settings, target) is False
    (warning,) = logs
    assert warning["missing"] == [mig_uuid(1, 7)]
    toolkit_spec(toolkit, [gpu_uuid(0), gpu_uuid(1), mig_uuid(1, 7)])
    with capture_logs() as logs:
        write_cdi(NODE, settings, target)
    assert logs == []


def test_settings_select_the_toolkits_kind_and_the_read_root(tmp_path: Path) -> None:
    settings = load_settings(
        ["--cdi-spec", "toolkit", "--nvidia-driver-root", "/run/nvidia/driver",
         "--driver-root-ctr-path", str(tmp_path)],
        {},
    )  # fmt: skip
    assert make_plan(settings, control_nodes=()).serving.containers.cdi_kind == "nvidia.com/gpu"
    assert driver_root_as_read(settings) == tmp_path
    default = load_settings([], {})
    assert make_plan(default, control_nodes=()).serving.containers.cdi_kind == (
        "k8s.device-plugin.nvidia.com/gpu"
    )
    assert driver_root_as_read(default) == Path("/")


@pytest.mark.parametrize(
    ("argv", "env", "expected"),
    [([], {}, "/usr/bin/nvidia-ctk"),
     (["--nvidia-ctk-path", "/opt/nvidia-ctk"], {}, "/opt/nvidia-ctk"),
     ([], {"NVIDIA_CDI_HOOK_PATH": "/usr/bin/nvidia-cdi-hook"}, "/usr/bin/nvidia-cdi-hook"),
     ([], {"NVIDIA_CTK_PATH": "/usr/local/nvidia/toolkit/nvidia-ctk"},
      "/usr/local/nvidia/toolkit/nvidia-ctk")],
)  # fmt: skip
def test_hook_path_takes_nvidias_spellings(
    argv: list[str], env: dict[str, str], expected: str
) -> None:
    assert load_settings(argv, env).nvidia_cdi_hook_path == expected


def test_control_nodes_are_looked_for_where_the_root_is_read(tmp_path: Path) -> None:
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev" / "nvidiactl").write_text("")
    settings = load_settings(
        ["--nvidia-driver-root", "/run/nvidia/driver", "--container-driver-root", str(tmp_path)],
        {},
    )
    containers = make_plan(settings).serving.containers
    assert containers.control_nodes == ("/dev/nvidiactl",)
    assert containers.dev_root == "/run/nvidia/driver"


async def test_labels_follow_a_gpu_described_late_not_its_readings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GPU that starts undescribed (a slow or failing discovery) and is described later gets
    its labels rewritten; a MIG device's new readings or a health change write nothing."""
    writes: list[Snapshot] = []
    real = labelkeeper.write_labels

    def counting(snapshot: Snapshot, *args: Any) -> bool:
        writes.append(snapshot)
        return real(snapshot, *args)

    monkeypatch.setattr(labelkeeper, "write_labels", counting)
    features = tmp_path / "features"
    target = LabelTarget(features, tmp_path / "no-machine-type", tmp_path / "sys")
    store = DeviceStore()
    undescribed = Gpu.undescribed(0, gpu_uuid(0), Condition(DISCOVERY, "timed out"))
    described = gpu(0)
    other = gpu(1, migs=[mig(1, 1)], mig_enabled=True)
    h100 = "nvidia.com/gpu.product=NVIDIA-H100-80GB-HBM3"
    store.update(lambda s: node(undescribed, other))
    task = asyncio.create_task(NodeFiles(store, labels=target).run())

    def labelled(*lines: str) -> bool:
        text = features.read_text() if features.exists() else ""
        return all(f"{line}\n" in text for line in lines)

    try:
        await eventually(lambda: labelled("nvidia.com/gpu.count=1"), what="the first labels")
        assert not labelled(h100)  # one GPU of each name: no most numerous product
        store.update(lambda s: node(described, other))
        await eventually(
            lambda: labelled("nvidia.com/gpu.count=2", h100), what="labels for the described GPU"
        )
        assert len(writes) == 2

        # New readings and health of the described devices: the loop sees them, writes nothing.
        reading = replace(other.mig_devices[0], telemetry=Telemetry(temperature_c=50))
        sick = GpuHealth((Condition("xid", "79"),))
        store.update(lambda s: node(described, replace(other, mig_devices=(reading,), health=sick)))
        for _ in range(5):  # the loop's turn: it wakes for the snapshot and waits again
            await asyncio.sleep(0)
        store.update(lambda s: node(described, other, gpu(2)))  # a device added: written
        await eventually(lambda: labelled("nvidia.com/gpu.count=3"), what="a third GPU's labels")
        assert len(writes) == 3
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def test_a_watch_describes_again_only_the_gpus_that_are_new_objects() -> None:
    describe = DescribedDevices()
    first = node(gpu(0), gpu(1, migs=[mig(1, 7)]))
    described = describe(first)
    assert described == described_devices(first)
    polled = replace(first.gpus[1], telemetry=Telemetry(temperature_c=50))  # GPU 1's readings
    again = describe(replace(first, gpus=(first.gpus[0], polled)))
    assert again == described
    assert isinstance(again, tuple)
    assert isinstance(described, tuple)
    assert again[2][0] is described[2][0]  # GPU 0, the same object: not described again
    assert again[2][1] is not described[2][1]
    renamed = replace(first.gpus[0], name="NVIDIA A100-SXM4-80GB")
    assert describe(replace(first, gpus=(renamed, polled))) != described


async def test_the_keeper_says_which_devices_the_spec_on_disk_defines(tmp_path: Path) -> None:
    """A failed write keeps the last good devices and says why; the next change writes again."""
    cdi = tmp_path / "cdi"
    store = DeviceStore()
    keeper = CdiSpecKeeper(store, CdiTarget(spec_dir=cdi, read_root=tmp_path / "empty"))
    assert store.snapshot.cdi == CdiSpec()  # the first device list waits from now on
    settings = ContainerSettings(strategies=(DeviceListStrategy.CDI_CRI,))
    one = node(gpu(0))
    await keeper.sync(one, settings)
    assert store.snapshot.cdi == CdiSpec(devices=spec_devices(one), written=True)

    shutil.rmtree(cdi)
    cdi.write_text("not a directory\n")
    await keeper.sync(NODE, settings)
    spec = store.snapshot.cdi
    assert spec is not None
    assert (spec.devices, spec.written) == (spec_devices(one), True)
    assert spec.error

    cdi.unlink()
    await keeper.sync(node(gpu(0), gpu(1)), settings)  # a change: tried at once
    assert store.snapshot.cdi == CdiSpec(devices=spec_devices(node(gpu(0), gpu(1))), written=True)
    assert {d["name"] for d in json.loads((cdi / SPEC_FILE_NAME).read_text())["devices"]} == {
        gpu_uuid(0),
        "0",
        gpu_uuid(1),
        "1",
        "all",
    }


def test_the_toolkits_spec_is_not_waited_for(tmp_path: Path) -> None:
    store = DeviceStore()
    CdiSpecKeeper(store, CdiTarget(spec_dir=tmp_path, mode="toolkit"))
    assert store.snapshot.cdi is None


async def test_a_failed_write_is_tried_again_once_its_backoff_is_over(tmp_path: Path) -> None:
    cdi = tmp_path / "cdi"
    cdi.write_text("not a directory\n")
    containers = ContainerSettings(strategies=(DeviceListStrategy.CDI_CRI,))
    store = DeviceStore(NODE, plan=Plan(serving=ServingPolicy(containers=containers)))
    keeper = CdiSpecKeeper(
        store, CdiTarget(spec_dir=cdi, read_root=tmp_path / "empty"), backoff=Backoff(0.01, 0.01)
    )
    task = asyncio.create_task(keeper.run())
    try:
        await eventually(lambda: store.snapshot.cdi and store.snapshot.cdi.error, what="a failure")
        cdi.unlink()  # the directory can be made now; the snapshot does not change
        written = CdiSpec(devices=spec_devices(NODE), written=True)
        await eventually(lambda: store.snapshot.cdi == written, what="the spec written")
        assert (cdi / SPEC_FILE_NAME).exists()
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_a_write_that_keeps_failing_is_tried_after_1_s_doubling_to_30_s(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A spec directory that is a file, on a node whose driver libraries are not found: the write
    is tried again on the keeper's clock, 1 s after the first failure, doubling to 30 s; each
    try finds both problems again, and each is said once."""
    clock = ManualClock()
    tries: list[float] = []
    real = cdikeeper.write_cdi

    def counted(*args: Any) -> bool:
        tries.append(clock.now())
        return real(*args)

    monkeypatch.setattr(cdikeeper, "write_cdi", counted)
    cdi = tmp_path / "cdi"
    cdi.write_text("not a directory\n")
    containers = ContainerSettings(strategies=(DeviceListStrategy.CDI_CRI,))
    store = DeviceStore(NODE, plan=Plan(serving=ServingPolicy(containers=containers)))
    target = CdiTarget(spec_dir=cdi, read_root=tmp_path / "empty")
    keeper = CdiSpecKeeper(store, target, clock=clock)
    with capture_logs() as logs:
        task = asyncio.create_task(keeper.run())
        try:
            await eventually(lambda: clock.waiting == 1, what="the keeper waiting to retry")
            await clock.advance(100.0)
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    assert tries == [0.0, 1.0, 3.0, 7.0, 15.0, 31.0, 61.0, 91.0]
    warned = [e["event"] for e in logs if e["log_level"] == "warning"]
    assert warned == [
        "driver libraries not found; CDI containers get device nodes only",
        "cannot write file",
    ]


def test_node_specs_read_the_driver_root_again_only_for_a_new_driver_or_gpus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DRA's per-claim specs: a MIG device made on prepare changes the devices (the spec is
    built again, naming it) but not the driver's files, which are not looked for again."""
    make_driver_root(tmp_path / "mnt")
    reads: list[str] = []
    real = cdidriver.driver_files

    def counted(snapshot: Snapshot, target: CdiTarget, *more: Any) -> Any:
        reads.append(snapshot.driver.version)
        return real(snapshot, target, *more)

    monkeypatch.setattr(cdidriver, "driver_files", counted)
    specs = cdidriver.NodeSpecs(CdiTarget(spec_dir=tmp_path / "cdi", read_root=tmp_path / "mnt"))
    before = node(gpu(0, mig_enabled=True), driver=VERSION)
    first = specs.get(before, ContainerSettings())
    made = node(gpu(0, migs=[mig(0, 7)]), driver=VERSION)
    second = specs.get(made, ContainerSettings())
    assert first is not None
    assert second is not None
    assert mig_uuid(0, 7) in {d["name"] for d in second["devices"]}
    assert mig_uuid(0, 7) not in {d["name"] for d in first["devices"]}
    assert second["containerEdits"] == first["containerEdits"]
    assert reads == [VERSION]
    specs.get(node(gpu(0, migs=[mig(0, 7)]), driver="580.95.05"), ContainerSettings())
    assert reads == [VERSION, "580.95.05"]
