"""The option table: the options of the groups, each taken by one field of ``Settings``, whose
order is the table's; each option's default as its help says it; and the recipe for adding a
setting (docs/architecture.md), walked with a throwaway option through the same mechanism."""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
import re
from dataclasses import dataclass, fields
from enum import StrEnum
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

import gpuagent.config.groups
from gpuagent.config import OPTIONS, ConfigError, Settings
from gpuagent.config.cli import build_parser
from gpuagent.config.load import load_as
from gpuagent.config.option import Option, bindings, options_of, setting
from gpuagent.config.values import parse_poll_interval

ROOT = Path(__file__).resolve().parents[2]
# The fields that take no option's value: the node's name (NODE_NAME) and where each came from.
NOT_OPTIONS = ["node_name", "origins"]


def grouped_options() -> dict[str, Option[Any]]:
    found: dict[str, Option[Any]] = {}
    for info in pkgutil.iter_modules(gpuagent.config.groups.__path__):
        module = importlib.import_module(f"gpuagent.config.groups.{info.name}")
        for attr, value in vars(module).items():
            if isinstance(value, Option):
                found[f"{info.name}.{attr}"] = value
    return found


def test_every_grouped_option_is_in_the_table_once() -> None:
    grouped = grouped_options()
    missing = [where for where, opt in grouped.items() if opt not in OPTIONS]
    assert missing == []
    assert len(OPTIONS) == len(set(OPTIONS)) == len(grouped)


def test_every_option_in_the_table_belongs_to_a_group() -> None:
    grouped = set(grouped_options().values())
    assert [opt.name for opt in OPTIONS if opt not in grouped] == []


def test_every_option_has_its_field_and_every_field_its_option() -> None:
    taken = {b.field: b.option.name for b in bindings(Settings)}
    assert [f.name for f in fields(Settings) if f.name not in taken] == NOT_OPTIONS
    by_option: dict[str, list[str]] = {}
    for field_name, option in taken.items():
        by_option.setdefault(option, []).append(field_name)
    assert list(by_option) == [opt.name for opt in OPTIONS]
    shared = {option: names for option, names in by_option.items() if len(names) > 1}
    assert shared == {"metrics-address": ["metrics_host", "metrics_port"]}


def test_an_option_taken_by_two_fields_is_refused() -> None:
    """The check above can fail: a field copied with its neighbour's option is caught."""

    @dataclass(frozen=True)
    class Twice:
        one: float = setting(EXAMPLE_INTERVAL)
        two: float = setting(EXAMPLE_INTERVAL)

    with pytest.raises(TypeError, match="--example-interval is taken by more than one field"):
        options_of(Twice)


def shown(value: object) -> str:
    """A default as the help text says it: ``true``, ``5``, ``envvar``, ``/proc``, ``:9400``."""
    match value:
        case bool():
            return "true" if value else "false"
        case float() if value.is_integer():
            return str(int(value))
        case StrEnum():
            return value.value
        case (str() as host, int() as port):
            return f"{host}:{port}"
        case tuple():
            return ",".join(shown(v) for v in value)
        case _:
            return str(value)


# "(default X)" in a help text where X is one word (no prose such as "console on a TTY").
_PROSE_DEFAULT = re.compile(r"\(?default (?P<value>[^\s();]+)(?:\)|;)")


@pytest.mark.parametrize(
    "option",
    [o for o in OPTIONS if _PROSE_DEFAULT.search(o.help) and o.name != "kubelet-socket"],
    ids=lambda o: o.name,
)
def test_the_help_says_the_options_default(option: Option[Any]) -> None:
    """--help and docs/configuration.md say the default in the help's words: they must be the
    option's (the kubelet's socket says where it follows --socket-dir instead)."""
    match = _PROSE_DEFAULT.search(option.help)
    assert match is not None
    assert match.group("value") == shown(option.default)


def test_the_help_check_sees_defaults() -> None:
    """Most options say their default in their help; the check above covers them."""
    checked = [o for o in OPTIONS if _PROSE_DEFAULT.search(o.help)]
    assert len(checked) > 30


# The recipe (docs/architecture.md, "How to add a setting"), step 1: the option, in its group.
EXAMPLE_INTERVAL = Option(
    "example-interval",
    parse_poll_interval,
    "seconds between examples (default 7)",
    "SECONDS",
    env_aliases=("EXAMPLE_INTERVAL",),
    default=7.0,
)


# Step 2: its field. (A subclass here, so the option comes last; in Settings the field's place
# is the option's place in --help.)
@dataclass(frozen=True, slots=True)
class WithExample(Settings):
    example_interval: float = setting(EXAMPLE_INTERVAL)


