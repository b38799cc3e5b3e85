"""What an operator may have meant by a flag, variable or config key that names no option.

Besides the near misses (``GPUAGENT_MIG_STRATEGIES``), an operator writes an option as its
value's kind reads: ``GPUAGENT_CONFIG_FILE`` for ``--config FILE``, ``--poll-interval-seconds``
for ``--poll-interval SECONDS``, or a flag's alias as a variable (``GPUAGENT_DRIVER_ROOT`` for
``--driver-root``). Each such spelling is taken as the option it describes before any near
miss is ranked, and a real option's name is never taken for another.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Mapping

from gpuagent.config.option import Option
from gpuagent.config.options import OPTIONS

__all__ = ["closest_flag", "closest_key", "closest_variable"]


def _table(real: Mapping[str, str], described: list[tuple[str, str]]) -> Mapping[str, str]:
    """Spelling → the real name it stands for: the real names, then each described spelling
    that is no real name and describes one option only."""
    owners: dict[str, set[str]] = {}
    for spelling, name in described:
        owners.setdefault(spelling, set()).add(name)
    table = {s: next(iter(n)) for s, n in owners.items() if len(n) == 1 and s not in real}
    return {**table, **real}


def _kind(opt: Option[object]) -> str | None:
    """The kind of value the option takes, as its metavar says it (FILE, DIR, SECONDS...)."""
    metavar = opt.metavar
    return metavar if metavar and metavar.isalpha() and not opt.is_bool else None


@functools.cache
def _variables() -> Mapping[str, str]:
    real = {name: name for opt in OPTIONS for name in opt.env_names}
    described: list[tuple[str, str]] = []
    for opt in OPTIONS:
        own = opt.env_names[0]
        kind = _kind(opt)
        if kind:
            described.append((f"{own}_{kind.upper()}", own))
        for alias in opt.aliases:
            described.append((f"GPUAGENT_{alias.lstrip('-').replace('-', '_').upper()}", own))
    return _table(real, described)


@functools.cache
def _flags() -> Mapping[str, str]:
    real = {s: s for opt in OPTIONS for s in (f"--{opt.name}", *opt.aliases)}
    described = [
        (f"--{opt.name}-{kind.lower()}", f"--{opt.name}") for opt in OPTIONS if (kind := _kind(opt))
    ]
    return _table(real, described)


@functools.cache
def _keys() -> Mapping[str, str]:
    real = {opt.name: opt.name for opt in OPTIONS if opt.in_file}
    described = [
        (f"{opt.name}-{kind.lower()}", opt.name)
        for opt in OPTIONS
        if opt.in_file and (kind := _kind(opt))
    ]
    described += [(alias.lstrip("-"), opt.name) for opt in OPTIONS for alias in opt.aliases]
    return _table(real, described)


def _closest(given: str, table: Mapping[str, str]) -> str | None:
    if given in table:
        return table[given]
    close = difflib.get_close_matches(given, list(table), n=1)
    return table[close[0]] if close else None


def closest_variable(name: str) -> str | None:
    """The option variable ``name`` (a ``GPUAGENT_*`` variable that is none) likely means."""
    return _closest(name, _variables())


def closest_flag(flag: str) -> str | None:
    """The flag ``flag`` (``--name``, without its value) likely means."""
    return _closest(flag, _flags())


def closest_key(key: str) -> str | None:
    """The config file key ``key`` likely means."""
    return _closest(key, _keys())
