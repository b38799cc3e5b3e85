"""Every configuration error names the setting as the operator gave it — the flag as typed, the
variable as set (NVIDIA's alias or ``GPUAGENT_*``), or the config file's key — in one line,
whichever check finds it: the value's parser, the plan, the files it points at, the directories,
the credentials."""

from __future__ import annotations

from pathlib import Path

import pytest

import gpuagent.__main__
import gpuagent.logs
from gpuagent.__main__ import main
from gpuagent.config import OPTIONS, load_settings
from gpuagent.config.cli import build_parser, normalize_bool_flags
from gpuagent.config.option import Option
from gpuagent.config.sources import Sources

BAD_SIM = "version: v1\ngpus:\n  - memory_mib: lots\n"


@pytest.mark.parametrize(
    ("args", "env", "file", "line"),
    [
        pytest.param(["--disable-healthchecks", "xid79"], {}, "",
                     "--disable-healthchecks: 'xid79' is not 'all', 'xids' or an XID",
                     id="flag"),
        pytest.param([], {"DP_DISABLE_HEALTHCHECKS": "xid79"}, "",
                     "DP_DISABLE_HEALTHCHECKS: 'xid79' is not", id="nvidia-alias"),
        pytest.param([], {"GPUAGENT_ENABLE_HEALTHCHECKS": "oops"}, "",
                     "GPUAGENT_ENABLE_HEALTHCHECKS: 'oops' is not", id="variable"),
        pytest.param([], {}, "enable-healthchecks: [79, oops]\n",
                     "config file key 'enable-healthchecks': 'oops' is not", id="file-key"),
        pytest.param(["--driver-root", "usr/local/nvidia"], {}, "",
                     "--driver-root: must be an absolute path", id="flag-alias-in-the-plan"),
        pytest.param([], {"NVIDIA_DRIVER_ROOT": "usr/local/nvidia"}, "",
                     "NVIDIA_DRIVER_ROOT: must be an absolute path", id="alias-in-the-plan"),
        pytest.param([], {"GPUAGENT_DRA_GPUS": "gpu7"}, "",
                     "GPUAGENT_DRA_GPUS: 'gpu7' is not none, all", id="dra-gpus-in-the-plan"),
        pytest.param([], {"GPUAGENT_WEB_CONFIG_FILE": "/nonexistent/web.yml"}, "",
                     "GPUAGENT_WEB_CONFIG_FILE: cannot read /nonexistent/web.yml",
                     id="web-config-file"),
        pytest.param([], {"GPUAGENT_SIM_CONFIG": "<SIM>"}, "",
                     "GPUAGENT_SIM_CONFIG gpus[0].memory_mib:", id="in-the-sim-config"),
        pytest.param([], {"GPUAGENT_SOCKET_DIR": "<FILE>"}, "",
                     "GPUAGENT_SOCKET_DIR: <FILE> is not a directory", id="socket-dir"),
        pytest.param([], {"GPUAGENT_DRA_GPUS": "all"}, "plugins-dir: <FILE>\n",
                     "config file key 'plugins-dir': <FILE> is not a directory", id="plugins-dir"),
        pytest.param([], {"GPUAGENT_NODE_CONDITION": "true"}, "",
                     "GPUAGENT_NODE_CONDITION: needs API server credentials: not in a pod",
                     id="node-condition"),
        pytest.param(["--events"], {"GPUAGENT_KUBECONFIG": "/nonexistent/kc"}, "",
                     "--events: needs API server credentials: GPUAGENT_KUBECONFIG "
                     "/nonexistent/kc: no such file", id="kubeconfig-named-in-the-reason"),
        pytest.param(["--dra-mig", "dynamic"], {}, "",
                     "--dra-mig: dynamic cannot be combined with --dra-gpus none: MIG devices",
                     id="dynamic-mig-without-dra"),
        pytest.param([], {"GPUAGENT_DRA_MIG": "dynamic"}, "dra-gpus: none\n",
                     "GPUAGENT_DRA_MIG: dynamic cannot be combined with config file key "
                     "'dra-gpus' none", id="dynamic-mig-without-dra-from-the-file"),
        pytest.param(["--dra-gpus=all"], {}, "",
                     "--dra-gpus: needs API server credentials: in-cluster",
                     id="dra-without-credentials"),
        pytest.param(["--dra-sharing", "mps"], {}, "",
                     "--dra-sharing: mps cannot be combined with --dra-gpus none: only GPUs",
                     id="dra-sharing-without-dra"),
        pytest.param(["--dra-gpus=all", "--dra-mig=dynamic"], {"GPUAGENT_DRA_SHARING": "mps"}, "",
                     "GPUAGENT_DRA_SHARING: mps cannot be combined with --dra-mig dynamic: MIG",
                     id="dra-sharing-with-dynamic-mig"),
        pytest.param([], {}, "dra-sharing: time-slicing\n",
                     "config file key 'dra-sharing': must be one of none, mps, got 'time-slicing'",
                     id="dra-sharing-unknown"),
    ],
)  # fmt: skip
def test_an_error_names_the_setting_as_given(
    args: list[str],
    env: dict[str, str],
    file: str,
    line: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    places = {"<FILE>": str(tmp_path / "a-file"), "<SIM>": str(tmp_path / "node.yaml")}
    (tmp_path / "a-file").write_text("")
    (tmp_path / "node.yaml").write_text(BAD_SIM)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, places.get(value, value))

    async def would_run(*_: object) -> int:
        return 0  # (a case that passed every check: fail now, not after running the agent)

    monkeypatch.setattr(gpuagent.__main__, "_run", would_run)
    monkeypatch.setattr(gpuagent.logs, "configure", lambda *_: None)  # (process-wide)
    argv = [*([] if "GPUAGENT_SOCKET_DIR" in env else ["--socket-dir", str(tmp_path)]), *args]
    argv += [] if "GPUAGENT_SIM_CONFIG" in env else ["--simulate", "1"]
    if file:
        config = tmp_path / "gpuagent.yaml"
        config.write_text("version: v1\n" + file.replace("<FILE>", places["<FILE>"]))
        argv += ["--config", str(config)]

    assert main(argv) == 2

    out = capsys.readouterr()
    (said,) = out.err.splitlines()
    expected = line.replace("<FILE>", places["<FILE>"])
    assert said.startswith(f"gpuagent: configuration error: {expected}"), said
    assert out.out == ""


