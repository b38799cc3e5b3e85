"""A flag, variable or config key that names no option gets the option the operator meant,
over the whole option table: its value's kind spelt out (``GPUAGENT_CONFIG_FILE`` for ``--config
FILE``), a flag alias as a variable, a character dropped."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from gpuagent.config import OPTIONS, ConfigError, load_settings
from gpuagent.config.option import Option
from gpuagent.config.spellings import closest_flag, closest_key, closest_variable

VARIABLES = {name for opt in OPTIONS for name in opt.env_names}
FLAGS = {s for opt in OPTIONS for s in (f"--{opt.name}", *opt.aliases)}
KEYS = {opt.name for opt in OPTIONS if opt.in_file}


def _kinds() -> list[tuple[Option[object], str]]:
    return [
        (opt, opt.metavar)
        for opt in OPTIONS
        if opt.metavar and opt.metavar.isalpha() and not opt.is_bool
    ]


def _one_dropped(name: str, start: int) -> list[str]:
    """``name`` with one character dropped, at each place from ``start`` (no empty word)."""
    out = [name[:i] + name[i + 1 :] for i in range(start, len(name))]
    return [s for s in out if "__" not in s and "--" not in s[2:] and not s.endswith(("_", "-"))]


def test_the_config_file_variable_means_config() -> None:
    """The walk's case: not GPUAGENT_WEB_CONFIG_FILE."""
    with pytest.raises(ConfigError) as caught:
        load_settings([], {"GPUAGENT_CONFIG_FILE": "/etc/gpuagent/config.yaml"})
    assert "did you mean GPUAGENT_CONFIG?" in str(caught.value)


@pytest.mark.parametrize(("opt", "kind"), _kinds(), ids=lambda v: getattr(v, "name", v))
def test_an_option_with_its_value_s_kind_spelt_out_means_the_option(
    opt: Option[object], kind: str
) -> None:
    own = opt.env_names[0]
    for given, means, closest in (
        (f"{own}_{kind.upper()}", own, closest_variable),
        (f"--{opt.name}-{kind.lower()}", f"--{opt.name}", closest_flag),
        (f"{opt.name}-{kind.lower()}", opt.name, closest_key),
    ):
        if given not in VARIABLES | FLAGS | KEYS and (opt.in_file or closest is not closest_key):
            assert closest(given) == means, given


@pytest.mark.parametrize("opt", [o for o in OPTIONS if o.aliases], ids=lambda o: o.name)
def test_a_flag_alias_as_a_variable_means_the_option(opt: Option[object]) -> None:
    for alias in opt.aliases:
        given = f"GPUAGENT_{alias.lstrip('-').replace('-', '_').upper()}"
        if given not in VARIABLES:
            assert closest_variable(given) == opt.env_names[0], given


@pytest.mark.parametrize(
    ("names", "start", "closest"),
    [
        (sorted(VARIABLES), len("GPUAGENT_"), closest_variable),
        (sorted(FLAGS), len("--"), closest_flag),
        (sorted(KEYS), 0, closest_key),
    ],
    ids=["variables", "flags", "keys"],
)
def test_a_character_dropped_means_the_name_it_was_dropped_from(
    names: list[str], start: int, closest: Callable[[str], str | None]
) -> None:
    wrong = []
    for name in names:
        for given in _one_dropped(name, start):
            if given not in VARIABLES | FLAGS | KEYS and closest(given) != name:
                wrong.append((given, closest(given)))
    assert wrong == []
