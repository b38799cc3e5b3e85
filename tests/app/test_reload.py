"""Whether an option is live is declared on the option, and the reload path honours it: a live
option's change is served at once and needs no restart; any other option's change is named as
needing a restart and changes nothing that is served."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from structlog.testing import capture_logs
from support.waiting import eventually

from gpuagent.app.reload import Reloads
from gpuagent.config import OPTIONS, ConfigError, Settings, load_settings
from gpuagent.config.option import Option
from gpuagent.config.planning import LIVE, make_plan
from gpuagent.nodefiles.cdikeeper import CdiSpecKeeper
from gpuagent.state.store import DeviceStore

ENV = {"NODE_NAME": "node-1"}
SHARED = "{timeSlicing: {resources: [{name: nvidia.com/gpu, replicas: 2}]}}"
# Values other than the default, for every option a reload can change: the ones the config file
# may set (flags and environment are the running process's, read again unchanged).
EXAMPLES: dict[str, tuple[str, ...]] = {
    "socket-dir": ("/run/dp",),
    "kubelet-socket": ("/run/dp/kubelet.sock",),
    "pod-resources-socket": ("/run/pr/kubelet.sock",),
    "metrics-address": ("127.0.0.1:9500", ":9401"),
    "simulate": ("2", "8"),
    "sim-config": ("/etc/gpuagent/node.yaml",),
    "resource-name": ("example.com/gpu", "nvidia.com/tesla"),
    "device-list-strategy": ("volume-mounts", "cdi-cri", "envvar,cdi-annotations"),
    "device-id-strategy": ("index",),
    "mig-strategy": ("single", "mixed"),
    "fail-on-init-error": ("false",),
    "pass-device-specs": ("true",),
    "nvidia-driver-root": ("/run/nvidia/driver",),
    "disable-healthchecks": ("all", "xids", "48,79"),
    "enable-healthchecks": ("79", "all"),
    "poll-interval": ("2", "10"),
    "nvml-timeout": ("30",),
    "log-format": ("console",),
    "log-level": ("debug", "error"),
    "web-config-file": ("/etc/gpuagent/web.yml",),
    "hostname-label": ("hostname",),
    "no-hostname": ("true",),
    "pod-resources-interval": ("10",),
    "sharing": (SHARED,),
    "shared-devices-allocation-policy": ("packed",),
    "mps-root": ("/var/run/mps",),
    "mps-compute-mode": ("unchanged",),
    "cdi-annotation-prefix": ("example.com/",),
    "cdi-spec-dir": ("/etc/cdi",),
    "cdi-spec": ("toolkit",),
    "nvidia-cdi-hook-path": ("/usr/local/bin/nvidia-cdi-hook",),
    "driver-root-ctr-path": ("/host/driver",),
    "node-labels": ("false",),
    "node-labels-file": ("/etc/nfd/gpu",),
    "machine-type-file": ("/etc/machine-type",),
    "dra-gpus": ("all", "0,1"),
    "dra-driver-name": ("gpu.example.com",),
    "dra-mig": ("dynamic",),
    "dra-sharing": ("mps",),
    "plugins-registry-dir": ("/var/lib/kubelet/reg",),
    "plugins-dir": ("/var/lib/kubelet/dra",),
    "kubeconfig": ("/etc/kubernetes/kubelet.conf",),
    "container-accounting": ("false",),
    "proc-root": ("/host/proc",),
    "container-logs-dir": ("/host/logs",),
    "cri-socket": ("/run/containerd/containerd.sock",),
    "dcgm-series-per-container": ("true",),
    "dcgm-container-shares": ("true",),
    "detailed-agent-metrics": ("true",),
    "kubernetes": ("false",),
    "node-condition": ("false", "true"),
    "events": ("false", "true"),
    "taint-unhealthy-node": ("true",),
    "node-condition-heartbeat": ("600",),
}
RELOADABLE = [opt for opt in OPTIONS if opt.in_file]


@dataclass(frozen=True)
class Node:
    """A started agent's node as the reload sees it: no GPUs discovered, no CDI spec kept."""

    gpu_count: int = 0
    cdi: CdiSpecKeeper | None = None


def flag(option: Option[Any], raw: str) -> str:
    return f"--{option.name}={raw}"


