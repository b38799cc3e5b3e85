"""The option table: every option, in ``--help`` order, which is the order of the fields of
:class:`~gpuagent.config.settings.Settings` that take their values from them; and the config
file's keys."""

from __future__ import annotations

from typing import Any

from gpuagent.config.option import Option, options_of
from gpuagent.config.settings import Settings

OPTIONS: tuple[Option[Any], ...] = options_of(Settings)
FILE_KEYS = tuple(opt.name for opt in OPTIONS if opt.in_file)
