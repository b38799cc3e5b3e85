"""An option (:class:`Option`: flag, config key, environment names, parser, help) and the config
file's version. The options themselves are in :mod:`gpuagent.config.groups`, by subsystem;
:mod:`gpuagent.config.options` lists them in ``--help`` order."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")

CONFIG_VERSION = "v1"


@dataclass(frozen=True, slots=True)
class Option(Generic[T]):
    """One setting: its flag spelling, config key, environment names and parser.

    ``live``: a reload applies it without a restart (the plan holds it: see
    :mod:`gpuagent.config.planning`); any other setting is read once, at start.
    """

    name: str
    parse: Callable[[object], T]
    help: str
    metavar: str | None = None
    aliases: tuple[str, ...] = ()
    env_aliases: tuple[str, ...] = ()
    is_bool: bool = False
    in_file: bool = True
    live: bool = False

    @property
    def dest(self) -> str:
        return self.name.replace("-", "_")

    @property
    def env_names(self) -> tuple[str, ...]:
        return (f"GPUAGENT_{self.dest.upper()}", *self.env_aliases)