def write_config(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "gpuagent.yaml"
    path.write_text(f"version: v1\n{body}", encoding="utf-8")
    return path


def gen_files() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_files", ROOT / "scripts" / "gen_files.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def recipe_blocks() -> list[str]:
    """The code of docs/architecture.md's "How to add a setting", block by block."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = text.split("## How to add a setting\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)


def test_the_recipe_is_what_this_test_walks() -> None:
    """The option and the field in docs/architecture.md are the ones walked here."""
    option_block, field_block = recipe_blocks()
    declared: dict[str, Any] = {"Option": Option, "parse_poll_interval": parse_poll_interval}
    exec(option_block, declared)
    assert declared["EXAMPLE_INTERVAL"] == EXAMPLE_INTERVAL
    body: dict[str, Any] = {
        "setting": setting,
        "driver": SimpleNamespace(EXAMPLE_INTERVAL=EXAMPLE_INTERVAL),
    }
    exec(f"class Fields:\n{field_block}", body)
    documented = dataclass(frozen=True)(body["Fields"])
    assert bindings(documented) == bindings(WithExample)[-1:]
    assert [f.type for f in fields(documented)] == [fields(WithExample)[-1].type]


def test_a_new_setting_joins_the_table_at_its_fields_place() -> None:
    assert options_of(WithExample) == (*OPTIONS, EXAMPLE_INTERVAL)
    assert EXAMPLE_INTERVAL not in OPTIONS


@pytest.mark.parametrize(
    ("argv", "env", "in_file", "expected", "named"),
    [
        pytest.param([], {}, False, 7.0, "--example-interval", id="default"),
        pytest.param([], {}, True, 3.0, "config file key 'example-interval'", id="file"),
        pytest.param([], {"EXAMPLE_INTERVAL": "4"}, True, 4.0, "EXAMPLE_INTERVAL", id="alias"),
        pytest.param([], {"GPUAGENT_EXAMPLE_INTERVAL": "5", "EXAMPLE_INTERVAL": "4"}, True, 5.0,
                     "GPUAGENT_EXAMPLE_INTERVAL", id="env-before-alias"),
        pytest.param(["--example-interval", "6"], {"GPUAGENT_EXAMPLE_INTERVAL": "5"}, True, 6.0,
                     "--example-interval", id="flag"),
    ],
)  # fmt: skip
def test_a_new_setting_is_read_by_precedence(
    tmp_path: Path,
    argv: list[str],
    env: dict[str, str],
    in_file: bool,
    expected: float,
    named: str,
) -> None:
    config = write_config(tmp_path, "example-interval: 3\n" if in_file else "")
    settings = load_as(WithExample, [*argv, "--config", str(config)], env)
    assert settings.example_interval == expected
    assert settings.named("example_interval") == named
    assert settings.as_dict()["example_interval"] == expected


@pytest.mark.parametrize(
    ("argv", "env", "body", "key"),
    [
        pytest.param(["--example-interval", "0"], {}, "", "--example-interval", id="flag"),
        pytest.param([], {"EXAMPLE_INTERVAL": "-1"}, "", "EXAMPLE_INTERVAL", id="alias"),
        pytest.param([], {}, "example-interval: soon\n", "config file key 'example-interval'",
                     id="file"),
    ],
)  # fmt: skip
def test_a_new_settings_error_names_what_was_typed(
    tmp_path: Path, argv: list[str], env: dict[str, str], body: str, key: str
) -> None:
    config = write_config(tmp_path, body)
    with pytest.raises(ConfigError) as info:
        load_as(WithExample, [*argv, "--config", str(config)], env)
    assert info.value.key == key


def test_a_new_setting_is_in_the_help_and_the_docs_table() -> None:
    options = options_of(WithExample)
    help_text = " ".join(build_parser(options).format_help().split())
    assert (
        "--example-interval SECONDS seconds between examples (default 7) "
        "[env GPUAGENT_EXAMPLE_INTERVAL, EXAMPLE_INTERVAL]"
    ) in help_text
    table = gen_files().options_table(WithExample)
    assert (
        "| `--example-interval SECONDS` | `GPUAGENT_EXAMPLE_INTERVAL`<br>`EXAMPLE_INTERVAL` "
        "| `example-interval` | `7` | seconds between examples |"
    ) in table.splitlines()


def test_the_settings_without_the_new_option_refuse_it(tmp_path: Path) -> None:
    """The throwaway option is the test's own: the agent's table does not know it."""
    config = write_config(tmp_path, "example-interval: 3\n")
    with pytest.raises(ConfigError) as info:
        load_as(Settings, ["--config", str(config)], {})
    assert info.value.key == "config file key 'example-interval'"
    with pytest.raises(ConfigError) as info:
        load_as(Settings, [], {"GPUAGENT_EXAMPLE_INTERVAL": "3"})
    assert info.value.key == "GPUAGENT_EXAMPLE_INTERVAL"