@pytest.mark.parametrize("opt", OPTIONS, ids=lambda o: o.name)
def test_every_option_knows_where_it_came_from(opt: Option[object], tmp_path: Path) -> None:
    """What each error names: every spelling of every option, from every source."""
    for flag in (f"--{opt.name}", *opt.aliases):
        flags = build_parser().parse_args(normalize_bool_flags([f"{flag}=x"]))
        assert Sources(flags, {}).label(opt) == flag
    no_flags = build_parser().parse_args([])
    for name in opt.env_names:
        assert Sources(no_flags, {name: "x"}).label(opt) == name
    if opt.in_file:
        config = tmp_path / "c.yaml"
        config.write_text(f"version: v1\n{opt.name}: x\n")
        sources = Sources(no_flags, {})
        sources.load_file(config, "--config")
        assert sources.label(opt) == f"config file key {opt.name!r}"


def test_the_settings_keep_where_each_came_from(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("version: v1\nmig-strategy: mixed\n")
    settings = load_settings(
        ["--driver-root", "/run/nvidia/driver", "--config", str(config)],
        {"DP_DISABLE_HEALTHCHECKS": "xids"},
    )
    assert [settings.named(o) for o in ("nvidia_driver_root", "disable_healthchecks")] == [
        "--driver-root",
        "DP_DISABLE_HEALTHCHECKS",
    ]
    assert settings.named("mig_strategy") == "config file key 'mig-strategy'"
    assert settings.named("poll_interval") == "--poll-interval"  # not given: its flag
    assert "origins" not in settings.as_dict()