def spellings(option: Option[Any]) -> set[str]:
    return {option.name, *(alias.removeprefix("--") for alias in option.aliases)}


def settings_or_none(argv: list[str]) -> Settings | None:
    try:
        return load_settings(argv, ENV)
    except ConfigError:  # (two examples that contradict each other)
        return None


@st.composite
def changes(draw: st.DrawFn) -> tuple[list[str], Option[Any], str]:
    """The running agent's flags (a few options away from their defaults), and one option with
    the value a reload gives it."""
    running = draw(st.lists(st.sampled_from(RELOADABLE), max_size=3, unique=True))
    argv = [flag(opt, draw(st.sampled_from(EXAMPLES[opt.name]))) for opt in running]
    option = draw(st.sampled_from(RELOADABLE))
    return argv, option, draw(st.sampled_from(EXAMPLES[option.name]))


def test_every_option_a_reload_can_change_has_examples() -> None:
    assert set(EXAMPLES) == {opt.name for opt in RELOADABLE}


def test_live_options_are_settings_a_config_file_may_set() -> None:
    assert {f.name for f in fields(Settings)} >= LIVE
    assert all(opt.in_file for opt in OPTIONS if opt.live)


@pytest.mark.parametrize("option", [o for o in OPTIONS if o.live], ids=lambda o: o.name)
def test_a_live_option_shapes_the_plan(option: Option[Any]) -> None:
    """Declared live, an option must be one the plan holds: some value of it changes the plan."""
    default = make_plan(load_settings([], ENV), control_nodes=())
    plans = [make_plan(load_settings([flag(option, raw)], ENV), control_nodes=()) for raw in
             EXAMPLES[option.name]]  # fmt: skip
    assert any(plan != default for plan in plans)


@given(changes())
def test_a_reload_serves_live_options_and_names_the_others(
    change: tuple[list[str], Option[Any], str],
) -> None:
    argv, option, raw = change
    running = settings_or_none(argv)
    reloaded = settings_or_none([*argv, flag(option, raw)])
    assume(running is not None and reloaded is not None and reloaded != running)
    assert running is not None
    assert reloaded is not None
    plan = make_plan(running, control_nodes=())
    store = DeviceStore(plan=plan)
    reloads = Reloads(store, running, source=lambda: reloaded, check_interval=1.0, web_config=None)
    with capture_logs() as logs:
        restart = asyncio.run(reloads.reload(Node()))
    assert restart is not None, logs
    (entry,) = [e for e in logs if e["log_level"] == "info"]
    warnings = [e for e in logs if e["log_level"] == "warning"]
    if option.live:
        assert restart == []
        assert entry["needs_restart"] == []
        assert not warnings
        # Served as a start with the reloaded settings would serve it.
        assert reloads.settings == reloaded
        fresh = make_plan(reloaded, control_nodes=())
        assert store.plan == replace(fresh, generation=store.plan.generation)
        assert store.plan.generation == (0 if fresh == plan else 1)
    else:
        assert spellings(option) & set(restart)
        assert not {name for opt in OPTIONS if opt.live for name in spellings(opt)} & set(restart)
        assert entry == {
            "event": "configuration unchanged",
            "generation": 0,
            "needs_restart": restart,
            "log_level": "info",
        }
        assert [w["keys"] for w in warnings] == [restart]
        assert reloads.settings == running
        assert store.plan is plan


async def test_a_change_once_the_agent_has_started_reloads(tmp_path: Path) -> None:
    """The watched files are read as the agent starts (Reloads.look, before it says it has
    started): a change written before the reloads' task first runs is a change, not the start's
    content (a test writing the file just after the start missed it under load)."""
    config = tmp_path / "gpuagent.yaml"
    config.write_text("version: v1\n")
    argv = ["--config", str(config)]
    running = load_settings(argv, ENV)
    store = DeviceStore(plan=make_plan(running, control_nodes=()))
    reloads = Reloads(
        store,
        running,
        source=lambda: load_settings(argv, ENV),
        check_interval=0.01,
        web_config=None,
    )
    await reloads.look()
    config.write_text(f"version: v1\nsharing: {SHARED}\n")  # before the task runs
    task = asyncio.create_task(reloads.run(Node()))
    try:
        await eventually(lambda: store.counters.read().reloads.changed == 1, what="a reload")
    finally:
        task.cancel()
        await asyncio.wait({task})
