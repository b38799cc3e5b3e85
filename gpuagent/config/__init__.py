"""Command line, environment and config-file settings, resolved with flag > env > file > default.

The package by noun: :mod:`.option` (what an option is: flag, key, environment names, parser,
default, help; and how a field of the settings takes its value from one), :mod:`.groups` (the
options, by the subsystem they configure), :mod:`.settings` (the resolved type: a field per
option, in ``--help`` order), :mod:`.options` (the option table, read off those fields),
:mod:`.values` (parsers of one raw value), :mod:`.sharing` (NVIDIA's time-slicing block),
:mod:`.cli` (the argument parser), :mod:`.sources` (flags, environment, the config file),
:mod:`.errors` and :mod:`.load` (putting them together, and the rules between settings);
:mod:`.planning` says what resolved settings mean for the agent (the plan the store keeps).
"""

from gpuagent.config.errors import ConfigError
from gpuagent.config.groups.nodefiles import CDI_SPEC_TOOLKIT
from gpuagent.config.load import load_settings
from gpuagent.config.options import FILE_KEYS, OPTIONS
from gpuagent.config.settings import Settings
from gpuagent.config.sharing import parse_sharing, sharing_block

__all__ = [
    "ConfigError",
    "Settings",
    "load_settings",
    "parse_sharing",
    "sharing_block",
    "OPTIONS",
    "FILE_KEYS",
    "CDI_SPEC_TOOLKIT",
]
