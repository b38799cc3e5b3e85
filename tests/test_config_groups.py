"""The option table is assembled from the groups: every option defined in a group is listed once."""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

import gpuagent.config.groups
from gpuagent.config import OPTIONS
from gpuagent.config.option import Option


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
